"""Asymmetric integer quantization with real bit packing (torch reference path).

Codes of ``bits`` bits are packed along the last dimension, so a row of ``D`` codes takes
``D * bits / 8`` bytes: 2, 4 and 8 bits pack ``8 // bits`` codes per byte; 3 bits pack eight codes
into three bytes. Scales and minima are stored in float16, rounded so
that every value stays within half a quantization step of its reconstruction.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from kvbench.cache import devices

SUPPORTED_BITS = (2, 3, 4, 8)


def _layout(bits: int) -> tuple[int, int]:
    """Codes per packed word and bytes per word."""
    return (8, 3) if bits == 3 else (8 // bits, 1)


def _at(t: torch.Tensor) -> tuple[torch.device, object]:
    """``t``'s device and the key of a memo shared between its layers
    (:func:`kvbench.cache.devices.device_of`): the constants below are held per key."""
    return t.device, devices.device_of(t)


@functools.lru_cache(maxsize=64)
def _multiples(
    count: int, step: int, at: tuple[torch.device, object], dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """``arange(count) * step`` (bit shifts), built once per device (:func:`_at`) and dtype: a
    decode step packs and unpacks per layer."""
    return (torch.arange(count, device=at[0], dtype=torch.int32) * step).to(dtype)


@functools.lru_cache(maxsize=16)
def _scalar(value: float, at: tuple[torch.device, object], dtype: torch.dtype) -> torch.Tensor:
    """A 0-d constant, built once per device (:func:`_at`) and dtype (``nextafter`` broadcasts it)."""
    return torch.tensor(value, device=at[0], dtype=dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., D)`` uint8 codes < 2**bits -> ``(..., D * bits // 8)`` uint8."""
    per, nbytes = _layout(bits)
    d = codes.shape[-1]
    if d % per:
        raise ValueError(f"head_dim {d} is not a multiple of {per} (needed to pack {bits}-bit codes)")
    if bits == 8 and codes.dtype == torch.uint8:  # one code per byte: packing changes nothing
        return codes.contiguous()
    grouped = codes.view(*codes.shape[:-1], d // per, per).to(torch.int32)
    word = (grouped << _multiples(per, bits, _at(codes))).sum(-1)  # at most 24 bits
    if nbytes == 1:
        return word.to(torch.uint8)
    out = (word[..., None] >> _multiples(nbytes, 8, _at(codes))) & 0xFF
    return out.reshape(*codes.shape[:-1], d // per * nbytes).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``(..., P)`` -> ``(..., P * 8 // bits)`` uint8."""
    return unpack_codes(packed, bits).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`unpack`'s codes as integers of whichever type is quicker to make (uint8 or int32), for
    arithmetic that follows. 2 and 4 bits, ``P`` a multiple of 4: four packed bytes are shifted at
    once as one little-endian int32 word (code ``i`` of a word sits at bit ``bits * i``, as it does
    in its bytes), which the CPU shifts per vector lane where it shifts bytes one at a time; 3 bits
    joins each 3-byte word in int32."""
    per, nbytes = _layout(bits)
    if bits == 8:
        return packed.contiguous()
    if nbytes == 1 and packed.shape[-1] % 4 == 0 and sys.byteorder == "little":
        word = packed.contiguous()
        if word.storage_offset() % 4 == 0:
            shifts = _multiples(32 // bits, bits, _at(packed))
            codes = (word.view(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
            return codes.view(*packed.shape[:-1], packed.shape[-1] * per)
    if nbytes == 1:
        shifts = _multiples(per, bits, _at(packed), torch.uint8)
        codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)
    words = packed.to(torch.int32).view(*packed.shape[:-1], packed.shape[-1] // nbytes, nbytes)
    word = (words << _multiples(nbytes, 8, _at(packed))).sum(-1)
    codes = (word[..., None] >> _multiples(per, bits, _at(packed))) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], word.shape[-1] * per)


def _params(
    lo: torch.Tensor, hi: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float16 minimum (rounded down) and step (rounded up) covering ``[lo, hi]``, and the two as
    float32 (what quantizing and dequantizing compute with)."""
    zero = lo.half()
    low = _scalar(-65504.0, _at(zero), zero.dtype)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, low), zero)
    zero32 = zero.float()
    step = ((hi - zero32) / ((1 << bits) - 1)).clamp(min=1e-8)
    step16 = step.half()
    high = _scalar(65504.0, _at(zero), zero.dtype)
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
    from the codes before they are cast to uint8 (integers up to 255: the same floats, and
    :func:`_dequantized`'s one pass)."""
    codes, zero, step, (zero32, step32) = _quantize(x, bits, dim)
    return codes.to(torch.uint8), zero, step, torch.addcmul(zero32, codes, step32)


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
    """``codes * step + zero`` in float32 (one ``addcmul``, :func:`_dequantized`), then ``dtype``;
    ``zero`` and ``step`` broadcast over ``codes``. The codes are cast as they are multiplied, not
    copied to float32 first."""
    return _dequantized(codes, step.float(), zero, dtype)


def _dequantized(
    codes: torch.Tensor,
    step: torch.Tensor,
    zero: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``codes * step + zero``, float32 ``step`` and ``zero`` of any float type broadcast over
    ``codes``: float32 products and sums, then ``dtype``; written into ``out`` (of ``dtype``,
    ``codes``' shape, any strides) when given, the float32 sums rounded as they are written.

    One pass (``addcmul``), so one decoded copy is all it writes. Whether or not it fuses the
    multiply and the add, it rounds as a product and then a sum do: a code (at most 8 bits) times
    a float16 step (11 significant bits), each scaled by a power of two or not
    (:func:`placed_codes`), is exact in float32, so the product has nothing to round."""
    if out is None:
        x = torch.addcmul(zero, codes, step)
        return x if dtype == torch.float32 else x.to(dtype)
    return torch.addcmul(zero, codes, step, out=out)


_PLACES: dict[tuple[int, object], tuple[torch.Tensor, torch.Tensor]] = {}


def _places(bits: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the ``8 // bits`` codes of a byte (2 and 4 bits): masks ``(2**bits - 1) << bits * i``
    (uint8) keeping each where it sits, and weights ``2**-(bits * i)`` (float32) turning what a mask
    keeps back into its code; on ``like``'s device, made once per device key
    (:func:`kvbench.cache.devices.device_of`: a decode step asks for them twice a layer)."""
    key = (bits, devices.device_of(like))
    held = _PLACES.get(key)
    if held is None:
        i = torch.arange(8 // bits, dtype=torch.int32)
        masks = (((1 << bits) - 1) << (bits * i)).to(torch.uint8)
        with torch.inference_mode(False):  # plain tensors, also when first asked inside a forward
            held = _PLACES[key] = masks.to(like.device), torch.exp2(-(bits * i).float()).to(like.device)
    return held


def placed_codes(packed: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`unpack`'s codes for arithmetic, with as few bytes written as can be: ``(..., P, 8 //
    bits)``, the codes of each byte, and weights ``(8 // bits,)`` float32 for them; or ``(..., P * 8
    // bits)`` one per element and None.

    At 2 and 4 bits (one masking pass, one byte per code, no shift and no wider integer) code ``i``
    of a byte stays where it sits, as ``code * 2**(bits * i)``: the weights ``2**-(bits * i)`` folded
    into its step give exactly ``code * step`` (scaling by a power of two is exact, the product is
    the same real number and rounds alike). At 8 bits the packed bytes are the codes (no pass); at
    3 bits they are unpacked (:func:`unpack_codes`). Callers view the codes in the shape their
    parameters broadcast over (a view of the pass's output: no flattening view made here)."""
    if bits == 8:
        return packed, None
    if bits == 3:
        return unpack_codes(packed, bits), None
    masks, weights = _places(bits, packed)
    return packed[..., None] & masks, weights


def dequantize_rows(packed: torch.Tensor, zero: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows of codes packed along them ``(N, P)``, one ``zero`` and ``step`` ``(N, 1)`` each: float32
    ``(N, P * 8 // bits)``, :func:`dequantize` of the unpacked codes (:func:`placed_codes`: no wider
    integer, each code's weight folded into its row's step)."""
    codes, weights = placed_codes(packed, bits)
    if weights is None:
        return dequantize(codes, zero, step, torch.float32)
    x = _dequantized(codes, step[..., None] * weights, zero[..., None], torch.float32)  # rows, bytes, codes
    return x.view(*packed.shape[:-1], -1)


class SlotDecode:
    """One field of packed codes decoded into given slots: ``codes * step + zero`` in one
    ``addcmul`` (:func:`_dequantized`), written into ``out`` (of the shape it was made for, any
    strides). Made once for a segment's present tokens (the parameters' views in the slots'
    broadcast shape, the masks and weights of :func:`placed_codes`), called at each decode step:
    then the masking pass, the steps times their weights and the ``addcmul`` run, and no view of
    the parameters is made again (:meth:`kvbench.compressors.quantized.QuantSegment.slots_decoder`).

    Args:
        packed: ``(N, P)`` packed codes.
        bits: their width.
        step: the float16 steps, viewed so that (times the weights, where there are) they read as
            ``params`` (``(*lead, 1, per)``).
        zero: the float16 zeros, viewed to broadcast over ``shape``.
        shape: the slots viewed as the codes' groups, ``(..., codes of a byte)`` at 2 and 4 bits.
        params: the shape of the steps times their weights.
    """

    __slots__ = ("packed", "bits", "masks", "weights", "step", "zero", "shape", "params")

    def __init__(
        self,
        packed: torch.Tensor,
        bits: int,
        step: torch.Tensor,
        zero: torch.Tensor,
        shape: tuple[int, ...],
        params: tuple[int, ...],
    ) -> None:
        self.packed, self.bits, self.step, self.zero = packed, bits, step, zero
        self.masks: torch.Tensor | None = None
        self.weights: torch.Tensor | None = None
        if bits in (2, 4):
            self.masks, self.weights = _places(bits, packed)
        self.shape, self.params = shape, params

    def __call__(self, out: torch.Tensor) -> None:
        masks, weights = self.masks, self.weights
        if masks is None or weights is None:  # 8 bits: the bytes are the codes; 3: unpacked
            codes, step = placed_codes(self.packed, self.bits)[0], self.step.float()
        else:
            codes, step = self.packed[..., None] & masks, self.step * weights
        torch.addcmul(self.zero, codes.view(self.shape), step.view(self.params), out=out.view(self.shape))


def key_slots(
    packed: torch.Tensor, zero: torch.Tensor, step: torch.Tensor, bits: int, per_group: int, slots: torch.Size
) -> SlotDecode:
    """:func:`dequantize_keys` of groups of ``per_group`` tokens into slots of shape ``slots``
    (``(..., D)`` over the tokens in order: ``(rows, n, D)`` of a decoded layer, ``n`` a multiple of
    ``per_group``): the tokens as ``(..., groups, per_group, D)``, each channel's step times its
    code's weight."""
    m, d = zero.shape
    shape = (*slots[:-2], slots[-2] // per_group, per_group, d)
    params = (*shape[:-2], 1, d)
    per = 8 // bits if bits in (2, 4) else 1
    return SlotDecode(packed, bits, step.view(m, d // per, per), zero.view(params), shape, params)


def value_slots(
    packed: torch.Tensor, zero: torch.Tensor, step: torch.Tensor, bits: int, group: int, slots: torch.Size
) -> SlotDecode:
    """:func:`dequantize_values` into slots of shape ``slots`` (``(..., head_dim)`` over the tokens in
    order), where the groups tile ``head_dim`` in whole bytes (:func:`tiled`): a group's codes byte
    by byte, ``(..., groups, bytes of a group, codes of a byte)``, with a step per (token, group,
    code of a byte)."""
    d, ngv = slots[-1], zero.shape[1]
    per = 8 // bits if bits in (2, 4) else 1
    tokens = slots[:-1]
    shape = (*tokens, ngv, min(group, d) // per, per)
    return SlotDecode(
        packed, bits, step[..., None], zero.view(*tokens, ngv, 1, 1), shape, (*tokens, ngv, 1, per)
    )


def tiled(bits: int, head_dim: int, groups: int, group: int) -> bool:
    """Whether value groups of ``group`` channels (one group of all ``head_dim`` channels where
    ``group >= head_dim``), ``groups`` of them, tile ``head_dim`` in whole bytes of codes (at 2 and
    4 bits :func:`placed_codes` leaves ``8 // bits`` codes of a byte in place)."""
    tile = min(group, head_dim)
    return groups * tile == head_dim and tile % (8 // bits if bits in (2, 4) else 1) == 0


# --- KIVI's layout (arXiv:2402.02750): the torch path, and the reference of kvbench.kernels.kivi -


def quantize_keys(k: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys per channel over whole groups of ``group`` tokens.

    Args:
        k: ``(N, D)`` keys, ``N`` a multiple of ``group``.

    Returns:
        packed codes ``(N, D * bits / 8)`` uint8, and a float16 zero and step ``(N / group, D)``.
    """
    d = k.shape[-1]
    codes, zero, step = quantize(k.view(-1, group, d), bits, dim=1)
    return pack(codes.view(-1, d), bits), zero.view(-1, d), step.view(-1, d)


def quantize_values(
    v: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values per token over groups of ``group`` channels (the last group may be shorter: it is
    padded with its last channel, which leaves its minimum and maximum as they are).

    Args:
        v: ``(N, D)`` values.

    Returns:
        packed codes ``(N, D * bits / 8)`` uint8, and a float16 zero and step ``(N, ceil(D / group))``.
    """
    d = v.shape[-1]
    ngv = -(-d // group)
    vf = v.float()
    if ngv * group != d:
        vf = F.pad(vf, (0, ngv * group - d), mode="replicate")
    codes, zero, step = quantize(vf.view(-1, ngv, group), bits, dim=2)
    codes = codes.view(-1, ngv * group)[:, :d]
    return pack(codes.contiguous(), bits), zero.view(-1, ngv), step.view(-1, ngv)


def dequantize_keys(
    packed: torch.Tensor,
    zero: torch.Tensor,
    step: torch.Tensor,
    bits: int,
    dtype: torch.dtype,
    per_group: int | None = None,
    group_ids: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_keys` for ``(N, P)`` packed codes: ``(N, D)`` of ``dtype``, or
    written into ``out`` (``(..., D)`` of ``dtype`` over the ``N`` tokens in order, any strides:
    ``(rows, n, D)`` slots of a decoded layer, ``n`` a multiple of ``per_group``).

    The token groups are ``per_group`` tokens each (parameters broadcast over each), or given by
    ``group_ids`` ``(N,)`` where an eviction left groups of different sizes (parameters gathered per
    token).
    """
    if per_group is not None and out is not None:
        key_slots(packed, zero, step, bits, per_group, out.shape)(out)
        return out
    m, d = zero.shape
    codes, weights = placed_codes(packed, bits)
    if weights is None:
        step = step.float()
    else:  # each channel's step times its code's weight (float32), as the codes' bytes lie
        per = weights.shape[0]
        step = step.view(m, d // per, per) * weights
    if per_group is None:
        assert group_ids is not None, "dequantize_keys: give per_group or group_ids"
        shape: tuple[int, ...] = (-1, d) if out is None else tuple(out.shape)
        zero, step = zero[group_ids].view(shape), step.view(m, d)[group_ids].view(shape)
        x = _dequantized(codes.view(shape), step, zero, dtype, out)
        return x.view(-1, d) if out is None else out
    # the tokens as (groups, per_group, D)
    x = _dequantized(codes.view(m, per_group, d), step.view(m, 1, d), zero.view(m, 1, d), dtype)
    return x.view(-1, d)


def dequantize_values(
    packed: torch.Tensor,
    zero: torch.Tensor,
    step: torch.Tensor,
    bits: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_values` for ``(N, P)`` packed codes: ``(N, head_dim)`` of ``dtype``,
    or written into ``out`` (``(..., head_dim)`` of ``dtype`` over the ``N`` tokens in order, any
    strides)."""
    d, ngv = head_dim, zero.shape[1]
    if tiled(bits, d, ngv, group):  # groups tile head_dim, in whole bytes
        if out is not None:
            value_slots(packed, zero, step, bits, group, out.shape)(out)
            return out
        codes, weights = placed_codes(packed, bits)
        per = 1 if weights is None else weights.shape[0]
        shape = (-1, ngv, min(group, d) // per, per)  # a group's codes byte by byte
        # float32 steps per (token, group, code of a byte), each code's weight folded in
        step = (
            step.float().view(-1, ngv, 1, 1)
            if weights is None
            else (step[..., None] * weights).view(-1, ngv, 1, per)
        )
        return _dequantized(codes.view(shape), step, zero.view(-1, ngv, 1, 1), dtype).view(-1, d)
    unpacked = unpack_codes(packed, bits)
    zeros = zero.repeat_interleave(group, dim=1)[:, :d]
    steps = step.float().repeat_interleave(group, dim=1)[:, :d]
    flat: tuple[int, ...] = (-1, d) if out is None else tuple(out.shape)
    x = _dequantized(unpacked.view(flat), steps.view(flat), zeros.view(flat), dtype, out)
    return x.view(-1, d) if out is None else out
