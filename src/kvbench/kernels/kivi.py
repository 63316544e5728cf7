"""KIVI's quantize-and-pack and unpack-and-dequantize (arXiv:2402.02750) as Triton kernels, each
beside its torch reference in :mod:`kvbench.cache.quant` (same name, same signature), which
stores the same layout: either path reads what the other wrote.

Layout: codes of ``bits`` bits packed along head_dim, ``8 // bits`` codes a byte, lowest bits
first (3 bits: eight codes in a little-endian 24-bit word of three bytes). Keys: a float16 zero
and step per channel over each group of ``group`` tokens; values: per token and group of
``group`` channels (the last may be shorter). The zero rounds down and the step up to float16,
so every value stays within half a step of its reconstruction; codes round half to even.

The arithmetic is torch's, bit for bit: float32 throughout, IEEE division (``div_rn`` on a GPU;
the interpreter divides exactly) and no fused multiply-add (``enable_fp_fusion=False``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbench.cache import quant
from kvbench.kernels import dispatch

# the torch references, beside the kernels (the torch path runs them)
quantize_keys_reference = quant.quantize_keys
quantize_values_reference = quant.quantize_values
dequantize_keys_reference = quant.dequantize_keys
dequantize_values_reference = quant.dequantize_values

__all__ = [
    "dequantize_keys",
    "dequantize_keys_reference",
    "dequantize_values",
    "dequantize_values_reference",
    "quantize_keys",
    "quantize_keys_reference",
    "quantize_values",
    "quantize_values_reference",
]

BLOCK_N = 16  # tokens a dequantize or value-quantize program handles


@triton.jit
def _div(a, b, EXACT: tl.constexpr):
    # IEEE division on a GPU (Triton's `/` may be approximate there); the interpreter's is exact
    if EXACT:
        return tl.math.div_rn(a, b)
    return a / b


@triton.jit
def _params(lo, hi, BITS: tl.constexpr, EXACT: tl.constexpr):
    """float16 zero (lo rounded down) and step (rounded up) covering [lo, hi], and both as float32."""
    zero = lo.to(tl.float16)
    bits = zero.to(tl.int16, bitcast=True)
    # one float16 step towards -65504: down in magnitude above 0, up below it, -0 -> -2^-24
    down = tl.where(zero > 0, bits - 1, tl.where(zero < 0, bits + 1, -32767))
    down = tl.where(zero == -65504.0, bits, down)
    zero = tl.where(zero.to(tl.float32) > lo, down.to(tl.float16, bitcast=True), zero)
    zero32 = zero.to(tl.float32)
    step = tl.maximum(_div(hi - zero32, (1 << BITS) - 1.0, EXACT), 1e-8)
    step16 = step.to(tl.float16)
    bits = step16.to(tl.int16, bitcast=True)
    up = tl.where(step16 == 65504.0, bits, bits + 1)  # one float16 step towards 65504
    step16 = tl.where(step16.to(tl.float32) < step, up.to(tl.float16, bitcast=True), step16)
    return zero, step16, zero32, step16.to(tl.float32)


@triton.jit
def _range_params(xf, member, live, AXIS: tl.constexpr, BITS: tl.constexpr, EXACT: tl.constexpr):
    """:func:`_params` of the minimum and maximum of ``xf`` over its ``member`` elements along
    ``AXIS``; where ``live`` is False (padding past the tensor) the range is [0, 0]."""
    lo = tl.where(live, tl.min(tl.where(member, xf, float("inf")), axis=AXIS), 0.0)
    hi = tl.where(live, tl.max(tl.where(member, xf, float("-inf")), axis=AXIS), 0.0)
    return _params(lo, hi, BITS, EXACT)


@triton.jit
def _codes(x, zero32, step32, BITS: tl.constexpr, EXACT: tl.constexpr):
    """int32 codes of x: (x - zero) / step rounded half to even, clamped to [0, 2^BITS - 1]."""
    r = _div(x - zero32, step32, EXACT)
    whole = tl.floor(r)
    frac = r - whole  # exact: no floor(r + 0.5), which rounds 0.49999997 up
    odd = (whole.to(tl.int32) % 2) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    code = whole + up.to(tl.float32)
    return tl.minimum(tl.maximum(code, 0.0), (1 << BITS) - 1.0).to(tl.int32)


@triton.jit
def _pack_store(
    out, rows, row_mask, codes, D, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Packs ``codes`` (BLOCK_R, BLOCK_D) int32 along the channels into rows of D * BITS / 8 bytes."""
    row_bytes = D * BITS // 8
    if BITS == 3:
        words = tl.reshape(codes, (BLOCK_R, BLOCK_D // 8, 8))
        shifts = tl.arange(0, 8) * 3
        word = tl.sum(words << shifts[None, None, :], axis=2)  # 24 bits: eight codes
        w = tl.arange(0, BLOCK_D // 8)
        # a word's three bytes, lowest first; words past D // 8 are padding
        mask = row_mask[:, None] & (w[None, :] < D // 8)
        base = out + rows[:, None] * row_bytes + w[None, :] * 3
        for j in tl.static_range(3):
            tl.store(base + j, ((word >> (8 * j)) & 0xFF).to(tl.uint8), mask=mask)
    else:
        PER: tl.constexpr = 8 // BITS
        grouped = tl.reshape(codes, (BLOCK_R, BLOCK_D // PER, PER))
        shifts = tl.arange(0, PER) * BITS
        byte = tl.sum(grouped << shifts[None, None, :], axis=2)
        b = tl.arange(0, BLOCK_D // PER)
        mask = row_mask[:, None] & (b[None, :] < D // PER)  # bytes past the row's are padding
        tl.store(out + rows[:, None] * row_bytes + b[None, :], byte.to(tl.uint8), mask=mask)


@triton.jit
def _unpack_load(packed, rows, mask, cols, D, BITS: tl.constexpr):
    """int32 codes (rows x cols) from rows of D * BITS / 8 packed bytes."""
    row = packed + rows[:, None] * (D * BITS // 8)
    if BITS == 3:
        word_at = row + (cols[None, :] // 8) * 3
        word = tl.load(word_at, mask=mask, other=0).to(tl.int32)
        word |= tl.load(word_at + 1, mask=mask, other=0).to(tl.int32) << 8
        word |= tl.load(word_at + 2, mask=mask, other=0).to(tl.int32) << 16
        return (word >> ((cols[None, :] % 8) * 3)) & 7
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(row + cols[None, :] // PER, mask=mask, other=0).to(tl.int32)
    return (byte >> ((cols[None, :] % PER) * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _quantize_keys_kernel(
    x, packed, zero_out, step_out, D, stride_x, GROUP,
    BITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0)  # one group of GROUP tokens, every channel
    g = tl.arange(0, BLOCK_G)
    cols = tl.arange(0, BLOCK_D)
    rows = m * GROUP + g
    row_mask = g < GROUP  # BLOCK_G is GROUP rounded up to a power of two
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    xf = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # per channel over the group; channels past D get no infinities into the arithmetic
    zero, step, zero32, step32 = _range_params(xf, mask, col_mask, 0, BITS, EXACT)
    tl.store(zero_out + m * D + cols, zero, mask=col_mask)
    tl.store(step_out + m * D + cols, step, mask=col_mask)
    codes = _codes(xf, zero32[None, :], step32[None, :], BITS, EXACT)
    _pack_store(packed, rows, row_mask, codes, D, BITS, BLOCK_G, BLOCK_D)


@triton.jit
def _quantize_values_kernel(
    x, packed, zero_out, step_out, N, D, stride_x, GROUP,
    NGV: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EXACT: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < N
    mask = row_mask[:, None] & (cols[None, :] < D)
    xf = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    zero32 = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    step32 = tl.full((BLOCK_N, BLOCK_D), 1.0, dtype=tl.float32)  # channels past D: no 0 / 0
    for j in tl.static_range(NGV):  # per token, channel groups of GROUP (the last may be shorter)
        in_group = (cols >= j * GROUP) & (cols < tl.minimum((j + 1) * GROUP, D))
        member = row_mask[:, None] & in_group[None, :]
        zero, step, z32, s32 = _range_params(xf, member, row_mask, 1, BITS, EXACT)  # tokens past N: 0
        tl.store(zero_out + rows * NGV + j, zero, mask=row_mask)
        tl.store(step_out + rows * NGV + j, step, mask=row_mask)
        zero32 = tl.where(in_group[None, :], z32[:, None], zero32)
        step32 = tl.where(in_group[None, :], s32[:, None], step32)
    codes = _codes(xf, zero32, step32, BITS, EXACT)
    codes = tl.where(mask, codes, 0)  # channels past D pack as zero bits
    _pack_store(packed, rows, row_mask, codes, D, BITS, BLOCK_N, BLOCK_D)


@triton.jit
def _dequantize_kernel(
    packed, zero, step, group_ids, out, N, D, PER_GROUP, PARAM_STRIDE,
    BITS: tl.constexpr, KEYS: tl.constexpr, GROUP_IDS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    codes = _unpack_load(packed, rows, mask, cols, D, BITS).to(tl.float32)
    if KEYS:  # a (zero, step) per channel of the token's group
        if GROUP_IDS:  # noqa: SIM108  (a constexpr branch: one of the two is compiled)
            group = tl.load(group_ids + rows, mask=rows < N, other=0)
        else:
            group = rows // PER_GROUP
        at = group[:, None] * PARAM_STRIDE + cols[None, :]
    else:  # a (zero, step) per token and channel group of PER_GROUP
        at = rows[:, None] * PARAM_STRIDE + cols[None, :] // PER_GROUP
    z = tl.load(zero + at, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(step + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + rows[:, None] * D + cols[None, :], (codes * s + z).to(out.dtype.element_ty), mask=mask)


def _launch(kernel, grid, *args, **meta) -> None:
    if not dispatch.interpreted():
        meta["enable_fp_fusion"] = False  # codes * step + zero rounds twice, as torch's does
    kernel[grid](*args, **meta)


def _check_packable(d: int, bits: int) -> None:
    per = 8 if bits == 3 else 8 // bits
    if d % per:
        raise ValueError(f"head_dim {d} is not a multiple of {per} (needed to pack {bits}-bit codes)")


def _block_d(d: int) -> int:
    return max(triton.next_power_of_2(d), 16)


def quantize_keys(k: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kvbench.cache.quant.quantize_keys` (its reference) as a Triton kernel: one program a
    group of tokens."""
    n, d = k.shape
    _check_packable(d, bits)
    k = k if k.stride(-1) == 1 else k.contiguous()
    m = n // group
    packed = torch.empty(n, d * bits // 8, dtype=torch.uint8, device=k.device)
    zero = torch.empty(m, d, dtype=torch.float16, device=k.device)
    step = torch.empty_like(zero)
    if m:
        _launch(
            _quantize_keys_kernel, (m,), k, packed, zero, step, d, k.stride(0), group,
            BITS=bits, BLOCK_G=triton.next_power_of_2(group), BLOCK_D=_block_d(d),
            EXACT=not dispatch.interpreted(),
        )  # fmt: skip
    return packed, zero, step


def quantize_values(
    v: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kvbench.cache.quant.quantize_values` (its reference) as a Triton kernel."""
    n, d = v.shape
    _check_packable(d, bits)
    v = v if v.stride(-1) == 1 else v.contiguous()
    ngv = -(-d // group)
    packed = torch.empty(n, d * bits // 8, dtype=torch.uint8, device=v.device)
    zero = torch.empty(n, ngv, dtype=torch.float16, device=v.device)
    step = torch.empty_like(zero)
    if n:
        _launch(
            _quantize_values_kernel, (triton.cdiv(n, BLOCK_N),), v, packed, zero, step, n, d,
            v.stride(0), group, NGV=ngv, BITS=bits, BLOCK_N=BLOCK_N, BLOCK_D=_block_d(d),
            EXACT=not dispatch.interpreted(),
        )  # fmt: skip
    return packed, zero, step


def _dequantize(packed, zero, step, group_ids, bits, d, per_group, keys, dtype) -> torch.Tensor:
    n = packed.shape[0]
    # The interpreter truncates float32 to bfloat16 (a GPU rounds to nearest even, as torch does):
    # there, bfloat16 is stored as float32 and rounded by torch
    via32 = dtype == torch.bfloat16 and dispatch.interpreted()
    out = torch.empty(n, d, dtype=torch.float32 if via32 else dtype, device=packed.device)
    if n:
        _launch(
            _dequantize_kernel, (triton.cdiv(n, BLOCK_N),), packed.contiguous(), zero.contiguous(),
            step.contiguous(), zero if group_ids is None else group_ids, out, n, d, per_group or 1,
            zero.shape[1], BITS=bits, KEYS=keys, GROUP_IDS=group_ids is not None, BLOCK_N=BLOCK_N,
            BLOCK_D=_block_d(d),
        )  # fmt: skip
    return out.to(dtype) if via32 else out


def dequantize_keys(
    packed: torch.Tensor,
    zero: torch.Tensor,
    step: torch.Tensor,
    bits: int,
    dtype: torch.dtype,
    per_group: int | None = None,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`kvbench.cache.quant.dequantize_keys` (its reference) as a Triton kernel."""
    assert per_group is not None or group_ids is not None, "dequantize_keys: give per_group or group_ids"
    ids = None if per_group is not None else group_ids
    return _dequantize(packed, zero, step, ids, bits, zero.shape[-1], per_group, True, dtype)


def dequantize_values(
    packed: torch.Tensor,
    zero: torch.Tensor,
    step: torch.Tensor,
    bits: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`kvbench.cache.quant.dequantize_values` (its reference) as a Triton kernel."""
    return _dequantize(packed, zero, step, None, bits, head_dim, group, False, dtype)
