"""The three technique roles and what every technique shares.

A technique is a dataclass whose fields are its knobs (from its YAML), plus class-level
capability flags. Legality of a stack is derived from the flags, never from names.
The cache engine calls the hooks below; techniques touch only kvbench's own storage
(:class:`kvbench.cache.store.LayerStore`), never transformers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from kvbench.cache import devices
from kvbench.cache.rotary import Rotary
from kvbench.cache.surface import StoreView, TechniqueStore, protected_from
from kvbench.errors import ConfigError


@dataclass(frozen=True)
class Flags:
    """Capability flags of docs/methods.md."""

    needs_attention_scores: bool = False
    evicts_tokens: bool = False
    changes_representation: bool = False
    selects_reads: bool = False
    places_tiers: bool = False
    lossless: bool = False


@dataclass(frozen=True)
class Budget:
    """The stack-wide budget: fraction (or absolute count) of seen tokens kept, sinks and window.

    Sinks (first tokens) and the window (most recent tokens, full precision) count inside the budget.
    Built from the config's ``budget``, ``budget_tokens``, ``sinks`` and ``window``
    (:meth:`from_config`); their one default is ``conf/config.yaml``'s.
    """

    fraction: float
    budget_tokens: int | None
    sinks: int
    window: int

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"budget={self.fraction}: must be in (0, 1] (fraction of seen tokens kept)")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise ConfigError(f"budget_tokens={self.budget_tokens}: must be a positive integer or null")
        if self.sinks < 0 or self.window < 1:
            raise ConfigError(f"sinks={self.sinks}, window={self.window}: need sinks >= 0 and window >= 1")

    @classmethod
    def from_config(cls, cfg: Any) -> Budget:
        """The budget a resolved config sets: its ``budget``, ``budget_tokens``, ``sinks``, ``window``."""
        return cls(
            fraction=float(cfg.budget),
            budget_tokens=cfg.budget_tokens,
            sinks=int(cfg.sinks),
            window=int(cfg.window),
        )

    @classmethod
    def keep_all(cls) -> Budget:
        """Every token kept: the budget of a stack with no token selection (read by nothing)."""
        return cls(fraction=1.0, budget_tokens=None, sinks=0, window=1)

    def capacity(self, seen: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """Tokens a head-row may keep after ``seen`` ``(B,)`` tokens: ``(B,)``, never fewer than
        sinks + window (nor more than seen). ``weight`` is the layer's share under an allocation."""
        if self.budget_tokens is not None:
            cap = torch.full_like(seen, math.ceil(self.budget_tokens * weight))
        else:
            cap = torch.ceil(self.fraction * weight * seen.double() - 1e-9).long()
        return torch.minimum(cap.clamp(min=self.sinks + self.window), seen)

    def capacity_of(self, store: StoreView) -> int | torch.Tensor:
        """:meth:`capacity` of ``store``'s sequences: one host figure where they have one length
        (:meth:`capacity_host`, the same arithmetic: nothing launched), else ``(B,)`` on the device."""
        seen = store.seen_host
        if min(seen) == max(seen):
            return self.capacity_host(seen[0])
        return self.capacity(store.seen)

    def capacity_host(self, seen: int, weight: float = 1.0) -> int:
        """:meth:`capacity` of one sequence on the host, the same arithmetic (float64, then ceil)."""
        if self.budget_tokens is not None:
            cap = math.ceil(self.budget_tokens * weight)
        else:
            cap = math.ceil(self.fraction * weight * float(seen) - 1e-9)
        return min(max(cap, self.sinks + self.window), seen)

    def protected_host(self, seen: int) -> int:
        """Positions of a sequence that has seen ``seen`` tokens that are sinks or in the window
        (each once), on the host: the first ``min(sinks, seen)``, then the last ``window`` after them."""
        sinks = min(self.sinks, seen)
        return sinks + seen - max(seen - self.window, sinks)

    def protected(
        self, pos: torch.Tensor, seen: torch.Tensor | int, protect_from: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """True where a position is a sink, inside the recent window, or at/after ``protect_from``.

        ``seen`` and ``protect_from`` broadcast against ``pos`` (one per sequence in a batch).
        """
        prot = (pos < self.sinks) | (pos >= seen - self.window)
        return prot if protect_from is None else prot | (pos >= protect_from)

    def protected_view(self, store: TechniqueStore) -> torch.Tensor:
        """:meth:`protected` over ``store.view()``: ``(B, H, T)``."""
        seen = _one(store.seen_host)
        at = store.seen[:, None, None] if seen is None else seen
        return self.protected(store.view().pos, at, protected_from(store))

    def protected_fp(self, store: TechniqueStore) -> torch.Tensor:
        """:meth:`protected` over the full-precision rows: ``(B * H, W)``."""
        heads, start = store.kv_heads, store.protect_from
        from_host = None if store.protect_from_host is None else _one(store.protect_from_host)
        at_start: torch.Tensor | int | None = from_host
        if start is not None and from_host is None:
            at_start = start.repeat_interleave(heads)[:, None]
        seen = _one(store.seen_host)
        at = store.seen.repeat_interleave(heads)[:, None] if seen is None else seen
        return self.protected(store.fp_view("pos"), at, at_start)

    def scaled(self, depth: int) -> Budget:
        """The budget of the ``depth``-th selection of a stack: selections compose multiplicatively."""
        return self if depth <= 1 else replace(self, fraction=self.fraction**depth)


def _one(values: Sequence[int]) -> int | None:
    """The value every sequence shares (host figures), else None: compared with positions as a
    number, it needs no tensor of one value per row."""
    return values[0] if values and all(v == values[0] for v in values) else None


@dataclass
class BindContext:
    """What a technique may know before the first forward.

    Attributes:
        budget: the stack-wide budget, already scaled for this technique's place among selections
            (set by :meth:`kvbench.stack.Stack.bind`).
        model: the :class:`kvbench.models.LoadedModel` (for rotary and calibration), or None.
        calibrations: records of every calibration artifact the stack used (filled by techniques).
    """

    num_layers: int
    budget: Budget = field(default_factory=Budget.keep_all)
    kv_heads: int = 1
    q_heads: int = 1
    head_dim: int = 64
    model: Any = None
    seed: int = 0
    calibrations: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def for_model(cls, lm: Any, seed: int = 0) -> BindContext:
        return cls(
            num_layers=lm.num_layers,
            kv_heads=lm.kv_heads,
            q_heads=int(lm.info.get("heads", lm.kv_heads)),
            head_dim=lm.head_dim,
            model=lm,
            seed=seed,
        )

    def rotary(self):
        """The model's rotary embedding (refused for models without the rotate-half convention)."""
        if self.model is None:
            raise ConfigError("this technique needs a model's rotary embedding (bind with a model)")
        return Rotary.from_model(self.model.model)


class Technique:
    """Base of every router, compressor and scheduler.

    A template: a technique's class (and each mixin) may define ``check_knobs()``, run once its
    knobs are set (refuse bad values with a :class:`ConfigError` naming the key), and
    ``on_bind(ctx)``, run when the stack binds it; the base runs every class's own, base classes
    first, so no technique calls another's.
    """

    role: ClassVar[str] = ""
    flags: ClassVar[Flags] = Flags()
    name: str = ""
    # Bumped by a change that moves any number this technique reports (CHANGELOG.md says what
    # moved); part of the cell's identity from 2 on (:func:`kvbench.stack.stack_identity`), so cells
    # computed before keep their ids and cells computed after get new ones.
    version: ClassVar[int] = 1

    wants_queries: ClassVar[bool] = False  # receive the rotated queries of every forward

    def __post_init__(self) -> None:
        for klass in reversed(type(self).__mro__):
            check = klass.__dict__.get("check_knobs")
            if check is not None:
                check(self)

    def bind(self, ctx: BindContext) -> None:
        """Receive the stack-wide budget (and the model) once, before the first forward."""
        self.ctx = ctx
        self.num_layers = ctx.num_layers
        for klass in reversed(type(self).__mro__):
            hook = klass.__dict__.get("on_bind")
            if hook is not None:
                hook(self, ctx)

    @property
    def budget(self) -> Budget:
        """This technique's budget (bound by the stack; scaled for its place among selections)."""
        return self.ctx.budget

    def observe(self, layer: int, store: TechniqueStore, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        """Attention probabilities of a block of queries (only for ``needs_attention_scores``).

        Args:
            layer: layer index.
            store: the layer's storage; ``probs`` is aligned with ``store.view()``.
            probs: ``(B, H_kv, g, q, w)`` fp32, ``g`` query heads per KV head, for the queries
                from :meth:`observed_from` on (a block at a time), over the first ``w`` columns
                of ``store.view()``: the block's queries read none after them (a causal prefill's
                sub-block; :func:`kvbench.cache.attention.widen` pads a reduction to every
                column); rows of padding queries are zero.
            qpos: ``(B, q)`` positions of the queries (-1 for padding).
        """

    def observed_from(self, layer: int, q: int, padded: bool) -> int:
        """The first of a chunk's ``q`` queries whose scores :meth:`observe` needs at ``layer``
        (``q``: none); scores are computed only from there. ``padded``: the batch has padding, so
        a sequence's last queries are not the chunk's last columns."""
        return 0

    def observe_queries(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> None:
        """The rotated queries ``(B, H_q, q, D)`` of a forward (only for ``wants_queries``)."""

    def watches_queries(self, stores: Sequence[TechniqueStore]) -> bool:
        """Whether :meth:`observe_queries` may still act on any of a cache's ``stores`` (only for
        ``wants_queries``; asked once per forward, by its read plan). False where what the queries
        decide is decided for good (ThinK's kept channels): the forward then reads its cache as if
        the technique had not asked for them."""
        return True

    def read_mask(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        """Which stored tokens each query may read (only for ``selects_reads``).

        Args:
            query: ``(B, H_q, q, D)`` rotated queries.
            qpos: ``(B, q)`` query positions (-1 for padding).

        Returns:
            ``(B, H_kv, q, T)`` bool, aligned with ``store.view()``.
        """
        raise NotImplementedError

    def attend_tiers(
        self,
        layer: int,
        store: TechniqueStore,
        query: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """Attention computed per cache tier (only for ``places_tiers``): ``(B, H_q, q, D)``."""
        raise NotImplementedError

    def metrics(self) -> dict[str, float | list[float] | None]:
        """Technique-specific measured figures for the result record."""
        return {}

    def settle(self) -> None:
        """Fold the figures kept for later into :meth:`metrics`' where enough wait (a read
        selector's read counts): asked by the loop between chunks, outside the timed region, so a
        step's latency holds the technique's work and not kvbench's bookkeeping of it. The figures
        are those of settling at any other time."""


class Scheduler(Technique):
    """Decides which tokens stay in the cache as the sequence grows."""

    role = "scheduler"

    def evict(self, layer: int, store: TechniqueStore) -> None:
        """Called after every forward chunk, after the compressor."""
        raise NotImplementedError


class Compressor(Technique):
    """Decides how retained tokens are stored (or which are kept, once)."""

    role = "compressor"

    def compress(self, layer: int, store: TechniqueStore) -> None:
        """Called after every forward chunk, before the scheduler."""
        raise NotImplementedError


class Router(Technique):
    """Decides which shard of the stored cache each query reads (``read_mask``)."""

    role = "router"

    def write(self, layer: int, store: TechniqueStore) -> None:
        """Called after every forward chunk, last: update shard assignment of stored tokens."""


def keep_top(
    scores: torch.Tensor,
    valid: torch.Tensor | None,
    k: int | torch.Tensor,
    protected_fit: bool = False,
    finite: bool = False,
    by_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask of the ``k`` highest valid scores per head-row (ties: the earlier slot, or with
    ``by_pos`` the earlier position).

    Args:
        scores: ``(B, H, T)``; protected tokens should carry ``+inf`` and are never dropped.
        valid: ``(B, H, T)``, or None when every slot is a real token.
        k: tokens to keep per head-row: an int, or per sequence ``(B,)``, or per head-row ``(B, H)``.
        protected_fit: the caller knows that no head-row holds more than ``k`` (an int) protected
            tokens, so ``k`` is kept exactly, without counting them.
        finite: the caller knows that no valid score is ``+inf`` (nothing protected by its score),
            so ``k`` (an int or a tensor) is kept exactly, without counting them.
        by_pos: ``(B, H, T)`` the columns in position order, valid ones first
            (:meth:`LayerStore.by_position`), where the slots are not: ties then keep the earlier
            position, so the choice does not depend on where the cache put its tokens.

    Returns:
        ``(B, H, T)`` bool.
    """
    b, h, t = scores.shape
    if (protected_fit or finite) and isinstance(k, int):
        kk: torch.Tensor | int = k
    else:
        if isinstance(k, int):  # a view, not an upload (:func:`devices.whole`)
            kk = devices.whole(k, scores) if k >= 0 else torch.tensor(k, device=scores.device)
        else:
            kk = k.long()
        kk = kk.view(b, 1) if kk.dim() == 1 else kk
        kk = kk.expand(b, h) if kk.dim() else kk.expand(b, h)
        if not finite:
            protected = scores == float("inf")
            kk = torch.maximum(kk, (protected if valid is None else protected & valid).sum(-1))
        kk = kk[..., None]
    masked = scores if valid is None else torch.where(valid, scores, float("-inf"))
    if by_pos is None:
        order = masked.argsort(dim=-1, descending=True, stable=True)
    else:  # sorted in position order, then back to the slots
        order = by_pos.gather(-1, masked.gather(-1, by_pos).argsort(dim=-1, descending=True, stable=True))
    # The first kk of each row in sorted order, put back in place.
    kept = (devices.arange(t, scores) < kk).expand(b, h, t)
    kept = torch.empty(b, h, t, dtype=torch.bool, device=scores.device).scatter_(-1, order, kept)
    return kept if valid is None else kept & valid
