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


_CONSTANTS: dict[tuple[str, torch.device, int, torch.dtype], torch.Tensor] = {}


def _constant(kind: str, device: torch.device, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Small constant tensors, built once per device (a decode step quantizes per layer):
    ``("shifts", n)``: ``arange(per) * n``; ``("bytes", n)``: ``arange(n) * 8``; ``("low"|"high", _)``:
    the float16 bounds ``∓65504`` as 0-d tensors (``nextafter`` broadcasts them as ``full_like`` did)."""
    key = (kind, device, n, dtype)
    if key not in _CONSTANTS:
        if kind == "shifts":
            value = torch.arange(8 // n if n != 3 else 8, device=device, dtype=dtype) * n
        elif kind == "bytes":
            value = torch.arange(n, device=device, dtype=dtype) * 8
        else:
            value = torch.tensor(-65504.0 if kind == "low" else 65504.0, device=device, dtype=dtype)
        _CONSTANTS[key] = value
    return _CONSTANTS[key]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., D)`` uint8 codes < 2**bits -> ``(..., D * bits // 8)`` uint8."""
    per, nbytes = _layout(bits)
    d = codes.shape[-1]
    if d % per:
        raise ValueError(f"head_dim {d} is not a multiple of {per} (needed to pack {bits}-bit codes)")
    if bits == 8 and codes.dtype == torch.uint8:  # one code per byte: packing changes nothing
        return codes.contiguous()
    grouped = codes.view(*codes.shape[:-1], d // per, per).to(torch.int32)
    word = (grouped << _constant("shifts", codes.device, bits, torch.int32)).sum(-1)  # at most 24 bits
    if nbytes == 1:
        return word.to(torch.uint8)
    out = (word[..., None] >> _constant("bytes", codes.device, nbytes, torch.int32)) & 0xFF
    return out.reshape(*codes.shape[:-1], d // per * nbytes).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``(..., P)`` -> ``(..., P * 8 // bits)`` uint8."""
    if bits == 8 and packed.dtype == torch.uint8:
        return packed.contiguous()
    per, nbytes = _layout(bits)
    words = packed.to(torch.int32).view(*packed.shape[:-1], packed.shape[-1] // nbytes, nbytes)
    word = (words << _constant("bytes", packed.device, nbytes, torch.int32)).sum(-1)
    codes = (word[..., None] >> _constant("shifts", packed.device, bits, torch.int32)) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], word.shape[-1] * per).to(torch.uint8)


def _params(
    lo: torch.Tensor, hi: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float16 minimum (rounded down) and step (rounded up) covering ``[lo, hi]``, and the two as
    float32 (what quantizing and dequantizing compute with)."""
    zero = lo.half()
    low = _constant("low", zero.device, 0, zero.dtype)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, low), zero)
    zero32 = zero.float()
    step = ((hi - zero32) / ((1 << bits) - 1)).clamp(min=1e-8)
    step16 = step.half()
    high = _constant("high", zero.device, 0, zero.dtype)
    step16 = torch.where(step16.float() < step, torch.nextafter(step16, high), step16)
    return zero, step16, zero32, step16.float()


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one (zero, step) per slice reduced over ``dim``.

    Returns:
        codes (uint8, same shape as ``x``), zero and step (float16, ``dim`` kept with size 1).
    """
    codes, zero, step, _ = _quantize(x, bits, dim)
    return codes.to(torch.uint8), zero, step


def quantize_dequantize(
    x: torch.Tensor, bits: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize`, and what :func:`dequantize` gives back from its codes in float32, computed
    from the codes before they are cast to uint8 (integers up to 255: the same floats)."""
    codes, zero, step, (zero32, step32) = _quantize(x, bits, dim)
    return codes.to(torch.uint8), zero, step, codes * step32 + zero32


def _quantize(
    x: torch.Tensor, bits: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Float codes, float16 zero and step, and the two as float32."""
    xf = x if x.dtype == torch.float32 else x.float()
    zero, step, zero32, step32 = _params(xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True), bits)
    codes = ((xf - zero32) / step32).round().clamp(0, (1 << bits) - 1)
    return codes, zero, step, (zero32, step32)


def dequantize(
    codes: torch.Tensor, zero: torch.Tensor, step: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return (codes.float() * step.float() + zero.float()).to(dtype)
