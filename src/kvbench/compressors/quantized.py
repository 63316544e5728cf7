"""KIVI: keys quantized per channel, values per token, real packed storage (arXiv:2402.02750).

Tokens leave the full-precision window in groups of ``group_size`` per KV head. Keys of a group
share one (zero, step) per channel; each value token has one (zero, step) per ``group_size``
channels (the last channel group may be shorter, e.g. head_dim 80). Sinks and the window stay at
full precision. Evicting a quantized token frees its codes; a key group's parameters are freed
with its last token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvbench.cache import quant, ragged
from kvbench.cache.segments import GroupedSegment
from kvbench.cache.surface import Build, TechniqueStore
from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.roles import Compressor, Flags
from kvbench.select import leaving_groups, moving_per_row


def _ops() -> ModuleType:
    """KIVI's four operations (quantize and dequantize, keys and values) on the cell's path
    (:mod:`kvbench.kernels.dispatch`): the Triton kernels, or their torch references."""
    return dispatch.kernels("kivi") or quant


@dataclass
class QuantSegment(GroupedSegment):
    """Packed tokens. Per token: ``kcodes`` ``(N, D*kb/8)``, ``vcodes`` ``(N, D*vb/8)``,
    ``vzero``/``vstep`` ``(N, ceil(D/G))``. Per key group: ``kzero``/``kstep`` ``(M, D)``,
    ``gcount`` ``(M,)`` live tokens; ``glens`` ``(BH,)`` groups per head-row."""

    key_bits: int = 2
    value_bits: int = 2
    group_size: int = 32
    head_dim: int = 64
    kcodes: torch.Tensor = None  # type: ignore[assignment]
    vcodes: torch.Tensor = None  # type: ignore[assignment]
    vzero: torch.Tensor = None  # type: ignore[assignment]
    vstep: torch.Tensor = None  # type: ignore[assignment]
    kzero: torch.Tensor = None  # type: ignore[assignment]
    kstep: torch.Tensor = None  # type: ignore[assignment]

    def data_fields(self) -> dict[str, torch.Tensor]:
        return {"kcodes": self.kcodes, "vcodes": self.vcodes, "vzero": self.vzero, "vstep": self.vstep}

    def group_fields(self) -> dict[str, torch.Tensor]:
        return {"kzero": self.kzero, "kstep": self.kstep}

    def attend_partials(self, query: torch.Tensor, scaling: float, batch: int) -> Any:
        """The fused kernel (:mod:`kvbench.kernels.kivi_decode`): codes dequantized in registers,
        where every key group holds the same number of tokens."""
        per_group = self.full_groups()
        kivi_decode = None if per_group is None else dispatch.kernels("kivi_decode", batch, self.rows.width)
        if kivi_decode is None:
            return None
        return kivi_decode.partials(
            query, self.kcodes, self.vcodes, self.vzero, self.vstep, self.kzero, self.kstep,
            self.lens, self.glens, self.rows.width, self.key_bits, self.value_bits, per_group,
            self.group_size, scaling,
        )  # fmt: skip

    def layout(self) -> tuple[int, int]:
        return (self.key_bits, self.value_bits)

    def writes_into(self) -> tuple[bool, bool]:
        """On the torch path, keys and values are dequantized straight into the slots given."""
        torch_path = _ops() is quant
        return torch_path, torch_path

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read_into(None, None, dtype)

    def slots_decoder(self, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """On the torch path, where every key group holds the same number of tokens and the value
        groups tile the head (:func:`quant.key_slots`, :func:`quant.value_slots`: what
        :meth:`read_into` runs there, its parameters viewed here once)."""
        per_group = self.full_groups()
        ngv = self.vzero.shape[1]
        if (
            _ops() is not quant
            or per_group is None
            or not quant.tiled(self.value_bits, self.head_dim, ngv, self.group_size)
        ):
            return None
        slots = torch.Size((self.rows.bh, self.rows.width, self.head_dim))
        keys = quant.key_slots(self.kcodes, self.kzero, self.kstep, self.key_bits, per_group, slots)
        values = quant.value_slots(
            self.vcodes, self.vzero, self.vstep, self.value_bits, self.group_size, slots
        )

        def decode(k: torch.Tensor, v: torch.Tensor) -> None:
            keys(k)
            values(v)

        return decode

    def read_into(
        self, k: torch.Tensor | None, v: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = _ops()
        per_group = self.full_groups()
        gid = self.group_ids() if per_group is None else None
        keys = ops.dequantize_keys(
            self.kcodes, self.kzero, self.kstep, self.key_bits, dtype, per_group, gid, **_into(k)
        )
        values = ops.dequantize_values(
            self.vcodes, self.vzero, self.vstep, self.value_bits, self.head_dim, self.group_size, dtype,
            **_into(v),
        )  # fmt: skip
        return keys, values


def _into(out: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The ``out`` argument of :mod:`kvbench.cache.quant`'s dequantizers, where there is one (the
    Triton path's take none: :meth:`QuantSegment.writes_into` gives them no slots)."""
    return {} if out is None else {"out": out}


@dataclass
class QuantizedCompressor(Compressor):
    """KIVI with ``bits`` (or separate ``key_bits``/``value_bits``) in {2, 3, 4, 8}."""

    name: str = "quantized"
    # 2: a bare decode step decodes the layer without a view (its joined positions are not
    # kept up to date at every step): resident bytes only (issue 29, CHANGELOG.md)
    version = 2
    bits: int = 2
    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int = 32
    flags = Flags(changes_representation=True)

    def check_knobs(self) -> None:
        for key in ("bits", "key_bits", "value_bits"):
            if key != "bits" and getattr(self, key) is None:
                continue  # ``bits``
            if getattr(self, key) not in quant.SUPPORTED_BITS:
                allowed = ", ".join(map(str, quant.SUPPORTED_BITS))
                raise ConfigError(f"compressor.{key}={getattr(self, key)}: allowed {allowed}")
        if self.group_size < 1:
            raise ConfigError(f"compressor.group_size={self.group_size}: must be >= 1")

    def compress(self, layer: int, store: TechniqueStore) -> None:
        move = leaving_groups(store, self.budget, self.group_size)
        if move is not None:
            per_row = moving_per_row(store, self.budget, self.group_size)
            kb = self.bits if self.key_bits is None else self.key_bits
            vb = self.bits if self.value_bits is None else self.value_bits
            store.move_out(move, quantizer(kb, vb, self.group_size), per_row=per_row)


def quantizer(key_bits: int, value_bits: int, group: int) -> Build:
    """Quantizes moved tokens (whole groups per head-row) at these bit widths, in groups of ``group``
    (KIVI's layout: :func:`quantize_tokens`)."""
    kb, vb = int(key_bits), int(value_bits)
    return lambda k, v, pos, lens: quantize_tokens(k, v, pos, lens, kb, vb, group)


def quantize_tokens(
    k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, kb: int, vb: int, g: int
) -> QuantSegment:
    """KIVI quantization of whole groups of ``g`` tokens per head-row (``lens`` multiples of ``g``)."""
    ops = _ops()
    kcodes, kzero, kstep = ops.quantize_keys(k, kb, g)
    vcodes, vzero, vstep = ops.quantize_values(v, vb, g)
    return QuantSegment(
        lens=lens,
        pos=pos,
        key_bits=kb,
        value_bits=vb,
        group_size=g,
        head_dim=k.shape[-1],
        kcodes=kcodes,
        vcodes=vcodes,
        vzero=vzero,
        vstep=vstep,
        kzero=kzero,
        kstep=kstep,
        gcount=ragged.tell(torch.full((kzero.shape[0],), g, dtype=torch.int16, device=k.device), g),
        glens=ragged.groups_of(lens, g),
    )
