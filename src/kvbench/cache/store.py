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
        aux: per-token technique state, ``name -> (N, *rest)`` float32.
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

    def bias(self) -> torch.Tensor | None:
        """Additive attention logit per token ``(N,)`` (merged tokens carry log(count)), or None."""
        return None

    def members(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For merged units: (member positions ``(M,)``, owning flat row ``(M,)``); None if 1:1."""
        return None

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
            name: ragged.concat(val, self.lens, val.new_zeros(bh * q, *val.shape[1:]), new_lens)
            for name, val in self.aux.items()
        }
        self.lens = self.lens + new_lens

    def append_ragged(
        self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, new_lens: torch.Tensor
    ) -> None:
        """Append flat head-major tokens (``new_lens`` per head-row), e.g. a padded batch's real ones."""
        self.k = ragged.concat(self.k, self.lens, k, new_lens)
        self.v = ragged.concat(self.v, self.lens, v, new_lens)
        self.pos = ragged.concat(self.pos, self.lens, pos, new_lens)
        n = int(new_lens.sum())
        self.aux = {
            name: ragged.concat(val, self.lens, val.new_zeros(n, *val.shape[1:]), new_lens)
            for name, val in self.aux.items()
        }
        self.lens = self.lens + new_lens


@dataclass
class GroupedSegment(Segment):
    """Tokens stored in groups that share parameters (quantization scales, low-rank factors).

    Per-token fields come from ``data_fields``; per-group fields (leading dim M) from
    ``group_fields``; ``gcount`` ``(M,)`` counts live tokens per group (tokens are stored group
    after group within a head-row) and ``glens`` ``(BH,)`` groups per head-row. A group's
    parameters are freed with its last token.
    """

    gcount: torch.Tensor = None  # type: ignore[assignment]
    glens: torch.Tensor = None  # type: ignore[assignment]

    def group_fields(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def nbytes(self) -> int:
        return _nbytes(*self.data_fields().values(), *self.group_fields().values(), self.gcount)

    def group_ids(self) -> torch.Tensor:
        """Group of every flat token ``(N,)``."""
        return torch.repeat_interleave(
            torch.arange(self.gcount.numel(), device=self.gcount.device), self.gcount.long()
        )

    def keep(self, keep: torch.Tensor) -> None:
        counts = torch.bincount(self.group_ids()[keep], minlength=self.gcount.numel())
        live = counts > 0
        ghead = ragged.segment_ids(self.glens)
        self.glens = torch.bincount(ghead[live], minlength=self.glens.numel())
        for name, value in self.group_fields().items():
            setattr(self, name, value[live])
        self.gcount = counts[live].to(self.gcount.dtype)
        super().keep(keep)

    def extend(self, other: GroupedSegment) -> None:
        """Append ``other``'s tokens and groups after this segment's, per head-row."""
        for name in [*self.data_fields(), "pos"]:
            setattr(
                self, name, ragged.concat(getattr(self, name), self.lens, getattr(other, name), other.lens)
            )
        self.aux = {k: ragged.concat(v, self.lens, other.aux[k], other.lens) for k, v in self.aux.items()}
        for name in [*self.group_fields(), "gcount"]:
            setattr(
                self, name, ragged.concat(getattr(self, name), self.glens, getattr(other, name), other.glens)
            )
        self.lens, self.glens = self.lens + other.lens, self.glens + other.glens


@dataclass
class PaddedView:
    """A rectangle over all segments of a layer, for attention and scoring.

    Shapes use ``(B, H, T, D)``; ``valid`` marks real tokens, ``widths`` the segment widths;
    ``bias`` ``(B, H, T)`` is an additive logit per unit (merged tokens), or None.
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    widths: list[int]
    bias: torch.Tensor | None = None


class LayerStore:
    """All cached tokens of one layer, for ``batch`` sequences and ``kv_heads`` heads.

    ``seen`` ``(B,)`` counts the real tokens each sequence has fed (its next position): in a padded
    batch, sequences advance at their own pace and padding is never stored. ``side`` holds
    technique metadata that attention needs (page bounds, centroids, bases, replicas); it is
    counted in :meth:`nbytes`.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        zeros = torch.zeros(batch * kv_heads, dtype=torch.long, device=device)
        empty = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.fp = FPSegment(lens=zeros, pos=torch.empty(0, dtype=torch.long, device=device), k=empty, v=empty)
        self.compressed: list[Segment] = []  # older tokens in other representations
        self.seen = torch.zeros(batch, dtype=torch.long, device=device)
        self.protect_from: torch.Tensor | None = None  # (B,): positions >= this are never evicted
        self.side: dict[str, torch.Tensor] = {}
        self.last_qpos = torch.empty(batch, 0, dtype=torch.long, device=device)  # (B, q) of the last append
        self._view: PaddedView | None = None

    @property
    def segments(self) -> list[Segment]:
        return [*self.compressed, self.fp]

    @property
    def seen_max(self) -> int:
        return int(self.seen.max()) if self.batch else 0

    def set_protect_from(self, start: int | torch.Tensor | None) -> None:
        """Positions at or after ``start`` (one per sequence, or one for all) are never evicted."""
        if start is None:
            self.protect_from = None
        else:
            self.protect_from = torch.as_tensor(start, device=self.device).expand(self.batch).clone()

    def append(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """Store new tokens. ``k``, ``v``: ``(B, H, q, D)``; ``real`` ``(B, q)`` marks non-padding.

        Positions continue from each sequence's ``seen``; padding is dropped, never stored.
        """
        b, h, q, d = k.shape
        if real is None:
            qpos = self.seen[:, None] + torch.arange(q, device=k.device)
            self.last_qpos = qpos
            self.fp.append(k.reshape(b * h, q, d), v.reshape(b * h, q, d), qpos.repeat_interleave(h, dim=0))
            self.seen = self.seen + q
        else:
            real = real.to(k.device)
            pos = self.seen[:, None] + real.long().cumsum(-1) - 1  # (B, q)
            self.last_qpos = torch.where(real, pos, torch.full_like(pos, -1))
            rows = real[:, None, :].expand(b, h, q).reshape(b * h, q)
            new_lens = rows.sum(-1)
            pos_rows = pos[:, None, :].expand(b, h, q).reshape(b * h, q)
            self.fp.append_ragged(
                k.reshape(b * h, q, d)[rows], v.reshape(b * h, q, d)[rows], pos_rows[rows], new_lens
            )
            self.seen = self.seen + real.sum(-1)
        self._view = None

    def view(self) -> PaddedView:
        """Padded keys, values and positions over every segment, oldest representation first."""
        if self._view is None:
            parts = [self._segment_view(s) for s in self.segments]
            shape = (self.batch, self.kv_heads, -1)
            k, v, pos, valid = (torch.cat([p[i] for p in parts], dim=1) for i in range(4))
            biases = [s.bias() for s in self.segments]
            bias = None
            if any(x is not None for x in biases):
                bias = torch.cat(
                    [
                        ragged.to_padded(
                            x if x is not None else s.pos.new_zeros(s.size, dtype=torch.float32), s.lens
                        )[0]
                        for s, x in zip(self.segments, biases)
                    ],
                    dim=1,
                ).view(shape)
            d = self.head_dim
            self._view = PaddedView(
                k=k.view(*shape, d),
                v=v.view(*shape, d),
                pos=pos.view(shape),
                valid=valid.view(shape),
                widths=[p[3].shape[1] for p in parts],
                bias=bias,
            )
        return self._view

    def _segment_view(self, seg: Segment) -> tuple[torch.Tensor, ...]:
        k, v = seg.read(self.dtype)
        pk, valid = ragged.to_padded(k, seg.lens)
        pv, _ = ragged.to_padded(v, seg.lens)
        ppos, _ = ragged.to_padded(seg.pos, seg.lens, fill=-1)
        return pk, pv, ppos, valid

    def units(self, positions: int) -> torch.Tensor:
        """Column of ``view()`` holding each original position ``(B, H, positions)``; -1 if not stored.

        A merged unit owns every position it absorbed.
        """
        view = self.view()
        bh = self.batch * self.kv_heads
        out = torch.full((bh, positions), -1, dtype=torch.long, device=self.device)
        start = 0
        for seg, width in zip(self.segments, view.widths):
            if seg.size:
                rows = ragged.segment_ids(seg.lens)
                col = start + torch.arange(seg.size, device=self.device) - ragged.starts(seg.lens)[rows]
                members = seg.members()
                if members is None:
                    out[rows, seg.pos] = col
                else:
                    mpos, owner = members
                    out[rows[owner], mpos] = col[owner]
            start += width
        return out.view(self.batch, self.kv_heads, positions)

    def _split(self, padded: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``(B, H, T, ...)`` tensor aligned with ``view()`` into flat per-segment tensors."""
        view = self.view()
        flat = padded.reshape(self.batch * self.kv_heads, padded.shape[2], *padded.shape[3:])
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

    def aux(self, name: str, *shape: int) -> torch.Tensor:
        """Per-token state ``name`` laid out like ``view()``: ``(B, H, T, *shape)``, 0 where absent."""
        flats = []
        for seg in self.segments:
            if name not in seg.aux:
                seg.aux[name] = torch.zeros(seg.size, *shape, dtype=torch.float32, device=self.device)
            flats.append(ragged.to_padded(seg.aux[name], seg.lens)[0])
        return torch.cat(flats, dim=1).view(self.batch, self.kv_heads, -1, *flats[0].shape[2:])

    def add_aux(self, name: str, values: torch.Tensor) -> None:
        """Add ``values`` ``(B, H, T, ...)`` (aligned with ``view()``) to per-token state ``name``."""
        self.aux(name, *values.shape[3:])  # make sure every segment has the field
        for seg, add in zip(self.segments, self._split(values)):
            seg.aux[name] = seg.aux[name] + add.float()

    def set_aux(self, name: str, values: torch.Tensor) -> None:
        """Replace per-token state ``name`` with ``values`` ``(B, H, T, ...)`` aligned with ``view()``."""
        for seg, new in zip(self.segments, self._split(values)):
            seg.aux[name] = new.float().contiguous()

    def row_seen(self) -> torch.Tensor:
        """``seen`` of each head-row ``(B * H,)``."""
        return self.seen.repeat_interleave(self.kv_heads)

    def flat_seen(self, seg: Segment) -> torch.Tensor:
        """``seen`` of the sequence of every flat token of ``seg`` ``(N,)``."""
        return self.row_seen()[ragged.segment_ids(seg.lens)]

    def flat_protect_from(self, seg: Segment) -> torch.Tensor | None:
        if self.protect_from is None:
            return None
        return self.protect_from.repeat_interleave(self.kv_heads)[ragged.segment_ids(seg.lens)]

    def view_seen(self) -> torch.Tensor:
        """``seen`` broadcastable against ``(B, H, T)``: ``(B, 1, 1)``."""
        return self.seen[:, None, None]

    def view_protect_from(self) -> torch.Tensor | None:
        return None if self.protect_from is None else self.protect_from[:, None, None]

    def invalidate(self) -> None:
        self._view = None

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.segments) + _nbytes(*self.side.values())

    def aux_nbytes(self) -> int:
        return sum(s.aux_nbytes() for s in self.segments)

    def stored_tokens(self) -> int:
        return sum(s.size for s in self.segments)

    def row_tokens(self) -> torch.Tensor:
        """Stored tokens per head-row ``(B * H,)``."""
        return sum((s.lens for s in self.segments), torch.zeros_like(self.fp.lens))
