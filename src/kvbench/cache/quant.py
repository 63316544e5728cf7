"""Asymmetric integer quantization with real bit packing (torch reference path).

Codes of ``bits`` bits are packed along the last dimension, so a row of ``D`` codes takes
``D * bits / 8`` bytes: 2, 4 and 8 bits pack ``8 // bits`` codes per byte; 3 bits pack eight codes
into three bytes. Scales and minima are stored in float16, rounded so
that every value stays within half a quantization step of its reconstruction.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 3, 4, 8)


def _layout(bits: int) -> tuple[int, int]:
    """Codes per packed word and bytes per word."""
    return (8, 3) if bits == 3 else (8 // bits, 1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., D)`` uint8 codes < 2**bits -> ``(..., D * bits // 8)`` uint8."""
    per, nbytes = _layout(bits)
    d = codes.shape[-1]
    if d % per:
        raise ValueError(f"head_dim {d} is not a multiple of {per} (needed to pack {bits}-bit codes)")
    grouped = codes.view(*codes.shape[:-1], d // per, per).to(torch.int32)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    word = (grouped << shifts).sum(-1)  # at most 24 bits
    if nbytes == 1:
        return word.to(torch.uint8)
    byte_shifts = torch.arange(nbytes, device=codes.device, dtype=torch.int32) * 8
    out = (word[..., None] >> byte_shifts) & 0xFF
    return out.reshape(*codes.shape[:-1], d // per * nbytes).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``(..., P)`` -> ``(..., P * 8 // bits)`` uint8."""
    per, nbytes = _layout(bits)
    words = packed.to(torch.int32).view(*packed.shape[:-1], packed.shape[-1] // nbytes, nbytes)
    byte_shifts = torch.arange(nbytes, device=packed.device, dtype=torch.int32) * 8
    word = (words << byte_shifts).sum(-1)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    codes = (word[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], word.shape[-1] * per).to(torch.uint8)


def _params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 minimum (rounded down) and step (rounded up) covering ``[lo, hi]``."""
    zero = lo.half()
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, -65504.0)), zero)
    step = ((hi - zero.float()) / ((1 << bits) - 1)).clamp(min=1e-8)
    step16 = step.half()
    step16 = torch.where(
        step16.float() < step, torch.nextafter(step16, torch.full_like(step16, 65504.0)), step16
    )
    return zero, step16


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one (zero, step) per slice reduced over ``dim``.

    Returns:
        codes (uint8, same shape as ``x``), zero and step (float16, ``dim`` kept with size 1).
    """
    xf = x.float()
    zero, step = _params(xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True), bits)
    codes = ((xf - zero.float()) / step.float()).round().clamp(0, (1 << bits) - 1)
    return codes.to(torch.uint8), zero, step


def dequantize(
    codes: torch.Tensor, zero: torch.Tensor, step: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return (codes.float() * step.float() + zero.float()).to(dtype)
