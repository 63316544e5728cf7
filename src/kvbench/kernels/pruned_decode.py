"""Fused decode attention over ThinK's pruned keys: one query step reads each token's kept key
channels and its values as stored, and rebuilds no full key in memory, beside its torch reference
(scatter the kept channels into zeros, then attention).

A pruned segment stores keys as ``kp`` ``(N, d_keep)``, the channels ``channels`` ``(BH, d_keep)``
of each head-row kept, and values ``v`` ``(N, D)`` whole. The pruned channels of a key are zeros,
so ``q · k`` is ``q[channels] · kp``: a program takes the query heads of one KV head (grouped-query
attention: the group shares its head-row's channels) for one query position and one split of the
head-row's tokens, loads the group's query at the head-row's kept channels once, then scores each
block of kept channels against it and accumulates the values. The split's softmax state
(:class:`kvbench.kernels.attention.Partials`) merges with the full-precision window's by
log-sum-exp (:func:`kvbench.kernels.attention.merge`). It serves steps that read every stored
token (no read selector, window or padding), head-rows of equal or different lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbench.cache import attention as att
from kvbench.cache import ragged
from kvbench.kernels import dispatch
from kvbench.kernels.attention import (
    BLOCK_T,
    Partials,
    attend_block,
    blocks,
    empty_partials,
    head_row_layout,
    no_reads,
    pow2,
    split_slots,
    store_partials,
)


@triton.jit(do_not_specialize=["slots_per_split", "ROW_LEN", "ROW_STRIDE"])
def _pruned_decode_kernel(
    q, kp, v, channels, lens, starts, m_out, l_out, acc_out,
    H, G, Q, D, KEEP, slots_per_split, scaling, sq_b, sq_h, sq_q, ROW_LEN, ROW_STRIDE,
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    FP32: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # (b, KV head, query position)
    split = tl.program_id(1)
    qi = row % Q
    bh = row // Q  # the head-row: b * H + h
    h = bh % H
    b = bh // H
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G  # BLOCK_G: the query group rounded up (at least 16, for tl.dot)
    c_ok = c < KEEP  # BLOCK_C: the kept channels rounded up (at least 16)
    d_ok = d < D
    # the head-row's kept channels, and the group's query at them: (BLOCK_G, BLOCK_C)
    kept = tl.load(channels + bh * KEEP + c, mask=c_ok, other=0).to(tl.int32)
    qs = tl.load(
        q + b * sq_b + (h * G + g[:, None]) * sq_h + qi * sq_q + kept[None, :],
        mask=g_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    if FP32:  # the interpreter multiplies 16-bit floats as integers: it computes in float32
        qs = qs.to(tl.float32)
    if ROW_LEN >= 0:  # every head-row holds ROW_LEN tokens, ROW_STRIDE slots apart
        first = bh * ROW_STRIDE
        held = ROW_LEN
    else:
        first = tl.load(starts + bh).to(tl.int32)  # the head-row's first flat token
        held = tl.load(lens + bh).to(tl.int32)
    stop = tl.minimum((split + 1) * slots_per_split, held)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for t0 in range(split * slots_per_split, stop, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < stop  # past the split or the head-row's tokens: not read
        at = first + t
        k = tl.load(kp + at[:, None] * KEEP + c[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0.0)
        vt = tl.load(v + at[:, None] * D + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32:
            k = k.to(tl.float32)
            vt = vt.to(tl.float32)
        else:  # at the query's dtype, as the torch path attends
            k = k.to(qs.dtype)
            vt = vt.to(qs.dtype)
        m_i, l_i, acc = attend_block(m_i, l_i, acc, qs, k, vt, t_ok, scaling)
    store_partials(m_out, l_out, acc_out, row, split, m_i, l_i, acc, BLOCK_G, BLOCK_D)


def partials(
    query: torch.Tensor,
    kp: torch.Tensor,
    v: torch.Tensor,
    channels: torch.Tensor,
    lens: torch.Tensor,
    width: int,
    scaling: float,
    per_row: bool = False,
) -> Partials:
    """The softmax state of one decode step (query ``(B, Hq, Q, D)``) over a pruned segment: flat
    head-major kept key channels ``kp`` ``(N, d_keep)`` and values ``v`` ``(N, D)``, the kept channel
    indices ``channels`` ``(B * H, d_keep)`` of each head-row (any integer dtype), ``lens``
    ``(B * H,)`` tokens per head-row (at most ``width``, known on the host). With ``per_row``, ``kp``
    and ``v`` are given per head-row, ``(B * H, n, ...)`` rectangles of buffers whose head-rows sit
    the same number of slots apart (a packed segment's, read in place:
    :func:`kvbench.kernels.attention.head_row_layout`)."""
    b, _, nq, d = query.shape
    h = lens.numel() // b
    query = query if query.stride(-1) == 1 else query.contiguous()
    (kp, v), row_len, row_stride, starts = head_row_layout(lens, [kp, v], per_row)
    channels = channels.contiguous()
    splits, per_split = split_slots(max(width, 1), b * h * nq)
    block_g, block_d = blocks(query, h)
    out = empty_partials(query, h, splits, (block_g, block_d))
    if not (out.m.shape[1] and width):
        return no_reads(out)
    keep = kp.shape[-1]
    _pruned_decode_kernel[(out.m.shape[1], splits)](
        query, kp, v, channels, lens, starts, out.m, out.l, out.acc,
        h, query.shape[1] // h, nq, d, keep, per_split, scaling,
        query.stride(0), query.stride(1), query.stride(2), row_len, row_stride,
        BLOCK_G=block_g, BLOCK_T=BLOCK_T, BLOCK_C=max(16, pow2(keep)), BLOCK_D=block_d,
        FP32=dispatch.interpreted(),
    )  # fmt: skip
    return out


def attend_reference(
    query: torch.Tensor,
    kp: torch.Tensor,
    v: torch.Tensor,
    channels: torch.Tensor,
    lens: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """The torch path for one decode step over a pruned segment: every key rebuilt whole (its kept
    channels scattered into zeros, as :meth:`kvbench.compressors.pruning.PrunedSegment.read` does),
    head-rows padded to the longest, then attention (SDPA) over each head-row's ``lens`` tokens.
    Every head-row holds at least one token. ``(B, Hq, Q, D)`` in the query's dtype."""
    b, _, nq, d = query.shape
    bh = lens.numel()
    lens = lens.long()
    keys, held = ragged.to_padded(kp.to(query.dtype), lens)  # (BH, T, d_keep)
    values, _ = ragged.to_padded(v.to(query.dtype), lens)
    index = channels.long()[:, None, :].expand(-1, keys.shape[1], -1)
    full = keys.new_zeros(bh, keys.shape[1], d).scatter_(2, index, keys)
    shape = (b, bh // b, keys.shape[1], d)
    mask = held.view(*shape[:2], 1, shape[2]).expand(-1, -1, nq, -1)
    return att.attend(query, full.view(shape), values.view(shape), mask, scaling)
