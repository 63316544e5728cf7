"""ChunkKV: keep whole chunks of consecutive tokens, scored by observation-window attention
(arXiv:2502.00299).

Per KV head, the unprotected stored tokens are cut into chunks of ``chunk_size`` consecutive
tokens in position order (the last chunk may be shorter); a chunk's score is the sum of its
tokens' SnapKV scores (attention from the last ``obs_window`` queries, summed over the query
group). Chunks are taken best first while they fit whole in the capacity left after sinks, the
window and protected positions, so the kept unprotected tokens always form whole chunks (up to
``chunk_size - 1`` slots of the capacity may stay unused).

With ``reuse_layers = k > 1``, layers go in groups of ``k`` (0..k-1, k..2k-1, ...): the first
layer of a group selects, and the others keep the same positions per KV head (ChunkKV's
layer-wise index reuse) plus their own protected tokens.

Differences from the paper: the selection runs at every compression point (docs/methods.md), not
once after prefill, and chunks are formed over the stored tokens in position order; sinks are
kept besides the window; ``pool`` defaults to 1 (the paper sums raw window attention per chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from kvbench.cache import devices
from kvbench.cache.surface import TechniqueStore
from kvbench.errors import ConfigError
from kvbench.roles import Compressor, Flags
from kvbench.select import Allocated, ObservationWindow, check_window, within


def chunk_keep(
    score: torch.Tensor, pos: torch.Tensor, cand: torch.Tensor, slots: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Whole chunks of candidates, best summed score first, while they fit in ``slots``.

    Args:
        score: ``(B, H, T)`` per-token scores.
        pos: ``(B, H, T)`` positions (chunks follow position order).
        cand: ``(B, H, T)`` tokens that may be chunked (valid and unprotected).
        slots: ``(B, H)`` candidate tokens that may be kept.
        chunk: chunk size.

    Returns:
        ``(B, H, T)`` bool: the kept candidates.
    """
    big = torch.iinfo(pos.dtype).max
    order = torch.where(cand, pos, torch.full_like(pos, big)).argsort(dim=-1, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, devices.arange(pos.shape[-1], pos).expand_as(order))
    cid = torch.where(cand, rank // chunk, torch.zeros_like(rank))  # (B, H, T)
    n = -(-pos.shape[-1] // chunk)
    csum = score.new_zeros(*score.shape[:2], n).scatter_add_(-1, cid, score.float() * cand)
    csize = torch.zeros_like(csum, dtype=torch.long).scatter_add_(-1, cid, cand.long())
    csum = csum.masked_fill(csize == 0, float("-inf"))
    best = csum.argsort(dim=-1, descending=True, stable=True)
    fits = torch.gather(csize, -1, best).cumsum(-1) <= slots[..., None]
    taken = torch.zeros_like(fits).scatter_(-1, best, fits) & (csize > 0)
    return cand & torch.gather(taken, -1, cid)


@dataclass
class ChunkKVCompressor(Allocated, ObservationWindow, Compressor):
    """Keeps the best-scored whole chunks of ``chunk_size`` tokens per KV head.

    Args:
        chunk_size: consecutive stored tokens per chunk.
        reuse_layers: layers per index-reuse group (1: every layer selects on its own).
        obs_window: the last queries whose attention scores the tokens.
        pool: max-pooling kernel of the token scores before summing (odd; 1: none).
        allocation: how the budget is split across layers (``uniform`` when reusing indices).
    """

    name: str = "chunkkv"
    # 2: the decode step of issue 29 (CHANGELOG.md); 3: a decode step's few leaving tokens go as
    # drops (the last tokens into the freed slots), not a compaction (issue 29)
    # 4: its logits in the keys' dtype (bfloat16/float16 only, CHANGELOG.md)
    version = 4
    chunk_size: int = 10
    reuse_layers: int = 1
    obs_window: int = 16
    pool: int = 1
    flags = Flags(needs_attention_scores=True, evicts_tokens=True)
    # (B, H, P) positions kept by the reuse group's first layer
    _chosen: torch.Tensor | None = field(default=None, init=False, repr=False)

    def check_knobs(self) -> None:
        check_window(self.role, self.obs_window, self.pool)
        if self.chunk_size < 1:
            raise ConfigError(f"compressor.chunk_size={self.chunk_size}: must be >= 1")
        if self.reuse_layers < 1:
            raise ConfigError(f"compressor.reuse_layers={self.reuse_layers}: must be >= 1 (1: no reuse)")
        if self.reuse_layers > 1 and self.allocation != "uniform":
            raise ConfigError(
                f"compressor.reuse_layers={self.reuse_layers}: needs allocation=uniform "
                "(reusing layers keep the first layer's positions)"
            )

    def compress(self, layer: int, store: TechniqueStore) -> None:
        if self.reuse_layers == 1 and within(store, partial(self.allocated_capacity_host, layer)):
            return  # every candidate fits its row's slots: every chunk would be kept
        view = store.view()
        protected = self.budget.protected_view(store) & view.valid
        chosen = None if self._chosen is None else store.local(self._chosen)  # the group's first layer's
        if layer % self.reuse_layers and chosen is not None and chosen.shape[:2] == view.pos.shape[:2]:
            chosen = F.pad(chosen, (0, max(0, store.seen_max - chosen.shape[-1])))
            keep = protected | (view.valid & torch.gather(chosen, -1, view.pos.clamp(min=0)))
        else:
            seen = store.seen_host
            if len(set(seen)) == 1:  # one length: the capacity on the host (the same arithmetic)
                cap: torch.Tensor | int = self.allocated_capacity_host(layer, seen[0])
            else:
                cap = self.allocated_capacity(layer, store)[:, None]  # (B, 1)
            slots = (cap - protected.sum(-1)).clamp(min=0)
            cand = view.valid & ~protected
            keep = protected | chunk_keep(self.window_scores(store), view.pos, cand, slots, self.chunk_size)
            if self.reuse_layers > 1:
                self._chosen = by_position(keep, view.pos, store.seen_max)
        if not bool(keep[view.valid].all()):
            store.keep(keep, few=True)


def by_position(mask: torch.Tensor, pos: torch.Tensor, width: int) -> torch.Tensor:
    """``(B, H, width)`` bool: True at the positions where ``mask`` ``(B, H, T)`` is True."""
    out = torch.zeros(*pos.shape[:2], width + 1, dtype=torch.bool, device=pos.device)
    idx = torch.where(mask, pos, torch.full_like(pos, width))  # masked-out slots land in a spare column
    return out.scatter_(-1, idx, True)[..., :width]
