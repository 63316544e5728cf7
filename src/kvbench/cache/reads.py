"""What a read selector reads: the stored bytes of each token, and the bytes a query reads.

Shared by ``quest`` and the routers, so "bytes read per step" means the same thing for both: the
stored bytes (packed data plus each token's share of its group's scales, zero points and counts)
of every token a real query attends to, summed over layers, averaged over queries.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    real = (qpos >= 0)[:, None, :, None]
    if qpos.shape[1] == 1 == store.last_qpos.shape[1]:  # one step: every stored token is in its past
        return view.valid[:, :, None, :] & real
    vis = view.valid[:, :, None, :] & (view.pos[:, :, None, :] <= qpos[:, None, :, None])
    return vis & real


SETTLE_EVERY = 4096  # pending read counts resolved into floats at most this many calls apart


@dataclass
class ReadCount:
    """One selector call's reads, kept as tensors until :meth:`resolve` (no device sync per call).

    Attributes:
        nbytes: bytes read, summed over queries and heads: a float64 tensor where a grouped
            segment shares its parameters among its tokens, else ``(bytes per token, tokens read)``
            of each segment (whole bytes, summed exactly in Python).
        n_read, n_visible: tokens read and visible, summed; n_queries: real queries.
    """

    nbytes: torch.Tensor | list[tuple[int, torch.Tensor]]
    n_read: torch.Tensor
    n_visible: torch.Tensor
    n_queries: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        """The count's tensors, in the order :meth:`resolve` takes their values."""
        parts = [n for _, n in self.nbytes] if isinstance(self.nbytes, list) else [self.nbytes]
        return [*parts, self.n_read, self.n_visible, self.n_queries]

    def resolve(self, values: list[float] | None = None) -> tuple[float, float, float]:
        """Bytes read per real query, and the tokens read and visible (summed over queries and
        heads); from ``values`` of :meth:`tensors` already read (:func:`read_all`), else read now."""
        values = read_all(self.tensors()) if values is None else values
        *parts, n_read, n_visible, n_queries = values
        if isinstance(self.nbytes, list):
            total = float(sum(per * int(n) for (per, _), n in zip(self.nbytes, parts)))
        else:
            total = parts[0]
        return total / max(int(n_queries), 1), n_read, n_visible


def read_all(tensors: list[torch.Tensor]) -> list[float]:
    """The values of 0-d ``tensors`` as floats (float64: whole counts below 2**53 exactly), with
    one read per device, not one per tensor."""
    out: list[float] = [0.0] * len(tensors)
    devices: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        devices.setdefault(t.device, []).append(i)
    for idx in devices.values():
        for i, value in zip(idx, torch.stack([tensors[i].double() for i in idx]).tolist()):
            out[i] = value
    return out


def resolve_all(
    counts: list[ReadCount], extra: list[torch.Tensor]
) -> tuple[list[tuple[float, float, float]], list[float]]:
    """:meth:`ReadCount.resolve` of every count, and the values of ``extra`` 0-d tensors, with
    one read per device."""
    tensors = [c.tensors() for c in counts]
    values = read_all([t for ts in tensors for t in ts] + extra)
    out, at = [], 0
    for count, ts in zip(counts, tensors):
        out.append(count.resolve(values[at : at + len(ts)]))
        at += len(ts)
    return out, values[at:]


def count_reads(store: LayerStore, mask: torch.Tensor, qpos: torch.Tensor) -> ReadCount:
    """The reads of a selector's ``mask`` ``(B, H, q, T)`` for queries at ``qpos`` ``(B, q)``, as tensors.

    Without a grouped segment every token of a segment costs the same whole bytes, so the bytes
    are each segment's per-token bytes times its tokens read: the float64 sum of
    :func:`token_bytes` over the read tokens gives the same number (whole numbers add exactly).
    """
    vis = visible(store, qpos)
    read = mask & vis
    n_read = read.sum()
    segs = store.segments
    nbytes: torch.Tensor | list[tuple[int, torch.Tensor]]
    if any(isinstance(seg, GroupedSegment) and seg.size for seg in segs):
        nbytes = torch.where(read, token_bytes(store)[:, :, None, :], 0.0).sum()
    elif len(segs) == 1:
        nbytes = [(segs[0].token_nbytes(), n_read)]
    else:
        nbytes, start = [], 0
        for seg, width in zip(segs, store.view().widths):
            nbytes.append((seg.token_nbytes(), read[..., start : start + width].sum()))
            start += width
    return ReadCount(nbytes, n_read, vis.sum(), (qpos >= 0).sum())
