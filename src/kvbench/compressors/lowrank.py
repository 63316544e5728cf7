"""Shared pieces of the low-rank compressors (``svd``, ``lora``, ``lora_plus_plus``).

Keys are cached after rotary embedding; these compressors factor pre-RoPE keys, as ShadowKV and
Palu do: each token's rotation is undone at its original position before factoring and applied
again on read. Values are never rotated.

Here: the calibrated bases of ``lora`` and ``lora_plus_plus``
(:func:`calibrated_bases`), their latent segment (:class:`LatentSegment`), and a measured
reconstruction error (:class:`Residual`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from kvbench.cache import partials, quant
from kvbench.cache.rotary import Rotary
from kvbench.cache.segments import RowCounts, Segment, as_float, packed_rows
from kvbench.cache.side import SideData
from kvbench.cache.surface import TechniqueStore
from kvbench.calibration import lora_artifact
from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.roles import BindContext, Budget
from kvbench.select import leaving, moving_per_row


def pre_rope(rotary: Rotary, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Undo the rotation of cached keys ``(n, D)`` at their positions ``(n,)``: float32 ``(n, D)``."""
    return rotary.unrotate(as_float(k), pos)


def check_rank(
    key: str, rank: int | None, limit: int | None = None, what: str = "", nullable: bool = False
) -> None:
    """Refuse a rank that is not an integer in ``[1, limit]`` (``what`` names the limit; ``None``
    allowed when ``nullable``)."""
    if rank is None and nullable:
        return
    ok = isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1
    if not ok or (limit is not None and rank > limit):  # type: ignore[operator]
        allowed = "a positive integer" if limit is None else f"an integer in [1, {limit}] ({what})"
        raise ConfigError(f"{key}={rank}: must be {allowed}" + (" or null" if nullable else ""))


def calibrated_bases(
    ctx: BindContext, key_rank: int, value_rank: int, tokens: int
) -> dict[str, torch.Tensor]:
    """Per-layer, per-KV-head orthonormal bases of pre-RoPE keys and values, fitted on calibration
    text once and reused from disk (the record joins ``ctx.calibrations``).

    Returns:
        ``{"key": (L, H_kv, D, key_rank), "value": (L, H_kv, D, value_rank)}`` on CPU.
    """
    tensors, record = lora_artifact(ctx.model, key_rank, value_rank, tokens)
    if record not in ctx.calibrations:
        ctx.calibrations.append(record)
    want = {"key": key_rank, "value": value_rank}
    for name, rank in want.items():
        shape = (ctx.num_layers, ctx.kv_heads, ctx.head_dim, rank)
        if tuple(tensors[name].shape) != shape:
            got = tuple(tensors[name].shape)
            raise ConfigError(f"calibration artifact {record['path']}: {name} bases {got}, expected {shape}")
    return {name: tensors[name] for name in want}


@dataclass
class Bases:
    """One layer's key and value bases ``(H_kv, D, r)``: as stored (``key``, ``value``, the model
    dtype, counted in the layer's bytes; the fused kernels read these), and as the torch path
    multiplies them, made once when the layer's bases are placed, never at a step (issue 29):
    float32 (``key32``, ``value32``: the same tensors in a float32 model) and the key basis in
    float32 with its rows in the rotation's pairs order (``key_pairs``, :meth:`Rotary.in_pairs_order`;
    None where the rotation is partial), which rebuilds keys whose turned pairs come side by side
    (:meth:`Rotary.rotate_rebuilt`).
    The copies are held, so the resident bytes count them."""

    key: torch.Tensor
    value: torch.Tensor
    key32: torch.Tensor
    value32: torch.Tensor
    key_pairs: torch.Tensor | None

    @classmethod
    def make(cls, rotary: Rotary, key: torch.Tensor, value: torch.Tensor) -> Bases:
        key32 = as_float(key)
        return cls(key, value, key32, as_float(value), rotary.in_pairs_order(key32))

    def heads(self, first: int, count: int) -> Bases:
        """The bases of heads ``first .. first + count - 1`` (views)."""
        part = (getattr(self, f.name) for f in dataclasses.fields(self))
        return Bases(*(None if t is None else t[first : first + count] for t in part))  # type: ignore[arg-type]


@dataclass
class LayerBases(SideData):
    """One layer's :class:`Bases` per compressor ``prefix`` (the stored ones counted in the layer's
    bytes once)."""

    bases: dict[str, Bases] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        return [t for b in self.bases.values() for t in (b.key, b.value)]


def layer_bases(
    store: TechniqueStore, bases: dict[str, torch.Tensor], layer: int, prefix: str, rotary: Rotary
) -> Bases:
    """This layer's :class:`Bases`, placed in the store's side data (the stored ones counted in its
    bytes) in the model dtype on first use."""
    side = store.side(LayerBases)
    if side is None:
        side = LayerBases()
        store.set_side(side)
    if prefix not in side.bases:
        key, value = (
            bases[name][layer].to(store.device, store.dtype).contiguous() for name in ("key", "value")
        )
        side.bases[prefix] = Bases.make(rotary, key, value)
    return side.bases[prefix]


PARAM_FIELDS = ("kzero", "kstep", "vzero", "vstep")  # quantized latents' zero and step per token
LATENT_FIELDS = ("klat", "vlat", *PARAM_FIELDS)  # per token, the optional ones None


@packed_rows(*LATENT_FIELDS)
@dataclass
class LatentSegment(RowCounts, Segment):
    """Tokens as latents on per-head bases: ``K = rotate(klat · kbasisᵀ)``, ``V = vlat · vbasisᵀ``.

    Per token: ``klat`` ``(N, rk)`` and ``vlat`` ``(N, rv)`` in the model dtype, or, with ``bits``,
    packed codes ``(N, r * bits / 8)`` plus float16 ``kzero``/``kstep``/``vzero``/``vstep``
    ``(N, 1)``. The bases ``(H_kv, D, r)`` live in the layer's :class:`LayerBases` (counted once there).
    """

    rotary: Any = None
    bases: Bases = None  # type: ignore[assignment]
    bits: int | None = None
    klat: torch.Tensor = None  # type: ignore[assignment]
    vlat: torch.Tensor = None  # type: ignore[assignment]
    kzero: torch.Tensor | None = None
    kstep: torch.Tensor | None = None
    vzero: torch.Tensor | None = None
    vstep: torch.Tensor | None = None

    FIELDS = LATENT_FIELDS

    @classmethod
    def encode(
        cls,
        rotary: Rotary,
        bases: Bases,
        bits: int | None,
        k: torch.Tensor,
        v: torch.Tensor,
        pos: torch.Tensor,
        lens: torch.Tensor,
        residuals: tuple[Residual, Residual] | None = None,
    ) -> LatentSegment:
        """Project tokens (rotated keys ``k``, values ``v`` ``(n, D)``) onto the bases; ``residuals``
        (keys, values) accumulate the error of what is stored.

        What is stored is rebuilt here for the residuals (pre-RoPE: no rotation needed).
        """
        seg = cls(lens=lens, pos=pos, rotary=rotary, bases=bases, bits=bits)
        kpre = pre_rope(rotary, k, pos)
        kl, vl = seg._project(kpre, bases.key32), seg._project(as_float(v), bases.value32)
        if bits is None:
            seg.klat, seg.vlat = kl.to(bases.key.dtype), vl.to(bases.value.dtype)
            kl, vl = seg.latents()
        else:
            # One (zero, step) per token along its latent; the codes dequantize as latents() would
            # after packing (packing is lossless).
            kc, seg.kzero, seg.kstep, kl = quant.quantize_dequantize(kl, bits, dim=-1)
            vc, seg.vzero, seg.vstep, vl = quant.quantize_dequantize(vl, bits, dim=-1)
            seg.klat, seg.vlat = quant.pack(kc, bits), quant.pack(vc, bits)
        if residuals is not None:
            residuals[0].add(kpre, seg._expand(kl, bases.key32))
            residuals[1].add(v, seg._expand(vl, bases.value32))
        return seg

    def layout(self) -> tuple[Any, ...]:
        return (self.bits, self.bases.key.shape, self.bases.value.shape)

    def data_fields(self) -> dict[str, torch.Tensor]:
        fields = {name: getattr(self, name) for name in self.FIELDS}
        return {name: t for name, t in fields.items() if t is not None}

    def latents(
        self, per_row: bool = False, get: Callable[[str], Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 key and value latents ``(N, rk)``, ``(N, rv)`` (dequantized with ``bits``); with
        ``per_row``, ``(BH, n, rk)``, ``(BH, n, rv)`` read in place (every head-row holds ``n``).
        ``get``: each field by name, where the caller holds them (:meth:`reader`)."""
        if get is None:
            get = self.per_row_field if per_row else lambda name: getattr(self, name)
        klat, vlat = get("klat"), get("vlat")
        if self.bits is None:
            return as_float(klat), as_float(vlat)
        kzero, kstep, vzero, vstep = (get(name) for name in PARAM_FIELDS)
        return (
            quant.dequantize_rows(klat, kzero, kstep, self.bits),
            quant.dequantize_rows(vlat, vzero, vstep, self.bits),
        )

    def head_rows(self, lo: int, hi: int) -> Segment:
        """:meth:`Segment.head_rows`, with the bases of the part's heads: a part within one sequence
        takes its heads' slice of the bases."""
        part = super().head_rows(lo, hi)
        h = self.bases.key.shape[0]
        if part is not self and (lo % h or (hi - lo) % h):
            first = lo % h
            assert first + hi - lo <= h, f"head-rows {lo}..{hi - 1} span sequences of {h} heads in part"
            assert isinstance(part, LatentSegment)
            part.bases = self.bases.heads(first, hi - lo)
        return part

    def torch_partials(self) -> bool:
        return self.rows.width >= partials.PARTIAL_MIN_SLOTS  # (a head-row holds at most width)

    def attend_partials(self, query: torch.Tensor, scaling: float, batch: int) -> Any:
        """Attention over the latents, for bases shared by the batch's sequences (not a part of one
        sequence's heads). On the Triton path, the fused kernel
        (:mod:`kvbench.kernels.latent_decode`: keys rebuilt and rotated in registers, values kept
        latent; quantized latents' codes dequantized in registers). On the torch path, for
        head-rows of the same length (at least :data:`kvbench.cache.partials.PARTIAL_MIN_SLOTS`):
        keys rebuilt and rotated as :meth:`read` does, values kept latent, the output summed in
        latent space and expanded once (:func:`kvbench.cache.partials.partial`): a value is never
        rebuilt."""
        if self.bases.key.shape[0] * batch != self.lens.numel():
            return None
        kernel = dispatch.kernels("latent_decode", batch, self.rows.width)
        n = self.row_count()
        if kernel is not None:  # per head-row in place where the rows hold one count, else flat
            get: Any = self.per_row_field if n is not None else lambda name: getattr(self, name)
            params = None if self.bits is None else tuple(get(x) for x in PARAM_FIELDS)
            bases = self.bases
            return kernel.partials(
                query, get("klat"), get("vlat"), get("pos"), bases.key, bases.value, self.rotary, self.lens,
                self.rows.width, scaling, self.bits, params, per_row=n is not None,
            )  # fmt: skip
        if n is None or n < partials.PARTIAL_MIN_SLOTS or dispatch.kernels("attention", batch, n) is not None:
            return None
        kl, vl = self.latents(per_row=True)
        k = self._keys_rows(kl, n)
        shape = (batch, self.bases.key.shape[0], n, -1)
        return partials.partial(query, k.view(shape), vl.view(shape), scaling, basis=self.bases.value32)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.row_count()
        if n is None:  # head-rows of different lengths: flat
            kl, vl = self.latents()
            k = self._rotated(lambda basis: self._expand(kl, basis), self.pos, None)
            return k.to(dtype), self._expand(vl, self.bases.value32).to(dtype)
        return self._read_rows(dtype, n, self.per_row_field)

    def reader(self, dtype: torch.dtype) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
        """:meth:`read` of head-rows that each hold the same number of tokens, with each field's
        per-row view (:meth:`per_row_field`) taken once here, not at each step; None otherwise."""
        n = self.row_count()
        if n is None:
            return None
        held = {name: self._per_row(name) for name in self.PACKED}
        return partial(self._read_rows, dtype, n, held.__getitem__)

    def _read_rows(
        self, dtype: torch.dtype, n: int, get: Callable[[str], Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`read` where every head-row holds ``n`` tokens, each field's per-row view by
        ``get``: the latents read in place, nothing unpacked."""
        kl, vl = self.latents(get=get)
        k, v = self._keys_rows(kl, n, get("pos")), self._expand_rows(vl, self.bases.value32)
        return k.to(dtype).view(-1, k.shape[-1]), v.to(dtype).view(-1, v.shape[-1])

    def _project(self, x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        """``(N, D)`` -> ``(N, r)`` latents on each token's head basis ``(H, D, r)``."""
        return self._per_head("bhtd,hdr->bhtr", x, basis)

    def _expand(self, lat: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        """``(N, r)`` latents -> ``(N, D)`` float32 on each token's head basis ``(H, D, r)``."""
        return self._per_head("bhtr,hdr->bhtd", lat, basis)

    def _per_head(self, equation: str, x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        """``x`` ``(N, ·)`` through each token's head basis by ``equation``, per head-row rectangle."""
        p, valid = self.per_row(x)  # (BH, T, ·)
        return self.flat(self._per_head_rows(equation, p, basis), valid)

    def _keys_rows(self, klat: torch.Tensor, n: int, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Keys ``(BH, n, D)`` float32 rebuilt from key latents ``(BH, n, rk)`` and rotated at the
        stored positions, each head-row's ``n`` tokens read in place (:meth:`_rotated`); ``pos``:
        their per-row view, where the caller holds it."""
        pos = self.per_row_field("pos") if pos is None else pos
        return self._rotated(lambda basis: self._expand_rows(klat, basis), pos, n)

    def _rotated(
        self, rebuild: Callable[[torch.Tensor], torch.Tensor], pos: torch.Tensor, per_row: int | None
    ) -> torch.Tensor:
        """Float32 keys that ``rebuild`` makes from the float32 key basis, rotated at ``pos``
        (:meth:`Rotary.rotate_rebuilt`, on the basis held in pairs order: no gather at a step)."""
        bases = self.bases
        return self.rotary.rotate_rebuilt(rebuild, bases.key32, pos, per_row, bases.key_pairs)

    @staticmethod
    def _expand_rows(lat: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        """``(BH, n, r)`` latents -> ``(BH, n, D)`` float32 on each head-row's basis ``(H, D, r)``.
        One sequence's (``BH = H``, every decode step of a batch of one): the one batched product
        that :func:`torch.einsum` makes of it, taken without the einsum (half the host's time of a
        call; the same values, bit for bit: ``tests/test_lowrank.py``)."""
        if lat.shape[0] == basis.shape[0]:
            return torch.bmm(lat, as_float(basis).transpose(1, 2))
        return LatentSegment._per_head_rows("bhtr,hdr->bhtd", lat, basis)

    @staticmethod
    def _per_head_rows(equation: str, p: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        """``p`` ``(BH, T, ·)`` through each head-row's basis ``(H, D, r)`` by ``equation``."""
        h = basis.shape[0]
        out = torch.einsum(equation, p.view(-1, h, *p.shape[1:]), as_float(basis))
        return out.reshape(p.shape[0], p.shape[1], -1)


@dataclass
class Residual:
    """Measured relative squared reconstruction error of what a compressor stored so far.

    Each batch's error and norm stay float32 device scalars until :meth:`value` (or every
    ``FLUSH`` of them) reads them in one synchronisation, then add up on the host in the order they
    came: the same float64 sums as reading each at once, without a synchronisation per layer.
    """

    err: float = 0.0
    norm: float = 0.0
    pending: list[torch.Tensor] = field(default_factory=list, repr=False, compare=False)

    FLUSH = 256

    def add(self, exact: torch.Tensor, rebuilt: torch.Tensor) -> None:
        exact = as_float(exact)
        err, norm = (as_float(rebuilt) - exact).pow(2).sum(), exact.pow(2).sum()
        if self.pending and (self.pending[0].device != err.device or len(self.pending) >= self.FLUSH):
            self._flush()
        self.pending += [err, norm]

    def value(self) -> float | None:
        self._flush()
        return self.err / self.norm if self.norm > 0 else None

    def _flush(self) -> None:
        if not self.pending:
            return
        sums = torch.stack(self.pending).tolist()  # float32 values, exactly as float() reads them
        for err, norm in zip(sums[::2], sums[1::2]):
            self.err += err
            self.norm += norm
        self.pending.clear()


@dataclass
class LatentCache:
    """What ``lora`` and ``lora_plus_plus`` share once bound: the rotary, the calibrated bases,
    the latent width and the measured residuals.

    The tokens past the full-precision window (sinks and window stay) leave it in whole groups of
    ``move_group`` (Palu's quantized cache moves its full-precision residual out in whole blocks)
    and are stored as latents: one encoding, projection and measured error for a group, where one
    token at a time takes them at every decode step.
    """

    prefix: str
    rotary: Rotary
    bases: dict[str, torch.Tensor]
    bits: int | None = None
    move_group: int = 1  # tokens past the window leave it in whole groups of this many

    def __post_init__(self) -> None:
        self.residuals = (Residual(), Residual())

    @classmethod
    def bind(
        cls,
        ctx: BindContext,
        prefix: str,
        key_rank: int,
        value_rank: int,
        tokens: int,
        bits: int | None,
        move_group: int = 1,
    ) -> LatentCache:
        """Check the ranks against the model and load (or fit once) the bases."""
        rotary = ctx.rotary()
        check_rank("compressor.key_rank", key_rank, ctx.head_dim, "head_dim")
        check_rank("compressor.value_rank", value_rank, ctx.head_dim, "head_dim")
        return cls(prefix, rotary, calibrated_bases(ctx, key_rank, value_rank, tokens), bits, move_group)

    def compress(self, layer: int, store: TechniqueStore, budget: Budget) -> None:
        def build(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor) -> Segment:
            bases = layer_bases(store, self.bases, layer, self.prefix, self.rotary)
            return LatentSegment.encode(self.rotary, bases, self.bits, k, v, pos, lens, self.residuals)

        move = leaving(store, budget, self.move_group)
        if move is not None:
            store.move_out(move, build, per_row=moving_per_row(store, budget, self.move_group))

    def metrics(self) -> dict[str, float | list[float] | None]:
        """Relative squared error of the pre-RoPE keys and of the values stored so far."""
        return {"key_residual": self.residuals[0].value(), "value_residual": self.residuals[1].value()}
