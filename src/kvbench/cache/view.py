"""What attention and the techniques read of a layer's store: every segment's rows side by side,
oldest representation first (:class:`PaddedView`, built by :func:`padded_view` for
:meth:`kvbench.cache.store.LayerStore.view`).

With one segment the view is that segment's rows, a free slice. With several, their positions,
valid slots and merged units' biases are joined (:class:`JoinedRows`), kept between steps and
rewritten only from the first column that changed; their keys and values are decoded when first
read and dropped by :meth:`PaddedView.release`, so no second copy of the cache outlives a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.cache.segments import FPSegment


@dataclass
class PaddedView:
    """A rectangle over all segments of a layer, for attention and scoring.

    Shapes use ``(B, H, T, D)``; ``valid`` marks real tokens, ``widths`` the segment widths;
    ``bias`` ``(B, H, T)`` is an additive logit per unit (merged tokens), or None; ``dense`` is
    True when every slot is a real token (``valid`` all True). ``k`` and ``v`` come from
    ``decode()`` when first read (``(B * H, T, D)`` each: the rows' own with one segment, a decoded
    copy with several) and are kept until :meth:`release`. A view shows the store as it was when
    read, until the store next changes (several segments' joined positions are then updated in
    place).
    """

    pos: torch.Tensor
    valid: torch.Tensor
    widths: list[int]
    decode: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    bias: torch.Tensor | None = None
    dense: bool = False
    kv: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def k(self) -> torch.Tensor:
        return self._kv()[0]

    @property
    def v(self) -> torch.Tensor:
        return self._kv()[1]

    def _kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv is None:
            b, h, t = self.pos.shape
            k, v = self.decode()
            self.kv = k.view(b, h, t, k.shape[-1]), v.view(b, h, t, v.shape[-1])
        return self.kv

    def release(self) -> None:
        """Forget the keys and values read (decoded again when next read)."""
        self.kv = None


VIEWED = ("pos", "bias")  # the rows' fields a view joins (``bias``: merged units only)


class JoinedRows:
    """The positions, valid slots and biases of several segments side by side, ``(B * H,
    capacity)`` per field, as :meth:`LayerStore.view` shows them.

    Kept between steps and updated from the first column that changed (:meth:`Rows.changes`): a
    decode step appends a token to the full-precision rows and a compressor moves the oldest ones
    into its segment, the newest compressed one, so only the columns from that segment's old end
    are rewritten, not every stored token. A change of the segments themselves (one added or
    emptied) rewrites everything, once.
    """

    def __init__(self) -> None:
        self.segs: list[Any] = []
        self.widths: list[int] = []
        self.fields: dict[str, torch.Tensor] = {}
        self.capacity = 0

    @staticmethod
    def _part(seg: Any, name: str) -> torch.Tensor:
        rows = seg.rows
        if name == "valid":
            return rows.valid()
        if name == "bias" and "bias" not in rows:  # tokens of a segment without one add nothing
            return torch.zeros(rows.bh, rows.width, dtype=torch.float32, device=rows.device)
        return rows.get(name)

    def update(self, segs: list[Any]) -> dict[str, torch.Tensor]:
        """Bring the joined rows up to date with ``segs``; returns each field's ``(B * H, T)`` rectangle.

        Under inference mode, as the store's own updates: a view read outside it (a test, a probe)
        may rewrite joined rows that a forward created."""
        with torch.inference_mode():
            return self._update(segs)

    def _update(self, segs: list[Any]) -> dict[str, torch.Tensor]:
        changed = [seg.rows.changes() for seg in segs]
        names = [n for n in VIEWED if n != "bias" or any("bias" in seg.rows for seg in segs)] + ["valid"]
        same = (
            len(segs) == len(self.segs)
            and all(a is b for a, b in zip(segs, self.segs))
            and list(self.fields) == names
        )
        first, start = (sum(self.widths) if same else 0), 0
        if same:
            for change, width in zip(changed, self.widths):
                if change is not None:
                    first = min(first, start + change)
                start += width
        widths = [seg.rows.width for seg in segs]
        total = sum(widths)
        if total > self.capacity or not same:
            cap = total + max(64, total // 4)
            fields = {}
            for name in names:
                part = self._part(segs[0], name)
                fields[name] = part.new_zeros(part.shape[0], cap, *part.shape[2:])
                if same:
                    fields[name][:, :first] = self.fields[name][:, :first]
            self.fields, self.capacity = fields, cap
        start = 0
        for seg, width in zip(segs, widths):
            lo = max(first, start)
            if lo < start + width:
                for name, field in self.fields.items():
                    field[:, lo : start + width] = self._part(seg, name)[:, lo - start :]
            start += width
        self.segs, self.widths = list(segs), widths
        return {name: field[:, :total] for name, field in self.fields.items()}


def decode_rows(segs: list[Any], lo: int, hi: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of head-rows ``lo .. hi - 1`` of ``segs`` side by side, ``(hi - lo, T, D)`` in
    ``dtype``: the full-precision rows as stored, every representation decoded now through
    :meth:`Segment.head_rows` and placed in its rows' slots."""
    keys, values = [], []
    for seg in segs:
        rows = seg.rows
        if isinstance(seg, FPSegment):  # its rows are the stored data
            k, v = rows.get("k")[lo:hi], rows.get("v")[lo:hi]
        else:
            k, v = (_laid_out(x, rows, lo, hi) for x in seg.head_rows(lo, hi).read(dtype))
        keys.append(k)
        values.append(v)
    if len(keys) == 1:
        return keys[0], values[0]
    return torch.cat(keys, dim=1), torch.cat(values, dim=1)


def _laid_out(flat: torch.Tensor, rows: Any, lo: int, hi: int) -> torch.Tensor:
    """Flat head-major tokens of rows ``lo .. hi - 1`` in their slots ``(hi - lo, width, ...)``."""
    if rows.uniform:
        return flat.view(hi - lo, rows.width, *flat.shape[1:])
    out = flat.new_zeros(hi - lo, rows.width, *flat.shape[1:])
    out[rows.valid()[lo:hi]] = flat
    return out


def padded_view(
    segs: list[Any],
    joined: JoinedRows | None,
    batch: int,
    kv_heads: int,
    decode: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[PaddedView, JoinedRows | None]:
    """The view of ``segs`` (each with its ``rows``) whose keys and values ``decode()`` gives, and
    the joined rows to keep for the next one (None with one segment, whose rows are the view)."""
    if len(segs) == 1:
        rows = segs[0].rows
        fields = {name: rows.get(name) for name in VIEWED if name in rows}
        fields["valid"] = rows.valid()
        joined = None
    else:
        joined = joined or JoinedRows()
        fields = joined.update(segs)
    shape = (batch, kv_heads, -1)
    bias = fields.get("bias")
    view = PaddedView(
        pos=fields["pos"].view(shape),
        valid=fields["valid"].view(shape),
        widths=[s.rows.width for s in segs],
        decode=decode,
        bias=None if bias is None else bias.view(shape),
        dense=all(s.rows.uniform for s in segs),
    )
    return view, joined
