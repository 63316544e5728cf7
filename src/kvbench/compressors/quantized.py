"""KIVI: keys quantized per channel, values per token, real packed storage (arXiv:2402.02750).

Tokens leave the full-precision window in groups of ``group_size`` per KV head. Keys of a group
share one (zero, step) per channel; each value token has one (zero, step) per ``group_size``
channels (the last channel group may be shorter, e.g. head_dim 80). Sinks and the window stay at
full precision. Evicting a quantized token frees its codes; a key group's parameters are freed
with its last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.cache import quant, ragged
from kvbench.cache.store import GroupedSegment, LayerStore
from kvbench.errors import ConfigError
from kvbench.roles import Budget, Compressor, Flags


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

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        gid = self.group_ids()
        k = quant.dequantize(
            quant.unpack(self.kcodes, self.key_bits), self.kzero[gid], self.kstep[gid], dtype
        )
        d, g = self.head_dim, self.group_size
        vz = self.vzero.repeat_interleave(g, dim=1)[:, :d]
        vs = self.vstep.repeat_interleave(g, dim=1)[:, :d]
        v = quant.dequantize(quant.unpack(self.vcodes, self.value_bits)[:, :d], vz, vs, dtype)
        return k, v


@dataclass
class QuantizedCompressor(Compressor):
    """KIVI with ``bits`` (or separate ``key_bits``/``value_bits``) in {2, 3, 4, 8}."""

    name: str = "quantized"
    bits: int = 2
    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int = 32
    flags = Flags(changes_representation=True)

    def __post_init__(self) -> None:
        self.key_bits = self.bits if self.key_bits is None else self.key_bits
        self.value_bits = self.bits if self.value_bits is None else self.value_bits
        for key in ("bits", "key_bits", "value_bits"):
            if getattr(self, key) not in quant.SUPPORTED_BITS:
                allowed = ", ".join(map(str, quant.SUPPORTED_BITS))
                raise ConfigError(f"compressor.{key}={getattr(self, key)}: allowed {allowed}")
        if self.group_size < 1:
            raise ConfigError(f"compressor.group_size={self.group_size}: must be >= 1")

    def compress(self, layer: int, store: LayerStore) -> None:
        self.move(
            store, leaving_window(store, self.budget_cfg, self.group_size), self.key_bits, self.value_bits
        )

    def move(self, store: LayerStore, move: torch.Tensor, key_bits, value_bits) -> None:
        """Quantize the fp tokens under the flat mask ``move`` into the segment of these bit widths."""
        if not bool(move.any()):
            return
        fp = store.fp
        seg = self._quantize(
            fp.k[move],
            fp.v[move],
            fp.pos[move],
            torch.bincount(ragged.segment_ids(fp.lens)[move], minlength=fp.lens.numel()),
            int(key_bits),
            int(value_bits),
        )
        seg.aux = {k: v[move] for k, v in fp.aux.items()}
        fp.keep(~move)
        old = [
            s
            for s in store.compressed
            if isinstance(s, QuantSegment) and (s.key_bits, s.value_bits) == (seg.key_bits, seg.value_bits)
        ]
        if old:
            old[0].extend(seg)
        else:
            store.compressed.append(seg)
        store.invalidate()

    def _quantize(
        self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, kb: int, vb: int
    ) -> QuantSegment:
        return quantize_tokens(k, v, pos, lens, kb, vb, self.group_size)


def leaving_window(
    store: LayerStore, budget: Budget, group_size: int, eligible: torch.Tensor | None = None
) -> torch.Tensor:
    """Flat mask over the fp segment: the oldest whole groups of unprotected tokens per head-row.

    ``eligible`` (flat, over the fp segment) restricts the candidates further.
    """
    fp = store.fp
    ok = ~budget.protected_flat(store, fp)
    if eligible is not None:
        ok = ok & eligible
    padded, valid = ragged.to_padded(ok, fp.lens, fill=False)
    rank = padded.long().cumsum(-1)
    whole = (padded.sum(-1) // group_size) * group_size
    move = padded & (rank <= whole[:, None])
    return ragged.from_padded(move, valid)


def quantize_tokens(
    k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, kb: int, vb: int, g: int
) -> QuantSegment:
    """KIVI quantization of whole groups of ``g`` tokens per head-row (``lens`` multiples of ``g``)."""
    d = k.shape[-1]
    kc, kz, ks = quant.quantize(k.view(-1, g, d), kb, dim=1)  # per channel over G tokens
    ngv = -(-d // g)
    vpad = F.pad(v.float(), (0, ngv * g - d), mode="replicate") if ngv * g != d else v.float()
    vc, vz, vs = quant.quantize(vpad.view(-1, ngv, g), vb, dim=2)  # per token, G channels
    vc = vc.view(-1, ngv * g)[:, :d]
    return QuantSegment(
        lens=lens,
        pos=pos,
        key_bits=kb,
        value_bits=vb,
        group_size=g,
        head_dim=d,
        kcodes=quant.pack(kc.view(-1, d), kb),
        vcodes=quant.pack(vc.contiguous(), vb),
        vzero=vz.view(-1, ngv),
        vstep=vs.view(-1, ngv),
        kzero=kz.view(-1, d),
        kstep=ks.view(-1, d),
        gcount=torch.full((kz.shape[0],), g, dtype=torch.int16, device=k.device),
        glens=lens // g,
    )
