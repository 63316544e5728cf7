"""Masked decode attention over a ragged cache (flash-decoding) as a Triton kernel, beside its torch
reference (:func:`kvbench.cache.attention.attend`, same signature).

One decode step, or a short chunk of queries, against a layer whose KV heads hold different
tokens: what a query reads comes from the stored slots' original positions against the query's
(causal, the sliding window; computed in the kernel, no mask is built), the head-rows' lengths,
and where a read selector or padding decides, a per-KV-head boolean mask; an optional logit bias
per stored unit (merged tokens' log(count)). A program takes the query heads of one KV head
(grouped-query attention: the group's queries share every key read) for one query position and
one split of the stored slots; each split keeps a running maximum, sum and output, and
:func:`attend` merges the splits by their log-sum-exp. The mask is read per KV head: it is never
repeated over the query group, and SDPA's fallback to its math kernel for a mask with grouped
queries is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvbench.cache import attention as att
from kvbench.kernels import dispatch


def attend_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    bias: torch.Tensor | None = None,
    lens: torch.Tensor | None = None,
    positions: att.Positions | None = None,
) -> torch.Tensor:
    """The torch path (:func:`kvbench.cache.attention.attend`, SDPA) of :func:`attend`: ``lens``
    and ``positions`` become masks."""
    if lens is not None:
        held = torch.arange(key.shape[2], device=key.device) < lens[..., None, None]
        mask = held if mask is None else mask & held
    if positions is not None:
        mask = positions.mask() if mask is None else mask & positions.mask()
    if mask is None:
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=query.device).expand(
            key.shape[0], key.shape[1], query.shape[2], key.shape[2]
        )
    return att.attend(query, key, value, mask, scaling, bias)


BLOCK_T = 64  # stored slots a program reads at a time
SPLIT = 1024  # stored slots a split covers at least (more splits: more programs in flight)


@triton.jit
def _decode_kernel(
    q, k, v, mask, bias, lens, kpos, qpos, m_out, l_out, acc_out,
    H, G, Q, T, D, slots_per_split, scaling, window,
    sq_b, sq_h, sq_q, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sm_b, sm_h, sm_q, sb_b, sb_h,
    skp_b, skp_h, sqp_b,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LENS: tl.constexpr, HAS_POS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    FP32: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # (b, KV head, query position)
    split = tl.program_id(1)
    qi = row % Q
    h = (row // Q) % H
    b = row // (Q * H)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G  # BLOCK_G: the query group rounded up (at least 16, for tl.dot)
    d_ok = d < D
    qs = tl.load(
        q + b * sq_b + (h * G + g[:, None]) * sq_h + qi * sq_q + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP32:  # the interpreter multiplies 16-bit floats as integers: it reads them in float32
        qs = qs.to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    start = split * slots_per_split
    stop = tl.minimum(start + slots_per_split, T)
    if HAS_LENS:  # the head-row's tokens are its first lens slots: read no further
        stop = tl.minimum(stop, tl.load(lens + b * H + h))
    if HAS_POS:  # read the positions in (oldest, newest]: causal, within the window (0: none)
        qp = tl.load(qpos + b * sqp_b + qi).to(tl.int64)
        newest = tl.where(qp < 0, 1 << 62, qp)  # a padding query (-1) reads every slot
        oldest = tl.where((qp < 0) | (window == 0), -1, qp - window)
    for t0 in range(start, stop, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < stop
        if HAS_MASK:
            read = t_ok & (tl.load(mask + b * sm_b + h * sm_h + qi * sm_q + t, mask=t_ok, other=0) != 0)
        else:
            read = t_ok
        if HAS_POS:
            kp = tl.load(kpos + b * skp_b + h * skp_h + t, mask=t_ok, other=0).to(tl.int64)
            read = read & (kp <= newest) & (kp > oldest)
        # Block-sparse: keys and values are loaded for the slots read only (a read selector's
        # unread pages or experts cost no memory traffic), and a block with none read is skipped
        if tl.max(read.to(tl.int32), axis=0) > 0:
            tile = read[:, None] & d_ok[None, :]
            kt = tl.load(k + b * sk_b + h * sk_h + t[:, None] * sk_t + d[None, :], mask=tile, other=0.0)
            vt = tl.load(v + b * sv_b + h * sv_h + t[:, None] * sv_t + d[None, :], mask=tile, other=0.0)
            if FP32:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            s = (
                tl.dot(qs, tl.trans(kt), out_dtype=tl.float32, input_precision="ieee") * scaling
            )  # (BLOCK_G, BLOCK_T)
            if HAS_BIAS:
                s += tl.load(bias + b * sb_b + h * sb_h + t, mask=read, other=0.0).to(tl.float32)[None, :]
            s = tl.where(read[None, :], s, float("-inf"))  # unread or past the split: no weight
            m_i, l_i, acc = online_softmax(m_i, l_i, acc, s, vt)
    store_partials(m_out, l_out, acc_out, row, split, m_i, l_i, acc, BLOCK_G, BLOCK_D)


@triton.jit
def online_softmax(m_i, l_i, acc, s, v):
    """One block of scores ``s`` (BLOCK_G, BLOCK_T) and values ``v`` (BLOCK_T, BLOCK_D) into the
    running maximum, sum and output."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row that has read nothing yet keeps a -inf maximum: shift by 0 so exp gives 0, not NaN
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - shift[:, None])
    alpha = tl.exp(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def store_partials(
    m_out, l_out, acc_out, row, split, m_i, l_i, acc, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr
):
    """A split's state at ``(row, split)`` of :class:`Partials`' ``(rows, splits, BLOCK_G[, BLOCK_D])``."""
    at = (row * tl.num_programs(1) + split) * BLOCK_G + tl.arange(0, BLOCK_G)
    tl.store(m_out + at, m_i)
    tl.store(l_out + at, l_i)
    tl.store(acc_out + at[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], acc)


@dataclass
class Partials:
    """Per-split softmax state of a decode step: running maximum ``m`` and sum ``l``
    ``(B * H * Q, S, BLOCK_G)`` and output ``acc`` ``(B * H * Q, S, BLOCK_G, BLOCK_D)``, float32,
    for ``S`` splits of the stored slots (rows: a KV head's query group, padded to ``BLOCK_G``)."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741
    acc: torch.Tensor


def blocks(query: torch.Tensor, kv_heads: int) -> tuple[int, int]:
    """``BLOCK_G`` (the query group, at least 16 rows for ``tl.dot``) and ``BLOCK_D``."""
    g = query.shape[1] // kv_heads
    return max(16, triton.next_power_of_2(g)), max(16, triton.next_power_of_2(query.shape[-1]))


def empty_partials(query: torch.Tensor, kv_heads: int, splits: int) -> Partials:
    b, _, nq, _ = query.shape
    block_g, block_d = blocks(query, kv_heads)
    rows = b * kv_heads * nq
    m = torch.full((rows, splits, block_g), float("-inf"), dtype=torch.float32, device=query.device)
    acc = torch.zeros(rows, splits, block_g, block_d, dtype=torch.float32, device=query.device)
    return Partials(m, torch.zeros_like(m), acc)


def split_slots(slots: int) -> tuple[int, int]:
    """Splits of ``slots`` stored slots and slots a split (a multiple of ``BLOCK_T``)."""
    splits = max(1, min(triton.cdiv(slots, SPLIT), 64))
    per_split = triton.cdiv(triton.cdiv(slots, splits), BLOCK_T) * BLOCK_T
    return max(1, triton.cdiv(slots, per_split)), per_split


def partials(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    bias: torch.Tensor | None = None,
    lens: torch.Tensor | None = None,
    positions: att.Positions | None = None,
) -> Partials:
    """The softmax state of :func:`attend` per split, before the splits are merged (:func:`merge`
    joins them with other segments' of the same step)."""
    b, hq, nq, d = query.shape
    h, t = key.shape[1], key.shape[2]
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    if mask is not None:
        mask = mask.view(torch.uint8) if mask.stride(-1) == 1 else mask.contiguous().view(torch.uint8)
    splits, per_split = split_slots(t)
    out = empty_partials(query, h, splits)
    block_g, block_d = blocks(query, h)
    mask_strides = (mask.stride(0), mask.stride(1), mask.stride(2)) if mask is not None else (0, 0, 0)
    bias_strides = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    held = None if lens is None else lens.to(torch.int32).contiguous()
    kpos = qpos = None
    if positions is not None:
        kpos = positions.key if positions.key.stride(-1) == 1 else positions.key.contiguous()
        qpos = positions.query if positions.query.stride(-1) == 1 else positions.query.contiguous()
    pos_strides = (kpos.stride(0), kpos.stride(1), qpos.stride(0)) if kpos is not None else (0, 0, 0)
    window = positions.window if positions is not None and positions.window is not None else 0
    m = out.m
    if m.shape[0] and t:
        _decode_kernel[(m.shape[0], splits)](
            query, key, value, m if mask is None else mask, m if bias is None else bias,
            m if held is None else held, m if kpos is None else kpos, m if qpos is None else qpos,
            m, out.l, out.acc,
            h, hq // h, nq, t, d, per_split, scaling, window,
            query.stride(0), query.stride(1), query.stride(2),
            key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2), *mask_strides, *bias_strides,
            *pos_strides,
            HAS_MASK=mask is not None, HAS_BIAS=bias is not None, HAS_LENS=held is not None,
            HAS_POS=positions is not None,
            BLOCK_G=block_g, BLOCK_T=BLOCK_T, BLOCK_D=block_d, FP32=dispatch.interpreted(),
        )  # fmt: skip
    return out


def merge(parts: list[Partials], query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The attention output ``(B, Hq, Q, D)`` (the query's dtype) from the splits of one or more
    :class:`Partials` of the same step, merged by their log-sum-exp:
    ``sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s``. A query that read nothing gets zeros, as
    SDPA gives."""
    b, hq, nq, d = query.shape
    g = hq // kv_heads
    m = torch.cat([p.m for p in parts], 1)
    l_sum = torch.cat([p.l for p in parts], 1)
    acc = torch.cat([p.acc for p in parts], 1)
    top = m.amax(1, keepdim=True)
    weight = torch.exp(m - top.masked_fill(top == float("-inf"), 0.0))
    total = (l_sum * weight).sum(1)[..., None]
    out = (acc * weight[..., None]).sum(1) / total.masked_fill(total == 0, 1.0)
    out = out[:, :g, :d].view(b, kv_heads, nq, g, d).permute(0, 1, 3, 2, 4).reshape(b, hq, nq, d)
    return out.to(query.dtype)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    bias: torch.Tensor | None = None,
    lens: torch.Tensor | None = None,
    positions: att.Positions | None = None,
) -> torch.Tensor:
    """:func:`attend_reference` for a decode step or a short chunk: query ``(B, Hq, Q, D)``, keys
    and values ``(B, H, T, D)``, ``mask`` ``(B, H, Q, T)`` bool (per KV head; None: every slot;
    a stride of 0 over ``Q`` reads one row for all queries), ``bias`` ``(B, H, T)``, ``lens``
    ``(B, H)``: each head-row holds its first ``lens`` slots (the kernel reads no further, so a
    ragged layer costs its stored tokens, not its longest head's), ``positions``: causal over the
    original positions and the sliding window, computed in the kernel instead of read from a mask.
    Returns ``(B, Hq, Q, D)`` in the query's dtype."""
    parts = partials(query, key, value, mask, scaling, bias, lens, positions)
    return merge([parts], query, key.shape[1])
