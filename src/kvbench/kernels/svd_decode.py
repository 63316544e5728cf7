"""Fused decode attention over ShadowKV's per-block SVD factors (``svd``): one query step reads each
token's factors and its block's bases and rebuilds nothing in memory, beside its torch reference
(rebuild every key and value, then attention).

Pre-RoPE keys are stored per token as ``ka`` ``(N, rk)`` and per block of ``block`` tokens as
``kb`` ``(M, D, rk)``: ``K = rotate(ka · kb[block]ᵀ)``; values likewise (``va`` ``(N, rv)``, ``vb``
``(M, D, rv)``) or at full precision (``va`` ``(N, D)``, no ``vb``). A program takes the query heads
of one KV head for one query position and one split of its head-row's blocks, and walks them block
by block: a chunk of a block's key factors times the block's basis gives the chunk's pre-RoPE keys
in registers, rotated half by half at each token's position (:func:`kvbench.kernels.latent_decode.
_rope_keys`, the basis row being the block's), then scores and the online softmax. Factored values
are summed in factor space within the block (``p · va``, rank ``rv``) and expanded once per block
by its ``vbᵀ`` into the output; full values are read as stored. The split's softmax state
(:class:`kvbench.kernels.attention.Partials`) merges with the full-precision window's by
log-sum-exp (:func:`kvbench.kernels.attention.merge`).

It serves steps that read every stored token of a segment whose head-rows hold the same number of
tokens in whole blocks (as built, before any eviction: :meth:`GroupedSegment.full_groups`); other
layouts take the decoded path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbench.cache.rotary import Rotary
from kvbench.kernels import attention
from kvbench.kernels.attention import (
    Partials,
    blocks,
    cdiv,
    empty_partials,
    no_reads,
    pow2,
    split_slots,
    store_partials,
)
from kvbench.kernels.latent_decode import _rope_keys, frequencies


@triton.jit(do_not_specialize=["blocks_per_split", "ROW_BLOCKS"])
def _svd_decode_kernel(
    q, ka, va, pos, kb, vb, inv_freq, m_out, l_out, acc_out,
    H, G, Q, D, HALF, RK, RV, BLOCK, ROW_BLOCKS, blocks_per_split, scaling, rope_scaling,
    sq_b, sq_h, sq_q, skb_m, skb_d, svb_m, svb_d,
    FACTORED: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_RK: tl.constexpr, BLOCK_RV: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # (b, KV head, query position)
    split = tl.program_id(1)
    qi = row % Q
    bh = row // Q  # the head-row: b * H + h
    h = bh % H
    b = bh // H
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rk = tl.arange(0, BLOCK_RK)
    rv = tl.arange(0, BLOCK_RV)
    g_ok = g < G  # BLOCK_G: the query group rounded up (at least 16, for tl.dot)
    j_ok = j < HALF  # BLOCK_H: half the rotated channels, rounded up
    d_ok = d < D
    q_at = q + b * sq_b + (h * G + g[:, None]) * sq_h + qi * sq_q
    q1 = tl.load(q_at + j[None, :], mask=g_ok[:, None] & j_ok[None, :], other=0.0).to(tl.float32)
    q2 = tl.load(q_at + HALF + j[None, :], mask=g_ok[:, None] & j_ok[None, :], other=0.0).to(tl.float32)
    # the channels past the rotated ones (partial rotary) pass through: zero where there are none
    rest = (d >= 2 * HALF) & d_ok
    q3 = tl.load(q_at + d[None, :], mask=g_ok[:, None] & rest[None, :], other=0.0).to(tl.float32)
    freq = tl.load(inv_freq + j, mask=j_ok, other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    first = split * blocks_per_split
    for blk in range(first, tl.minimum(first + blocks_per_split, ROW_BLOCKS)):
        m = bh * ROW_BLOCKS + blk  # the block among the segment's M: its bases' row
        lat = tl.zeros((BLOCK_G, BLOCK_RV), dtype=tl.float32)  # Σ p · va over the block (factored)
        for c0 in range(0, BLOCK, BLOCK_N):
            c = c0 + tl.arange(0, BLOCK_N)
            c_ok = c < BLOCK  # past the block's tokens: not read
            at = m * BLOCK + c  # the flat token
            kl = tl.load(
                ka + at[:, None] * RK + rk[None, :], mask=c_ok[:, None] & (rk[None, :] < RK), other=0.0
            ).to(tl.float32)
            angle = tl.load(pos + at, mask=c_ok, other=0).to(tl.float32)[:, None] * freq[None, :]
            cos = tl.cos(angle) * rope_scaling
            sin = tl.sin(angle) * rope_scaling
            k1, k2 = _rope_keys(kl, kb, m, HALF, 0, cos, sin, skb_m, skb_d, BLOCK_RK, BLOCK_H, RK)
            s = tl.dot(q1, tl.trans(k1), out_dtype=tl.float32, input_precision="ieee")
            s += tl.dot(q2, tl.trans(k2), out_dtype=tl.float32, input_precision="ieee")
            if HAS_PASS:
                bk = tl.load(
                    kb + m * skb_m + d[:, None] * skb_d + rk[None, :],
                    mask=rest[:, None] & (rk[None, :] < RK),
                    other=0.0,
                ).to(tl.float32)
                k3 = tl.dot(kl, tl.trans(bk), out_dtype=tl.float32, input_precision="ieee")
                s += tl.dot(q3, tl.trans(k3), out_dtype=tl.float32, input_precision="ieee")
            s = tl.where(c_ok[None, :], s * scaling, float("-inf"))  # (BLOCK_G, BLOCK_N)
            # the online softmax; a row that has read nothing keeps -inf: shift by 0, not NaN
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(m_i - shift)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            if FACTORED:
                vl = tl.load(
                    va + at[:, None] * RV + rv[None, :], mask=c_ok[:, None] & (rv[None, :] < RV), other=0.0
                ).to(tl.float32)
                lat = lat * alpha[:, None] + tl.dot(p, vl, out_dtype=tl.float32, input_precision="ieee")
            else:  # full values (N, D), read as stored
                vt = tl.load(va + at[:, None] * D + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
                acc += tl.dot(p, vt.to(tl.float32), out_dtype=tl.float32, input_precision="ieee")
            m_i = m_new
        if FACTORED:  # the block's values expanded once: (BLOCK_G, rv) · vb[block]ᵀ -> (BLOCK_G, BLOCK_D)
            bv = tl.load(
                vb + m * svb_m + d[:, None] * svb_d + rv[None, :],
                mask=d_ok[:, None] & (rv[None, :] < RV),
                other=0.0,
            ).to(tl.float32)
            acc += tl.dot(lat, tl.trans(bv), out_dtype=tl.float32, input_precision="ieee")
    store_partials(m_out, l_out, acc_out, row, split, m_i, l_i, acc, BLOCK_G, BLOCK_D)


def partials(
    query: torch.Tensor,
    ka: torch.Tensor,
    va: torch.Tensor,
    pos: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor | None,
    rotary: Rotary,
    kv_heads: int,
    block: int,
    scaling: float,
) -> Partials:
    """The softmax state of one decode step (query ``(B, Hq, Q, D)``) over an SVD segment whose
    ``B * kv_heads`` head-rows each hold the same number of tokens in whole blocks of ``block``:
    flat head-major key factors ``ka`` ``(N, rk)`` and values ``va`` (factors ``(N, rv)``, or
    ``(N, D)`` at full precision when ``vb`` is None) at original positions ``pos`` ``(N,)``, per
    block bases ``kb`` ``(M, D, rk)`` and ``vb`` ``(M, D, rv)``, ``M = N / block`` in the tokens'
    order."""
    b, _, nq, d = query.shape
    rows = b * kv_heads
    n = ka.shape[0] // max(rows, 1)  # tokens a head-row
    query = query if query.stride(-1) == 1 else query.contiguous()
    ka, va, pos = (x if x.is_contiguous() else x.contiguous() for x in (ka, va, pos))
    kb = kb if kb.stride(-1) == 1 else kb.contiguous()
    splits, per_split = split_slots(max(n, 1), rows * nq)
    per_split = cdiv(per_split, block)  # in whole blocks
    row_blocks = n // block
    splits = max(1, cdiv(row_blocks, per_split))
    block_g, block_d = blocks(query, kv_heads)
    out = empty_partials(query, kv_heads, splits, (block_g, block_d))
    if not (out.m.shape[1] and n):
        return no_reads(out)
    factored = vb is not None
    if vb is None:
        vb = kb  # not read
    elif vb.stride(-1) != 1:
        vb = vb.contiguous()
    half = rotary.rot_dim // 2
    inv_freq = frequencies(rotary, query.device)
    rk, rv = ka.shape[1], va.shape[1]
    _svd_decode_kernel[(out.m.shape[1], splits)](
        query, ka, va, pos, kb, vb, inv_freq, out.m, out.l, out.acc,
        kv_heads, query.shape[1] // kv_heads, nq, d, half, rk, rv, block, row_blocks, per_split,
        scaling, rotary.scaling, query.stride(0), query.stride(1), query.stride(2),
        kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1),
        FACTORED=factored, HAS_PASS=2 * half < d, BLOCK_G=block_g,
        BLOCK_N=max(16, min(64, pow2(block))), BLOCK_D=block_d, BLOCK_H=max(16, pow2(half)),
        BLOCK_RK=max(16, pow2(rk)), BLOCK_RV=max(16, pow2(rv)),
    )  # fmt: skip
    return out


def attend_reference(
    query: torch.Tensor,
    ka: torch.Tensor,
    va: torch.Tensor,
    pos: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor | None,
    rotary: Rotary,
    kv_heads: int,
    block: int,
    scaling: float,
) -> torch.Tensor:
    """The torch path for one decode step over an SVD segment (the arguments of :func:`partials`):
    rebuild every key (``rotate(ka · kbᵀ)``, block by block) and value (``va · vbᵀ``, or ``va``),
    then attention (SDPA), every query reading every token. ``(B, Hq, Q, D)``."""
    b, _, _, d = query.shape

    def expand(a: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a.float().view(-1, block, a.shape[-1]), basis.float().transpose(1, 2)).flatten(0, 1)

    k = rotary.rotate(expand(ka, kb), pos)
    v = va.float() if vb is None else expand(va, vb)
    shape = (b, kv_heads, -1, d)
    k, v = k.view(shape).to(query.dtype), v.view(shape).to(query.dtype)
    return attention.attend_reference(query, k, v, None, scaling)
