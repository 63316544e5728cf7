"""What a read selector reads: the stored bytes of each token, and the bytes a query reads.

Shared by ``quest`` and the routers, so "bytes read per step" means the same thing for both: the
stored bytes (packed data plus each token's share of its group's scales, zero points and counts)
of every token a real query attends to, summed over layers, averaged over queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.cache.segments import GroupedSegment
from kvbench.cache.surface import StoreView, every_query_real


def token_bytes(store: StoreView) -> torch.Tensor:
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


def one_step(store: StoreView, qpos: torch.Tensor) -> bool:
    """The queries at ``qpos`` are a whole unpadded one-token step and every slot of ``view()`` holds
    a token (from host figures): every query is real and sees every stored token."""
    if qpos.shape[1] != 1 or not every_query_real(store, qpos):
        return False
    return all(s.rows.uniform for s in store.segments)


def visible(store: StoreView, qpos: torch.Tensor) -> torch.Tensor:
    """``(B, H, q, T)``: the stored tokens each real query may attend to (causal by position)."""
    view = store.view()
    real = (qpos >= 0)[:, None, :, None]
    if qpos.shape[1] == 1 == store.last_qpos.shape[1]:  # one step: every stored token is in its past
        return view.valid[:, :, None, :] & real
    vis = view.valid[:, :, None, :] & (view.pos[:, :, None, :] <= qpos[:, None, :, None])
    return vis & real


# Pending read counts are resolved into floats between chunks once this many calls wait
# (:meth:`ReadMeter.due`, outside the timed region), and inside a call only past SETTLE_LIMIT (a
# caller that never settles between chunks).
SETTLE_EVERY = 4096
SETTLE_LIMIT = 4 * SETTLE_EVERY


@dataclass
class ReadCount:
    """One selector call's reads, kept as tensors until :meth:`resolve` (no device sync per call).

    Attributes:
        nbytes: bytes read, summed over queries and heads: a float64 tensor where a grouped
            segment shares its parameters among its tokens, else ``(bytes per token, tokens read)``
            of each segment (whole bytes, summed exactly in Python).
        n_read, n_visible: tokens read and visible, summed; n_queries: real queries.
    """

    nbytes: torch.Tensor | list[tuple[int, torch.Tensor | float]]
    n_read: torch.Tensor | float
    n_visible: torch.Tensor | float
    n_queries: torch.Tensor | float

    def tensors(self) -> list[torch.Tensor | float]:
        """The count's tensors (or host figures, where known), in the order :meth:`resolve` takes
        their values."""
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


def read_all(tensors: Sequence[torch.Tensor | float]) -> list[float]:
    """The values of 0-d ``tensors`` as floats (float64: whole counts below 2**53 exactly), with
    one read per device, not one per tensor; host figures among them are taken as they are."""
    out: list[float] = [0.0] * len(tensors)
    devices: dict[torch.device, dict[torch.dtype, list[tuple[int, torch.Tensor]]]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            devices.setdefault(t.device, {}).setdefault(t.dtype, []).append((i, t))
        else:
            out[i] = float(t)
    for by_dtype in devices.values():
        # those of one dtype stacked, then widened at once (exactly: float64 holds each value)
        pairs = [pair for same in by_dtype.values() for pair in same]
        values = torch.cat([torch.stack([t for _, t in same]).double() for same in by_dtype.values()])
        for (i, _), value in zip(pairs, values.tolist()):
            out[i] = value
    return out


class ReadMeter:
    """The reads of a read selector's calls (Quest, every router), kept as records until settled:
    no device read per call, and one per device for every pending call when settled: between
    chunks once :data:`SETTLE_EVERY` calls wait (:meth:`due`, asked by the loop outside its timed
    region: the read figures are kvbench's bookkeeping, not the selector's work), or when the
    selector's figures are asked for; inside a call only past :data:`SETTLE_LIMIT`.

    A record is anything with ``tensors()``: the 0-d tensors (or host figures) it needs read.
    :meth:`first` tells a repeated call (the engine's KV-hit probe asks again for the same queries)
    from a new one, for a selector that keys its calls.
    """

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self._last: Any = None

    def first(self, key: Any) -> bool:
        """False when ``key`` is that of the last call (a repeat, not counted again)."""
        if key == self._last:
            return False
        self._last = key
        return True

    def add(self, record: Any) -> bool:
        """Keep ``record``; True when the pending records must be settled now (past
        :data:`SETTLE_LIMIT`: nothing settled them between chunks)."""
        self.pending.append(record)
        return len(self.pending) >= SETTLE_LIMIT

    def due(self) -> bool:
        """Whether :data:`SETTLE_EVERY` calls wait to be settled."""
        return len(self.pending) >= SETTLE_EVERY

    def settle(self) -> list[tuple[Any, list[float]]]:
        """The pending records, in call order, each with the values of its ``tensors()``; none
        pending after."""
        pending, self.pending = self.pending, []
        tensors = [record.tensors() for record in pending]
        values = read_all([t for ts in tensors for t in ts])
        out, at = [], 0
        for record, ts in zip(pending, tensors):
            out.append((record, values[at : at + len(ts)]))
            at += len(ts)
        return out


def count_reads(
    store: StoreView,
    mask: torch.Tensor | None,
    qpos: torch.Tensor,
    counted: torch.Tensor | float | None = None,
) -> ReadCount:
    """The reads of a selector's ``mask`` ``(B, H, q, T)`` for queries at ``qpos`` ``(B, q)``, as
    tensors (None: every visible token is read, or ``counted`` of them where the selector counted
    them itself, in a one-token step over one segment).

    Without a grouped segment every token of a segment costs the same whole bytes, so the bytes
    are each segment's per-token bytes times its tokens read: the float64 sum of
    :func:`token_bytes` over the read tokens gives the same number (whole numbers add exactly).
    In a whole one-token step over full rows (:func:`one_step`) the counts of visible tokens and
    queries are host figures, and so is what a ``mask`` of None reads.
    """
    segs = store.segments
    read: torch.Tensor | None
    n_read: torch.Tensor | float
    n_visible: torch.Tensor | float
    n_queries: torch.Tensor | float
    if one_step(store, qpos):  # every query real, every stored token visible to it
        b, q = qpos.shape
        n_visible, n_queries = float(b * store.kv_heads * q * store.columns()), float(b * q)
        read = mask
        n_read = n_visible if mask is None else mask.sum()
        if counted is not None:
            assert mask is None and len(segs) == 1, "count_reads: counted reads are one segment's"
            n_read = counted
    else:
        assert counted is None, "count_reads: counted reads are a one-token step's"
        vis = visible(store, qpos)
        read = vis if mask is None else mask & vis
        n_read, n_visible, n_queries = read.sum(), vis.sum(), (qpos >= 0).sum()
    nbytes: torch.Tensor | list[tuple[int, torch.Tensor | float]]
    if any(isinstance(seg, GroupedSegment) and seg.size for seg in segs):
        if read is None:
            read = visible(store, qpos)
        nbytes = torch.where(read, token_bytes(store)[:, :, None, :], 0.0).sum()
    elif len(segs) == 1:
        nbytes = [(segs[0].token_nbytes(), n_read)]
    else:
        nbytes, start = [], 0
        rows = float(qpos.shape[0] * store.kv_heads * qpos.shape[1])
        for seg, width in zip(segs, [s.rows.width for s in segs]):
            part = rows * width if read is None else read[..., start : start + width].sum()
            nbytes.append((seg.token_nbytes(), part))
            start += width
    return ReadCount(nbytes, n_read, n_visible, n_queries)
