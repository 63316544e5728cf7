"""Compaction after an eviction as a Triton kernel, beside its torch reference: every head-row's
kept slots move to its front, in order, field by field (keys, values, positions, per-token
state), in one pass that reads each kept slot once and writes it at its new column.

The torch path (:class:`kvbench.cache.rows._Compaction`) plans the move once for every field
(the kept slots' flat indices, and their new columns where rows keep different numbers) and
applies it with ``index_select`` and ``index_copy_``; the kernel needs no plan: a program takes
one head-row, walks its slots a block at a time and ranks the kept ones by a running count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 64  # slots a program reads at a time
BLOCK_E = 128  # elements of a slot (a key's channels) it copies at a time


@triton.jit
def _compact_kernel(
    values, keep, out, W, E, width, stride_v, stride_out,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    kept = 0  # the row's kept slots so far: the next one's column
    for t0 in range(0, W, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        k = tl.load(keep + row * W + t, mask=t < W, other=0).to(tl.int32)
        col = kept + tl.cumsum(k, axis=0) - 1  # each kept slot's new column
        moving = k != 0
        for e0 in range(0, E, BLOCK_E):
            ok = moving[:, None] & ((e0 + e) < E)[None, :]
            x = tl.load(values + row * stride_v + t[:, None] * E + (e0 + e)[None, :], mask=ok)
            tl.store(out + row * stride_out + col[:, None] * E + (e0 + e)[None, :], x, mask=ok)
        kept += tl.sum(k, axis=0)
    # a row that keeps fewer than the widest: its slots up to ``width`` read as zeros
    for t0 in range(0, width, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        for e0 in range(0, E, BLOCK_E):
            ok = ((t >= kept) & (t < width))[:, None] & ((e0 + e) < E)[None, :]
            zero = tl.zeros((BLOCK_T, BLOCK_E), dtype=out.dtype.element_ty)
            tl.store(out + row * stride_out + t[:, None] * E + (e0 + e)[None, :], zero, mask=ok)


def _as_elements(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(BH, slots, E)``: booleans as bytes (Triton stores no int1 from memory)."""
    x = x.view(torch.uint8) if x.dtype == torch.bool else x
    return x.reshape(x.shape[0], x.shape[1], -1)


def compact_into(values: torch.Tensor, keep: torch.Tensor, out: torch.Tensor, width: int) -> None:
    """Write each row's kept slots of ``values`` ``(BH, W, ...)`` (``keep`` ``(BH, W)`` bool) to
    the front of its row of ``out`` ``(BH, capacity, ...)`` in order; slots from a row's kept
    count up to ``width`` (the most any row keeps) become zeros, those past ``width`` stay as
    they are."""
    bh, w = keep.shape
    if not bh:
        return
    src, dst = _as_elements(values.contiguous()), _as_elements(out)
    assert dst.is_contiguous() or dst.stride(1) == dst.shape[2], "out: slots of E contiguous elements"
    _compact_kernel[(bh,)](
        src, keep.contiguous().view(torch.uint8), dst, w, src.shape[2], width, src.stride(0),
        dst.stride(0), BLOCK_T=BLOCK_T, BLOCK_E=min(BLOCK_E, triton.next_power_of_2(src.shape[2])),
    )  # fmt: skip


def compact_into_reference(values: torch.Tensor, keep: torch.Tensor, out: torch.Tensor, width: int) -> None:
    """:func:`compact_into` in torch, slot by slot: the kept slots row after row, and their new
    columns from a running count (the store's own path plans this once for every field)."""
    rows, cols = keep.nonzero(as_tuple=True)
    new = keep.long().cumsum(-1)[rows, cols] - 1
    out[:, :width] = 0
    out[rows, new] = values[rows, cols]
