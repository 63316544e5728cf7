"""FastV: rank context tokens by the attention of the last query at layer K-1 and drop the lowest
from every layer >= K (arXiv:2403.06764).

At each compression point, the score of a stored position is the attention the last query of the
forward gave it at layer ``layer - 1``, averaged over every query head (a head that does not
store the position gives it 0). Every layer from ``layer`` up keeps the same positions in every
KV head: sinks, the window and protected positions, then the best-ranked positions up to the
capacity; layers below ``layer`` keep everything, so the stack's budget applies to layers >= K.

Differences from the paper: FastV drops image tokens inside the prefill forward (layers >= K never
compute them); kvbench drops them from the cache after the forward, at every compression point
(docs/methods.md), for any token. The paper's text ranks by the average attention a token receives;
its released code, followed here as docs/methods.md says, ranks by the last token's attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvbench.cache import attention as att
from kvbench.cache import devices
from kvbench.cache.surface import TechniqueStore
from kvbench.errors import ConfigError
from kvbench.roles import BindContext, Compressor, Flags, keep_top


@dataclass
class FastVCompressor(Compressor):
    """Keeps, in every layer >= ``layer``, the positions the last query attended to most at ``layer - 1``.

    Args:
        layer: K, the first layer that drops tokens (1 <= K < number of layers).
    """

    name: str = "fastv"
    # 2: the decode step of issue 29 (CHANGELOG.md); 3: a decode step's few leaving tokens go as
    # drops (the last tokens into the freed slots), not a compaction (issue 29)
    # 4: its logits in the keys' dtype (bfloat16/float16 only, CHANGELOG.md)
    version = 4
    layer: int = 2
    flags = Flags(needs_attention_scores=True, evicts_tokens=True)
    _score: torch.Tensor | None = field(default=None, init=False, repr=False)  # (B, P) the last query's
    # (seen at planning, keep (B, P)): the plan of a step, made once for its layers
    _plan: tuple[tuple[int, ...], torch.Tensor] | None = field(default=None, init=False, repr=False)

    def check_knobs(self) -> None:
        if self.layer < 1:
            raise ConfigError(f"compressor.layer={self.layer}: must be >= 1 (layer K-1 ranks the tokens)")

    def on_bind(self, ctx: BindContext) -> None:
        if self.layer >= ctx.num_layers:
            raise ConfigError(
                f"compressor.layer={self.layer}: must be < the model's {ctx.num_layers} layers (and >= 1)"
            )
        self._score, self._plan = None, None

    def observed_from(self, layer: int, q: int, padded: bool) -> int:
        if layer != self.layer - 1:
            return q  # FastV reads one layer's scores
        return 0 if padded else q - 1  # of the last query

    def observe(self, layer: int, store: TechniqueStore, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        if layer != self.layer - 1:
            return
        b, h, g = probs.shape[:3]
        rows: torch.Tensor | None = None  # (B,): the sequences whose last token is a query here
        if qpos.shape[1] == 1 and qpos.shape == store.last_qpos.shape and not store.last_padded:
            observed = probs.sum((2, 3))  # one unpadded step: every query is its sequence's last token
        else:
            last = (qpos == store.seen[:, None] - 1) & (qpos >= 0)  # (B, q)
            rows = last.any(-1)
            if not bool(rows.any()):
                return
            observed = (probs * last[:, None, None, :, None]).sum((2, 3))
        pos = store.view().pos
        per_head = att.widen(observed, pos.shape[2])  # (B, H, T)
        width = store.seen_max
        score = per_head.new_zeros(b, width + 1).scatter_add_(
            -1, torch.where(pos >= 0, pos, width).reshape(b, -1), per_head.reshape(b, -1)
        )[:, :width] / (h * g)
        old = self._score
        if rows is not None and old is not None and old.shape[0] == b:  # the others keep theirs
            old = F.pad(old, (0, max(0, width - old.shape[1])))[:, :width]
            score = torch.where(rows[:, None], score, old)
        self._score = score

    def compress(self, layer: int, store: TechniqueStore) -> None:
        if layer < self.layer:
            return
        plan = self._plan
        seen = tuple(store.seen_host)  # the host's copy: no device read to know the plan is current
        if layer == self.layer or plan is None or plan[0] != seen:
            plan = self._plan = (seen, self._keep_positions(store))
        keep_pos = store.local(plan[1])  # layer K's plan, for every later layer
        view = store.view()
        width = keep_pos.shape[-1]
        idx = view.pos.clamp(min=0, max=width - 1).reshape(view.pos.shape[0], -1)
        keep = torch.gather(keep_pos, -1, idx).view_as(view.pos)
        if not view.dense:
            keep = keep & view.valid
        store.keep(keep, few=True)  # nothing moves where every token stays; a few leave in O(few)

    def _keep_positions(self, store: TechniqueStore) -> torch.Tensor:
        """``(B, P)`` bool: protected positions plus the best-ranked stored ones, up to the capacity."""
        view = store.view()
        b, width = store.batch, store.seen_max
        idx = (view.pos if view.dense else torch.where(view.valid, view.pos, width)).reshape(b, -1)
        present = torch.zeros(b, width + 1, dtype=torch.bool, device=store.device)
        present = present.scatter_(-1, idx, True)[:, :width]  # stored in some head of this layer
        score = torch.zeros(b, width, device=store.device)
        if self._score is not None and self._score.shape[0] == b:
            known = min(width, self._score.shape[1])
            score[:, :known] = store.local(self._score)[:, :known]  # scored at layer K - 1
        allpos = devices.arange(width, store.seen)
        protect_from = None if store.protect_from is None else store.protect_from[:, None]
        protected = self.budget.protected(allpos[None, :], store.seen[:, None], protect_from)
        score = score.masked_fill(protected, float("inf"))
        cap = self.budget.capacity_of(store)
        # one length, only sinks and window protected: at most min(seen, sinks + window) of them,
        # never above the capacity, so it is kept exactly, nothing counted
        fit = isinstance(cap, int) and store.protect_from_host is None
        return keep_top(score[:, None], present[:, None], cap, fit)[:, 0]
