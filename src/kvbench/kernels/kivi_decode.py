"""Fused decode attention over KIVI's packed cache: one query step reads the 2-, 3-, 4- or 8-bit
codes and dequantizes them in registers (no decoded copy in memory), beside its torch reference
(dequantize, then attention).

A program takes the query heads of one KV head for one query position and one split of the
head-row's packed tokens; it returns the split's softmax state (:class:`kvbench.kernels.attention.
Partials`), which the engine merges with the full-precision window's and sinks' by their
log-sum-exp (:func:`kvbench.kernels.attention.merge`). It serves steps that read every stored
token (no read selector, window or padding) of segments whose key groups are whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbench.cache import attention as att
from kvbench.cache import quant
from kvbench.kernels import dispatch
from kvbench.kernels.attention import (
    BLOCK_T,
    Partials,
    attend_block,
    blocks,
    empty_partials,
    no_reads,
    row_starts,
    split_slots,
    store_partials,
)
from kvbench.kernels.kivi import _unpack_load


@triton.jit(do_not_specialize=["slots_per_split", "ROW_LEN", "ROW_GROUPS"])
def _kivi_decode_kernel(
    q, kcodes, vcodes, vzero, vstep, kzero, kstep, lens, starts, gstarts, m_out, l_out, acc_out,
    H, G, Q, D, NGV, PER_GROUP, VGROUP, slots_per_split, scaling, sq_b, sq_h, sq_q, ROW_LEN, ROW_GROUPS,
    KBITS: tl.constexpr, VBITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, FP32: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # (b, KV head, query position)
    split = tl.program_id(1)
    qi = row % Q
    bh = row // Q  # the head-row: b * H + h
    h = bh % H
    b = bh // H
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    qs = tl.load(
        q + b * sq_b + (h * G + g[:, None]) * sq_h + qi * sq_q + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP32:  # the interpreter multiplies 16-bit floats as integers: it computes in float32
        qs = qs.to(tl.float32)
    # the head-row's first flat token and its first key group: from the common counts where every
    # head-row holds as many (ROW_LEN, ROW_GROUPS >= 0), else read
    if ROW_LEN >= 0:
        first = bh * ROW_LEN
        held = ROW_LEN
    else:
        first = tl.load(starts + bh).to(tl.int32)
        held = tl.load(lens + bh).to(tl.int32)
    if ROW_GROUPS >= 0:  # noqa: SIM108 (a branch on a scalar in Triton)
        group0 = bh * ROW_GROUPS
    else:
        group0 = tl.load(gstarts + bh).to(tl.int32)
    stop = tl.minimum((split + 1) * slots_per_split, held)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for t0 in range(split * slots_per_split, stop, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < stop
        flat = first + t
        tile = t_ok[:, None] & d_ok[None, :]
        # keys: a (zero, step) per channel of the token's group (whole groups of PER_GROUP tokens)
        at = (group0 + t // PER_GROUP)[:, None] * D + d[None, :]
        kz = tl.load(kzero + at, mask=tile, other=0.0).to(tl.float32)
        ks = tl.load(kstep + at, mask=tile, other=0.0).to(tl.float32)
        k = _unpack_load(kcodes, flat, tile, d, D, KBITS).to(tl.float32) * ks + kz
        # values: a (zero, step) per token and channel group of VGROUP
        at = flat[:, None] * NGV + d[None, :] // VGROUP
        vz = tl.load(vzero + at, mask=tile, other=0.0).to(tl.float32)
        vs = tl.load(vstep + at, mask=tile, other=0.0).to(tl.float32)
        v = _unpack_load(vcodes, flat, tile, d, D, VBITS).to(tl.float32) * vs + vz
        if not FP32:  # at the cache's dtype, as the torch path attends
            k = k.to(qs.dtype)
            v = v.to(qs.dtype)
        m_i, l_i, acc = attend_block(m_i, l_i, acc, qs, k, v, t_ok, scaling)
    store_partials(m_out, l_out, acc_out, row, split, m_i, l_i, acc, BLOCK_G, BLOCK_D)


def partials(
    query: torch.Tensor,
    kcodes: torch.Tensor,
    vcodes: torch.Tensor,
    vzero: torch.Tensor,
    vstep: torch.Tensor,
    kzero: torch.Tensor,
    kstep: torch.Tensor,
    lens: torch.Tensor,
    glens: torch.Tensor,
    width: int,
    key_bits: int,
    value_bits: int,
    per_group: int,
    group: int,
    scaling: float,
) -> Partials:
    """The softmax state of one decode step (query ``(B, Hq, Q, D)``) over a KIVI segment: flat
    head-major packed tokens, ``lens`` ``(B * H,)`` per head-row (at most ``width``, known on the
    host), key groups of ``per_group`` tokens (``glens`` per head-row), value channel groups of
    ``group``."""
    b, _, nq, d = query.shape
    h = lens.numel() // b
    query = query if query.stride(-1) == 1 else query.contiguous()
    splits, per_split = split_slots(max(width, 1), b * h * nq)
    block_g, block_d = blocks(query, h)
    out = empty_partials(query, h, splits, (block_g, block_d))
    if not (out.m.shape[1] and width):
        return no_reads(out)
    row_len, starts = row_starts(lens)
    row_groups, gstarts = row_starts(glens)
    _kivi_decode_kernel[(out.m.shape[1], splits)](
        query, kcodes, vcodes, vzero, vstep, kzero, kstep, lens, starts, gstarts,
        out.m, out.l, out.acc, h, query.shape[1] // h, nq, d, vzero.shape[1], per_group, group,
        per_split, scaling, query.stride(0), query.stride(1), query.stride(2), row_len, row_groups,
        KBITS=key_bits, VBITS=value_bits, BLOCK_G=block_g, BLOCK_T=BLOCK_T, BLOCK_D=block_d,
        FP32=dispatch.interpreted(),
    )  # fmt: skip
    return out


def attend_reference(
    query: torch.Tensor,
    kcodes: torch.Tensor,
    vcodes: torch.Tensor,
    vzero: torch.Tensor,
    vstep: torch.Tensor,
    kzero: torch.Tensor,
    kstep: torch.Tensor,
    lens: torch.Tensor,
    key_bits: int,
    value_bits: int,
    per_group: int,
    group: int,
    scaling: float,
) -> torch.Tensor:
    """The torch path for one decode step over a KIVI segment whose head-rows hold the same number
    of tokens: dequantize every token, then attention (SDPA). ``(B, Hq, Q, D)``."""
    b, _, _, d = query.shape
    k = quant.dequantize_keys(kcodes, kzero, kstep, key_bits, query.dtype, per_group)
    v = quant.dequantize_values(vcodes, vzero, vstep, value_bits, d, group, query.dtype)
    shape = (b, lens.numel() // b, -1, d)
    return att.attend(query, k.view(shape), v.view(shape), None, scaling)
