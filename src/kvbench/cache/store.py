"""Per-layer KV storage: segments of ragged per-head tokens, with exact byte accounting.

A layer's cache is a list of segments. The last one is always full precision (``FPSegment``):
new tokens land there. Representation compressors move tokens out of it into segments of their
own (packed integers, factors, ...), older first. Each token carries its original position and
any per-token state a technique keeps (``aux``: e.g. H2O's accumulated attention), which follow
the token through moves and evictions.

Byte accounting: ``nbytes()`` counts every tensor needed to rebuild the keys and values that
attention reads (data, scales, zero points, group counts, factors). Token positions and
technique state are bookkeeping, reported apart as ``aux_nbytes()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.cache import ragged


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Segment:
    """Ragged tokens of one representation. Subclasses add data fields with leading dim N.

    Attributes:
        lens: ``(BH,)`` tokens per head-row.
        pos: ``(N,)`` original position of each token.
        aux: per-token technique state, ``name -> (N,)`` float32.
    """

    lens: torch.Tensor
    pos: torch.Tensor
    aux: dict[str, torch.Tensor] = field(default_factory=dict)

    def data_fields(self) -> dict[str, torch.Tensor]:
        """Per-token stored tensors (leading dim N), counted in ``nbytes``."""
        raise NotImplementedError

    def set_data_fields(self, fields: dict[str, torch.Tensor]) -> None:
        for name, value in fields.items():
            setattr(self, name, value)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every token, flat ``(N, D)`` in ``dtype``."""
        raise NotImplementedError

    def nbytes(self) -> int:
        return _nbytes(*self.data_fields().values())

    def aux_nbytes(self) -> int:
        return _nbytes(self.pos, *self.aux.values())

    def keep(self, keep: torch.Tensor) -> None:
        """Keep the flat rows where ``keep`` ``(N,)`` is True; the rest are freed."""
        ids = ragged.segment_ids(self.lens)
        self.lens = torch.bincount(ids[keep], minlength=self.lens.numel())
        self.pos = self.pos[keep]
        self.aux = {k: v[keep] for k, v in self.aux.items()}
        self.set_data_fields({k: v[keep] for k, v in self.data_fields().items()})

    @property
    def size(self) -> int:
        return int(self.pos.shape[0])


@dataclass
class FPSegment(Segment):
    """Tokens at the model's precision. ``k``, ``v``: ``(N, D)``."""

    k: torch.Tensor = None  # type: ignore[assignment]
    v: torch.Tensor = None  # type: ignore[assignment]

    def data_fields(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v}

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.to(dtype), self.v.to(dtype)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append ``q`` new tokens to every head-row. ``k``, ``v``: ``(BH, q, D)``; ``pos``: ``(BH, q)``."""
        bh, q = pos.shape
        new_lens = torch.full((bh,), q, dtype=torch.long, device=pos.device)
        self.k = ragged.concat(self.k, self.lens, k.reshape(bh * q, -1), new_lens)
        self.v = ragged.concat(self.v, self.lens, v.reshape(bh * q, -1), new_lens)
        self.pos = ragged.concat(self.pos, self.lens, pos.reshape(-1), new_lens)
        self.aux = {
            name: ragged.concat(val, self.lens, val.new_zeros(bh * q), new_lens)
            for name, val in self.aux.items()
        }
        self.lens = self.lens + new_lens


@dataclass
class PaddedView:
    """A rectangle over all segments of a layer, for attention and scoring.

    Shapes use ``(B, H, T, D)``; ``valid`` marks real tokens, ``bounds`` the segment widths.
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    widths: list[int]


class LayerStore:
    """All cached tokens of one layer, for ``batch`` sequences and ``kv_heads`` heads."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        zeros = torch.zeros(batch * kv_heads, dtype=torch.long, device=device)
        empty = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.fp = FPSegment(lens=zeros, pos=torch.empty(0, dtype=torch.long, device=device), k=empty, v=empty)
        self.compressed: list[Segment] = []  # older tokens in other representations
        self.seen = 0  # tokens seen per sequence: the true position count
        self.protect_from: int | None = None  # positions >= this are never evicted (e.g. a question)
        self._view: PaddedView | None = None

    @property
    def segments(self) -> list[Segment]:
        return [*self.compressed, self.fp]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens. ``k``, ``v``: ``(B, H, q, D)``; positions continue from ``seen``."""
        b, h, q, d = k.shape
        pos = torch.arange(self.seen, self.seen + q, device=k.device).expand(b * h, q)
        self.fp.append(k.reshape(b * h, q, d), v.reshape(b * h, q, d), pos)
        self.seen += q
        self._view = None

    def view(self) -> PaddedView:
        """Padded keys, values and positions over every segment, oldest representation first."""
        if self._view is None:
            parts = [self._segment_view(s) for s in self.segments]
            shape = (self.batch, self.kv_heads, -1)
            k, v, pos, valid = (torch.cat([p[i] for p in parts], dim=1) for i in range(4))
            d = self.head_dim
            self._view = PaddedView(
                k=k.view(*shape, d),
                v=v.view(*shape, d),
                pos=pos.view(shape),
                valid=valid.view(shape),
                widths=[p[3].shape[1] for p in parts],
            )
        return self._view

    def _segment_view(self, seg: Segment) -> tuple[torch.Tensor, ...]:
        k, v = seg.read(self.dtype)
        pk, valid = ragged.to_padded(k, seg.lens)
        pv, _ = ragged.to_padded(v, seg.lens)
        ppos, _ = ragged.to_padded(seg.pos, seg.lens, fill=-1)
        return pk, pv, ppos, valid

    def _split(self, padded: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``(B, H, T)`` tensor aligned with ``view()`` into flat per-segment tensors."""
        view = self.view()
        flat = padded.reshape(self.batch * self.kv_heads, -1)
        valid = view.valid.reshape(self.batch * self.kv_heads, -1)
        out, start = [], 0
        for width in view.widths:
            out.append(ragged.from_padded(flat[:, start : start + width], valid[:, start : start + width]))
            start += width
        return out

    def keep(self, mask: torch.Tensor) -> None:
        """Evict every token where ``mask`` ``(B, H, T)`` (aligned with ``view()``) is False."""
        for seg, keep in zip(self.segments, self._split(mask)):
            if not bool(keep.all()):
                seg.keep(keep)
        self.compressed = [s for s in self.compressed if s.size > 0]
        self._view = None

    def aux(self, name: str) -> torch.Tensor:
        """Per-token state ``name`` laid out like ``view()``: ``(B, H, T)``, 0 where absent."""
        flats = []
        for seg in self.segments:
            if name not in seg.aux:
                seg.aux[name] = torch.zeros(seg.size, dtype=torch.float32, device=self.device)
            flats.append(ragged.to_padded(seg.aux[name], seg.lens)[0])
        return torch.cat(flats, dim=1).view(self.batch, self.kv_heads, -1)

    def add_aux(self, name: str, values: torch.Tensor) -> None:
        """Add ``values`` ``(B, H, T)`` (aligned with ``view()``) to per-token state ``name``."""
        self.aux(name)  # make sure every segment has the field
        for seg, add in zip(self.segments, self._split(values)):
            seg.aux[name] = seg.aux[name] + add.float()

    def invalidate(self) -> None:
        self._view = None

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.segments)

    def aux_nbytes(self) -> int:
        return sum(s.aux_nbytes() for s in self.segments)

    def stored_tokens(self) -> int:
        return sum(s.size for s in self.segments)
