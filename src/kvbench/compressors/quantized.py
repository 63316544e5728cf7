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
from kvbench.cache.store import LayerStore, Segment
from kvbench.errors import ConfigError
from kvbench.roles import Compressor, Flags


@dataclass
class QuantSegment(Segment):
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
    gcount: torch.Tensor = None  # type: ignore[assignment]
    glens: torch.Tensor = None  # type: ignore[assignment]

    def data_fields(self) -> dict[str, torch.Tensor]:
        return {"kcodes": self.kcodes, "vcodes": self.vcodes, "vzero": self.vzero, "vstep": self.vstep}

    def group_fields(self) -> dict[str, torch.Tensor]:
        return {"kzero": self.kzero, "kstep": self.kstep, "gcount": self.gcount}

    def nbytes(self) -> int:
        fields = [*self.data_fields().values(), *self.group_fields().values()]
        return sum(t.numel() * t.element_size() for t in fields)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        gid = torch.repeat_interleave(
            torch.arange(self.gcount.numel(), device=self.gcount.device), self.gcount.long()
        )
        k = quant.dequantize(
            quant.unpack(self.kcodes, self.key_bits), self.kzero[gid], self.kstep[gid], dtype
        )
        d, g = self.head_dim, self.group_size
        vz = self.vzero.repeat_interleave(g, dim=1)[:, :d]
        vs = self.vstep.repeat_interleave(g, dim=1)[:, :d]
        v = quant.dequantize(quant.unpack(self.vcodes, self.value_bits)[:, :d], vz, vs, dtype)
        return k, v

    def keep(self, keep: torch.Tensor) -> None:
        gid = torch.repeat_interleave(
            torch.arange(self.gcount.numel(), device=keep.device), self.gcount.long()
        )
        counts = torch.bincount(gid[keep], minlength=self.gcount.numel())
        live = counts > 0
        ghead = ragged.segment_ids(self.glens)
        self.glens = torch.bincount(ghead[live], minlength=self.glens.numel())
        self.kzero, self.kstep = self.kzero[live], self.kstep[live]
        self.gcount = counts[live].to(torch.int16)
        super().keep(keep)

    def extend(self, other: QuantSegment) -> None:
        """Append ``other``'s tokens and groups after this segment's, per head-row."""
        for name in [*self.data_fields(), "pos"]:
            setattr(
                self, name, ragged.concat(getattr(self, name), self.lens, getattr(other, name), other.lens)
            )
        self.aux = {k: ragged.concat(v, self.lens, other.aux[k], other.lens) for k, v in self.aux.items()}
        for name in self.group_fields():
            setattr(
                self, name, ragged.concat(getattr(self, name), self.glens, getattr(other, name), other.glens)
            )
        self.lens, self.glens = self.lens + other.lens, self.glens + other.glens


@dataclass
class QuantizedCompressor(Compressor):
    """KIVI with ``bits`` (or separate ``key_bits``/``value_bits``) in {2, 4, 8}."""

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
        move = self._leaving_window(store)
        if not bool(move.any()):
            return
        fp = store.fp
        seg = self._quantize(
            fp.k[move],
            fp.v[move],
            fp.pos[move],
            torch.bincount(ragged.segment_ids(fp.lens)[move], minlength=fp.lens.numel()),
        )
        seg.aux = {k: v[move] for k, v in fp.aux.items()}
        fp.keep(~move)
        old = [s for s in store.compressed if isinstance(s, QuantSegment)]
        if old:
            old[0].extend(seg)
        else:
            store.compressed.append(seg)
        store.invalidate()

    def _leaving_window(self, store: LayerStore) -> torch.Tensor:
        """Flat mask over the fp segment: the oldest whole groups of unprotected tokens per head-row."""
        fp = store.fp
        eligible = ~self.budget_cfg.protected(fp.pos, store.seen, store.protect_from)
        padded, valid = ragged.to_padded(eligible, fp.lens, fill=False)
        rank = padded.long().cumsum(-1)
        whole = (padded.sum(-1) // self.group_size) * self.group_size
        move = padded & (rank <= whole[:, None])
        return ragged.from_padded(move, valid)

    def _quantize(
        self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor
    ) -> QuantSegment:
        g, d = self.group_size, k.shape[-1]
        kb, vb = int(self.key_bits or self.bits), int(self.value_bits or self.bits)
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
