"""What a read selector reads: the stored bytes of each token, and the bytes a query reads.

Shared by ``quest`` and the routers, so "bytes read per step" means the same thing for both: the
stored bytes (packed data plus each token's share of its group's scales, zero points and counts)
of every token a real query attends to, summed over layers, averaged over queries.
"""

from __future__ import annotations

import torch

from kvbench.cache.segments import GroupedSegment
from kvbench.cache.store import LayerStore


def token_bytes(store: LayerStore) -> torch.Tensor:
    """Stored bytes of every token, aligned with ``store.view()``: ``(B, H, T)`` float64.

    A token costs its per-token data fields; a grouped segment's per-group fields (scales, zero
    points, live counts) are shared equally by the group's live tokens, so a head-row's sum is
    exactly its stored bytes.
    """
    parts = []
    for seg in store.segments:
        valid = seg.rows.valid()
        padded = torch.zeros(valid.shape, dtype=torch.float64, device=store.device)
        flat = torch.full((seg.size,), float(seg.token_nbytes()), dtype=torch.float64, device=store.device)
        if isinstance(seg, GroupedSegment) and seg.size:
            flat = flat + seg.group_nbytes() / seg.gcount.double()[seg.group_ids()]
        padded[valid] = flat
        parts.append(padded)
    return torch.cat(parts, dim=1).view(store.batch, store.kv_heads, -1)


def visible(store: LayerStore, qpos: torch.Tensor) -> torch.Tensor:
    """``(B, H, q, T)``: the stored tokens each real query may attend to (causal by position)."""
    view = store.view()
    vis = view.valid[:, :, None, :] & (view.pos[:, :, None, :] <= qpos[:, None, :, None])
    return vis & (qpos >= 0)[:, None, :, None]


def read_per_query(store: LayerStore, mask: torch.Tensor, qpos: torch.Tensor) -> tuple[float, float, float]:
    """Bytes read per real query, and the tokens read and visible (summed over queries and heads).

    Args:
        store: the layer's cache; mask: ``(B, H, q, T)`` the selector's read mask; qpos: ``(B, q)``.
    """
    vis = visible(store, qpos)
    read = mask & vis
    nq = max(int((qpos >= 0).sum()), 1)
    nbytes = float(torch.where(read, token_bytes(store)[:, :, None, :], 0.0).sum()) / nq
    return nbytes, float(read.sum()), float(vis.sum())
