"""Fused decode attention over low-rank latents (``lora``, Palu's data-aware bases): one query step
reads each token's key and value latents and rebuilds nothing in memory, beside its torch
reference (rebuild every key and value, then attention).

Keys are stored as pre-RoPE latents on a per-KV-head basis, ``K = rotate(klat · Bkᵀ)``; values as
``V = vlat · Bvᵀ``. A program takes the query heads of one KV head for one split of its head-row's
tokens: a block of key latents times the basis gives the block's pre-RoPE keys in registers, one
half of the rotated channels at a time, turned by cos and sin of each token's position (computed
in the kernel), then scores. Values are never rebuilt: the output is linear in them, so the split
accumulates ``p · vlat`` (rank ``rv`` instead of ``head_dim``) and multiplies by ``Bvᵀ`` once at
the end. The split's softmax state (:class:`kvbench.kernels.attention.Partials`) merges with the
full-precision window's by log-sum-exp (:func:`kvbench.kernels.attention.merge`). It serves steps
that read every stored token (no read selector, window or padding).

Quantized latents (``lora_plus_plus``: each token's latent packed as 4- or 8-bit codes with one
float16 zero and step per token and latent) are read as codes and dequantized in registers, as
:mod:`kvbench.kernels.kivi_decode` reads KIVI's: ``code * step + zero`` in float32, the latents
:meth:`kvbench.compressors.lowrank.LatentSegment.latents` gives; nothing decoded is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbench.cache import attention as att
from kvbench.cache import quant
from kvbench.cache.rotary import Rotary
from kvbench.kernels.attention import (
    BLOCK_T,
    Partials,
    blocks,
    empty_partials,
    head_row_layout,
    no_reads,
    online_softmax,
    pow2,
    split_slots,
    store_partials,
)
from kvbench.kernels.kivi import _unpack_load


def frequencies(rotary: Rotary, device: torch.device) -> torch.Tensor:
    """The rotary's inverse frequencies as the kernels read them: float32 on ``device``."""
    inv_freq = rotary.inv_freq
    if inv_freq.device != device or inv_freq.dtype != torch.float32:
        inv_freq = inv_freq.to(device=device, dtype=torch.float32)
    return inv_freq


@triton.jit
def _latents(lat, zero, step, at, t_ok, r, R, BITS: tl.constexpr):
    """A block's latents ``(BLOCK_T, BLOCK_R)`` of the flat tokens ``at``: as stored (``BITS`` 0),
    or their ``BITS``-bit codes packed along the latent times each token's step plus its zero, in
    float32 (zero where not read)."""
    tile = t_ok[:, None] & (r[None, :] < R)
    if BITS == 0:
        out = tl.load(lat + at[:, None] * R + r[None, :], mask=tile, other=0.0)
    else:
        z = tl.load(zero + at, mask=t_ok, other=0.0).to(tl.float32)
        s = tl.load(step + at, mask=t_ok, other=0.0).to(tl.float32)
        codes = _unpack_load(lat, at, tile, r, R, BITS).to(tl.float32)
        out = tl.where(tile, codes * s[:, None] + z[:, None], 0.0)
    return out


@triton.jit
def _rope_keys(lat, basis, h, half, at, c, s, sb_h, sb_d, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, R):
    """The two rotated halves of a block's keys: ``lat`` ``(BLOCK_T, BLOCK_R)`` times the basis rows
    ``at .. at + half`` and ``at + half .. at + 2 half``, turned by ``c``, ``s`` ``(BLOCK_T,
    BLOCK_H)``."""
    j = tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    tile = (j[:, None] < half) & (r[None, :] < R)
    b1 = tl.load(basis + h * sb_h + (at + j[:, None]) * sb_d + r[None, :], mask=tile, other=0.0)
    b2 = tl.load(basis + h * sb_h + (at + half + j[:, None]) * sb_d + r[None, :], mask=tile, other=0.0)
    x1 = tl.dot(lat, tl.trans(b1.to(tl.float32)), out_dtype=tl.float32, input_precision="ieee")
    x2 = tl.dot(lat, tl.trans(b2.to(tl.float32)), out_dtype=tl.float32, input_precision="ieee")
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit(do_not_specialize=["slots_per_split", "ROW_LEN", "ROW_STRIDE"])
def _latent_decode_kernel(
    q, klat, vlat, kzero, kstep, vzero, vstep, pos, kbasis, vbasis, inv_freq, lens, starts,
    m_out, l_out, acc_out,
    H, G, D, HALF, RK, RV, slots_per_split, scaling, rope_scaling,
    sq_b, sq_h, skb_h, skb_d, svb_h, svb_d, ROW_LEN, ROW_STRIDE,
    HAS_PASS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_RK: tl.constexpr, BLOCK_RV: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)  # the head-row: b * H + h (one query position)
    split = tl.program_id(1)
    h = bh % H
    b = bh // H
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rk = tl.arange(0, BLOCK_RK)
    rv = tl.arange(0, BLOCK_RV)
    g_ok = g < G  # BLOCK_G: the query group rounded up (at least 16, for tl.dot)
    j_ok = j < HALF  # BLOCK_H: half the rotated channels, rounded up
    rot = 2 * HALF
    q_at = q + b * sq_b + (h * G + g[:, None]) * sq_h
    q1 = tl.load(q_at + j[None, :], mask=g_ok[:, None] & j_ok[None, :], other=0.0).to(tl.float32)
    q2 = tl.load(q_at + HALF + j[None, :], mask=g_ok[:, None] & j_ok[None, :], other=0.0).to(tl.float32)
    # the channels past the rotated ones (partial rotary) pass through: zero where there are none
    rest = (d >= rot) & (d < D)
    q3 = tl.load(q_at + d[None, :], mask=g_ok[:, None] & rest[None, :], other=0.0).to(tl.float32)
    freq = tl.load(inv_freq + j, mask=j_ok, other=0.0)
    if ROW_LEN >= 0:  # every head-row holds ROW_LEN tokens, ROW_STRIDE slots apart
        first = bh * ROW_STRIDE
        held = ROW_LEN
    else:
        first = tl.load(starts + bh).to(tl.int32)  # the head-row's first flat token
        held = tl.load(lens + bh).to(tl.int32)
    stop = tl.minimum((split + 1) * slots_per_split, held)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_RV), dtype=tl.float32)  # Σ p · vlat: values stay latent
    for t0 in range(split * slots_per_split, stop, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < stop  # past the split or the head-row's tokens: not read
        at = first + t
        kl = _latents(klat, kzero, kstep, at, t_ok, rk, RK, BITS)  # BITS 0: as stored
        angle = tl.load(pos + at, mask=t_ok, other=0).to(tl.float32)[:, None] * freq[None, :]
        c = tl.cos(angle) * rope_scaling
        s = tl.sin(angle) * rope_scaling
        k1, k2 = _rope_keys(kl.to(tl.float32), kbasis, h, HALF, 0, c, s, skb_h, skb_d, BLOCK_RK, BLOCK_H, RK)
        sc = tl.dot(q1, tl.trans(k1), out_dtype=tl.float32, input_precision="ieee")
        sc += tl.dot(q2, tl.trans(k2), out_dtype=tl.float32, input_precision="ieee")
        if HAS_PASS:
            bk = tl.load(
                kbasis + h * skb_h + d[:, None] * skb_d + rk[None, :],
                mask=rest[:, None] & (rk[None, :] < RK),
                other=0.0,
            ).to(tl.float32)
            k3 = tl.dot(kl.to(tl.float32), tl.trans(bk), out_dtype=tl.float32, input_precision="ieee")
            sc += tl.dot(q3, tl.trans(k3), out_dtype=tl.float32, input_precision="ieee")
        sc = tl.where(t_ok[None, :], sc * scaling, float("-inf"))
        vl = _latents(vlat, vzero, vstep, at, t_ok, rv, RV, BITS)
        m_i, l_i, acc = online_softmax(m_i, l_i, acc, sc, vl.to(tl.float32))
    # the values' basis once: (BLOCK_G, rv) · Bvᵀ -> (BLOCK_G, BLOCK_D)
    bv = tl.load(
        vbasis + h * svb_h + d[:, None] * svb_d + rv[None, :],
        mask=(d[:, None] < D) & (rv[None, :] < RV),
        other=0.0,
    ).to(tl.float32)
    out = tl.dot(acc, tl.trans(bv), out_dtype=tl.float32, input_precision="ieee")
    store_partials(m_out, l_out, acc_out, bh, split, m_i, l_i, out, BLOCK_G, BLOCK_D)


def partials(
    query: torch.Tensor,
    klat: torch.Tensor,
    vlat: torch.Tensor,
    pos: torch.Tensor,
    kbasis: torch.Tensor,
    vbasis: torch.Tensor,
    rotary: Rotary,
    lens: torch.Tensor,
    width: int,
    scaling: float,
    bits: int | None = None,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    per_row: bool = False,
) -> Partials:
    """The softmax state of one decode step (query ``(B, Hq, 1, D)``) over a latent segment: flat
    head-major latents ``klat`` ``(N, rk)`` and ``vlat`` ``(N, rv)`` at original positions ``pos``
    ``(N,)``, ``lens`` ``(B * H,)`` tokens per head-row (at most ``width``, known on the host),
    bases ``(H, D, r)`` shared by the batch's sequences. With ``bits`` (4 or 8: ``lora_plus_plus``),
    ``klat`` and ``vlat`` are the codes packed along each latent ``(N, r * bits / 8)`` (uint8) and
    ``params`` their float16 ``(kzero, kstep, vzero, vstep)`` ``(N, 1)``, one per token. With
    ``per_row``, every field is given per head-row instead, ``(B * H, n, ...)`` (``pos`` ``(B * H,
    n)``), rectangles of buffers whose head-rows sit the same number of slots apart (a packed
    segment's, read in place: :func:`kvbench.kernels.attention.head_row_layout`)."""
    b, _, nq, d = query.shape
    assert nq == 1, "latent decode: one query step"
    h = lens.numel() // b
    query = query if query.stride(-1) == 1 else query.contiguous()
    if bits is None:
        (klat, vlat, pos), row_len, row_stride, starts = head_row_layout(lens, [klat, vlat, pos], per_row)
        rk, rv = klat.shape[-1], vlat.shape[-1]
        kzero = kstep = vzero = vstep = klat  # not read
    else:
        assert bits in (4, 8) and params is not None, "quantized latents: 4 or 8 bits, with their parameters"
        fields, row_len, row_stride, starts = head_row_layout(lens, [klat, vlat, pos, *params], per_row)
        klat, vlat, pos, kzero, kstep, vzero, vstep = fields
        rk, rv = klat.shape[-1] * 8 // bits, vlat.shape[-1] * 8 // bits
    splits, per_split = split_slots(max(width, 1), b * h)
    block_g, block_d = blocks(query, h)
    out = empty_partials(query, h, splits, (block_g, block_d))
    if not (out.m.shape[1] and width):
        return no_reads(out)
    half = rotary.rot_dim // 2
    inv_freq = frequencies(rotary, query.device)
    _latent_decode_kernel[(out.m.shape[1], splits)](
        query, klat, vlat, kzero, kstep, vzero, vstep, pos, kbasis, vbasis, inv_freq, lens, starts,
        out.m, out.l, out.acc, h, query.shape[1] // h, d, half, rk, rv, per_split, scaling,
        rotary.scaling, query.stride(0), query.stride(1), kbasis.stride(0), kbasis.stride(1),
        vbasis.stride(0), vbasis.stride(1), row_len, row_stride,
        HAS_PASS=2 * half < d, BLOCK_G=block_g, BLOCK_T=BLOCK_T, BLOCK_D=block_d,
        BLOCK_H=max(16, pow2(half)), BLOCK_RK=max(16, pow2(rk)),
        BLOCK_RV=max(16, pow2(rv)), BITS=bits or 0,
    )  # fmt: skip
    return out


def attend_reference(
    query: torch.Tensor,
    klat: torch.Tensor,
    vlat: torch.Tensor,
    pos: torch.Tensor,
    kbasis: torch.Tensor,
    vbasis: torch.Tensor,
    rotary: Rotary,
    lens: torch.Tensor,
    scaling: float,
    bits: int | None = None,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The torch path for one decode step over a latent segment whose head-rows hold the same
    number of tokens: rebuild every key (``rotate(klat · Bkᵀ)``) and value (``vlat · Bvᵀ``), then
    attention (SDPA). ``(B, Hq, 1, D)``. With ``bits``, ``klat`` and ``vlat`` are packed codes
    (:func:`partials`), dequantized first as the segment's latents are
    (:func:`kvbench.cache.quant.dequantize_rows`)."""
    if bits is not None:
        assert params is not None
        kzero, kstep, vzero, vstep = params
        klat = quant.dequantize_rows(klat, kzero, kstep, bits)
        vlat = quant.dequantize_rows(vlat, vzero, vstep, bits)
    b, _, _, d = query.shape
    bh = lens.numel()
    h = bh // b
    per_row = klat.shape[0] // bh
    kl = klat.float().view(b, h, per_row, -1)
    vl = vlat.float().view(b, h, per_row, -1)
    k = torch.einsum("bhtr,hdr->bhtd", kl, kbasis.float())
    v = torch.einsum("bhtr,hdr->bhtd", vl, vbasis.float())
    k = rotary.rotate(k, pos.view(b, h, per_row))
    return att.attend(query, k.to(query.dtype), v.to(query.dtype), None, scaling)
