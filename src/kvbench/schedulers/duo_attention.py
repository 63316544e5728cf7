"""DuoAttention: retrieval heads keep the full cache, streaming heads only sinks and the window
(arXiv:2410.10819).

Each layer's KV heads carry a gate in [0, 1], fitted once with the model frozen on synthetic
passkey data (:func:`kvbench.calibration.duo_artifact`: the mixed attention ``g * full + (1 - g) *
streaming`` distilled towards the full model, plus an L1 pull on the gates); the fit is a cached,
recorded calibration artifact. After every forward chunk a streaming head evicts everything but
its sinks, window and protected positions; a retrieval head keeps every token. Heads keep ragged
lengths in storage, so the saving is real. No attention scores are needed at run time.

Differences from the paper:

- The paper turns heads into retrieval heads by a gate threshold chosen for a target sparsity;
  kvbench by default keeps the top ``retrieval_ratio`` share of all heads (all layers together)
  ranked by gate, ``retrieval_ratio`` defaulting to the stack's budget so that budgets compare
  across techniques; ``threshold`` gives the paper's rule instead.
- The paper trains 2,000 steps on long passkey samples; the default here is the shared
  calibration's (50 steps on 8 samples of 1,024 tokens), and every setting is a knob.
- Streaming heads use the stack's sinks and window, the same ones the gates were fitted with.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from kvbench import calibration
from kvbench.cache.surface import TechniqueStore, every_position
from kvbench.errors import ConfigError
from kvbench.roles import BindContext, Flags, Scheduler


@dataclass
class DuoAttentionScheduler(Scheduler):
    """Full cache for the top-gated KV heads, sinks + window for the others.

    Args:
        retrieval_ratio: share of all KV heads (ranked by gate) kept full, in [0, 1]; null with no
            ``threshold``: the stack's budget fraction.
        threshold: heads whose gate is above it are kept full (the paper's rule); excludes
            ``retrieval_ratio``.
        samples, length: passkey samples of the gate fit and tokens of calibration text in each.
        steps, lr, l1: optimizer steps, Adam learning rate and L1 weight on the gates.
        seed: sample order and passkeys of the fit.
    """

    name: str = "duo_attention"
    # 2: a decode step over its rows of different lengths is one masked SDPA on the torch path, not
    # a partial and its merge (issue 29, CHANGELOG.md)
    version = 2
    retrieval_ratio: float | None = None
    threshold: float | None = None
    samples: int = 8
    length: int = 1024
    steps: int = 50
    lr: float = 0.02
    l1: float = 0.05
    seed: int = 0
    flags = Flags(evicts_tokens=True)
    gates: torch.Tensor | None = field(default=None, init=False, repr=False)  # (L, H_kv), bound or injected
    retrieval: torch.Tensor | None = field(default=None, init=False, repr=False)  # (L, H_kv): heads kept full
    injected: bool = field(default=False, init=False)
    # the retrieval rows copied to each layer's device
    _on_device: dict[tuple[int, torch.device], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False
    )
    # per layer, the KV heads that stream, on the host
    _streams: list[tuple[bool, ...]] = field(default_factory=list, init=False, repr=False)
    # per layer: the store, its edits and the sequences' length after an eviction that left every
    # streaming head-row exactly its sinks and window, in position order (where the host knows it)
    # (weakly: a record never keeps a cache's store alive)
    _known: dict[int, tuple[weakref.ref, int, int]] = field(default_factory=dict, init=False, repr=False)

    def check_knobs(self) -> None:
        if self.retrieval_ratio is not None and self.threshold is not None:
            raise ConfigError(
                f"scheduler.threshold={self.threshold}: give retrieval_ratio or threshold, not both"
            )
        for key in ("retrieval_ratio", "threshold"):
            value = getattr(self, key)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"scheduler.{key}={value}: must be in [0, 1] or null")
        minimum = {"samples": 1, "length": 16, "steps": 0}
        for key, low in minimum.items():
            if getattr(self, key) < low:
                raise ConfigError(f"scheduler.{key}={getattr(self, key)}: must be >= {low}")
        if self.lr <= 0:
            raise ConfigError(f"scheduler.lr={self.lr}: must be > 0")
        if self.l1 < 0:
            raise ConfigError(f"scheduler.l1={self.l1}: must be >= 0")

    def inject_gates(self, gates: torch.Tensor) -> None:
        """Use ``gates`` ``(L, H_kv)`` instead of fitting them (before or after ``bind``)."""
        self.gates, self.injected = gates.detach().float().cpu(), True
        if hasattr(self, "budget"):
            self._set_retrieval(self.select_heads(self.gates))

    def on_bind(self, ctx: BindContext) -> None:
        gates = self.gates if self.injected and self.gates is not None else self.fit(ctx)
        if tuple(gates.shape) != (ctx.num_layers, ctx.kv_heads):
            raise ConfigError(
                f"scheduler=duo_attention: gates of shape {tuple(gates.shape)}, "
                f"the model has ({ctx.num_layers}, {ctx.kv_heads}) layers x KV heads"
            )
        self.gates = gates
        self._set_retrieval(self.select_heads(gates))

    def _set_retrieval(self, retrieval: torch.Tensor) -> None:
        self.retrieval = retrieval
        self._streams = [tuple(not r for r in row.tolist()) for row in retrieval]
        self._known.clear()
        self._on_device.clear()

    def fit(self, ctx: BindContext) -> torch.Tensor:
        """The gates of the model's calibration artifact (fitted now unless cached); recorded."""
        if ctx.model is None:
            raise ConfigError(
                "scheduler=duo_attention: fitting the gates needs the model (bind with a model)"
            )
        tensors, record = calibration.duo_artifact(
            ctx.model,
            sinks=self.budget.sinks,
            window=self.budget.window,
            samples=self.samples,
            length=self.length,
            steps=self.steps,
            lr=self.lr,
            l1=self.l1,
            seed=self.seed,
        )
        if record not in ctx.calibrations:
            ctx.calibrations.append(record)
        return tensors["gates"].float()

    def select_heads(self, gates: torch.Tensor) -> torch.Tensor:
        """``(L, H_kv)`` bool: the retrieval heads, by ``threshold`` or as the top-gated share."""
        if self.threshold is not None:
            return gates > self.threshold
        ratio = self.retrieval_ratio
        if ratio is None:
            if self.budget.budget_tokens is not None:
                raise ConfigError(
                    "scheduler.retrieval_ratio=null: the stack's budget is budget_tokens, not a fraction; "
                    "set retrieval_ratio or threshold"
                )
            ratio = self.budget.fraction
        n = gates.numel()
        top = gates.flatten().argsort(descending=True, stable=True)[: math.ceil(ratio * n - 1e-9)]
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[top] = True
        return chosen.view_as(gates)

    def evict(self, layer: int, store: TechniqueStore) -> None:
        """The streaming heads keep their sinks and window (and the protected positions); the
        retrieval heads keep every token.

        Where the host knows the layout (one in-order segment, the sequences at one length, no
        padding, nothing protected past the window), every streaming head-row holds its sinks and
        window after an eviction. When the next eviction of the layer comes one token later, with
        nothing else evicted or moved since, the token leaving each streaming head-row is the
        one right after its sinks: that column closes (:meth:`LayerStore.close_column`, O(window)
        writes a head-row) where a keep would compact every row. The same tokens stay, in the same
        order, as the keep leaves them."""
        assert self.retrieval is not None, "duo_attention: bind before the first forward"
        sinks, window = self.budget.sinks, self.budget.window
        seen = store.seen_host
        if not any(self._streams[layer]) or max(seen) <= sinks + window:
            return  # no streaming head, or every stored position is a sink or in the window
        plain = (
            min(seen) == max(seen)
            and not store.last_padded
            and store.protect_from_host is None
            and store.in_position_order()
        )
        known = self._known.pop(layer, None)
        if known is not None and (known[0]() is not store or known[1] != store.edits):
            known = None  # another store, or its tokens changed since
        if plain and known is not None and seen[0] == known[2] + 1:
            store.close_column(sinks, sinks + window + 1, self._streams[layer])
            self._known[layer] = (weakref.ref(store), store.edits, seen[0])
            return
        key = (layer, store.device)
        full = self._on_device.get(key)  # (1, H, 1): copied to the layer's device once
        if full is None:
            full = self._on_device[key] = self.retrieval[layer].to(store.device)[None, :, None]
        # the streaming head-rows held their sinks and every position from some point on: after
        # the keep, their sinks and window exactly
        held = plain and (known is not None or every_position(store))
        store.keep(self.budget.protected_view(store) | full)  # nothing moves where nothing leaves
        if held:
            self._known[layer] = (weakref.ref(store), store.edits, seen[0])

    def metrics(self) -> dict[str, float | list[float] | None]:
        if self.retrieval is None:
            return {}
        return {
            "retrieval_heads": float(self.retrieval.sum()),
            "retrieval_fraction": float(self.retrieval.float().mean()),
            "retrieval_heads_per_layer": self.retrieval.sum(-1).float().tolist(),
        }
