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
from functools import partial
from typing import Any, cast

import torch

from kvbench.cache.rows import inference, with_room
from kvbench.cache.segments import KV, FPSegment


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
        self.all_valid = False  # ``valid`` holds True in every slot (every segment's rows full)

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
        with inference():
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
        # Every segment's rows full: every slot is valid, so ``valid`` is all True and is not
        # rewritten (made of ones, or filled once when the rows were not all full before)
        full = all(seg.rows.uniform for seg in segs)
        if total > self.capacity or not same:
            cap = with_room(total)
            fields = {}
            for name in names:
                part = self._part(segs[0], name)
                make = part.new_ones if full and name == "valid" else part.new_zeros
                fields[name] = make(part.shape[0], cap, *part.shape[2:])
                if same and not (full and name == "valid"):
                    fields[name][:, :first] = self.fields[name][:, :first]
            self.fields, self.capacity, self.all_valid = fields, cap, full
        elif full and not self.all_valid:
            self.fields["valid"].fill_(True)
            self.all_valid = True
        if not full:
            self.all_valid = False
        start = 0
        for seg, width in zip(segs, widths):
            lo = max(first, start)
            if lo < start + width:
                for name, field in self.fields.items():
                    part = self._part(seg, name)  # full rows' valid: a slice of their ones, no launch
                    if not (full and name == "valid"):
                        field[:, lo : start + width] = part[:, lo - start :]
            start += width
        self.segs, self.widths = list(segs), widths
        return {name: field[:, :total] for name, field in self.fields.items()}


def decode_rows(segs: list[Any], lo: int, hi: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of head-rows ``lo .. hi - 1`` of ``segs`` side by side, ``(hi - lo, T, D)`` in
    ``dtype``: the full-precision rows as stored, every representation decoded now through
    :meth:`Segment.head_rows` and placed in its rows' slots.

    A field (keys, values) that a representation decodes straight into its slots
    (:meth:`Segment.writes_into`) goes into one buffer (both fields' in one allocation), each
    segment's part written there once: no decoded copy of the part and no concatenation; the
    full-precision rows' keys and values are copied in by one ``stack``. Another field is joined by
    one ``cat``."""
    if len(segs) == 1 and isinstance(segs[0], FPSegment):  # its rows are the stored data
        rows = segs[0].rows
        return rows.get("k")[lo:hi], rows.get("v")[lo:hi]
    parts = [None if isinstance(seg, FPSegment) else seg.head_rows(lo, hi) for seg in segs]
    sized = "k" in segs[-1].rows  # the full-precision rows name the head size of a buffer
    into = [
        part.writes_into() if sized and part is not None and seg.rows.uniform else (False, False)
        for seg, part in zip(segs, parts)
    ]
    if sized and all(part is None or (w == (True, True) and not part.ZEROED) for part, w in zip(parts, into)):
        return _decoded_in_one(segs, parts, lo, hi, dtype)
    zeroed = any(part is not None and any(w) and part.ZEROED for part, w in zip(parts, into))
    block, bufs = _buffers(segs, hi - lo, dtype, [any(w[i] for w in into) for i in range(len(KV))], zeroed)
    pieces: list[list[torch.Tensor]] = [[] for _ in KV]  # a field's parts to join, without a buffer
    start = 0
    for seg, part, writes in zip(segs, parts, into):
        rows, end = seg.rows, start + seg.rows.width
        dest = [None if b is None else b[:, start:end] for b in bufs]
        if part is None:  # the full-precision rows, laid out as stored: both fields copied at once
            kv = [rows.get(name)[lo:hi] for name in KV]
            if block is not None and len(block) == len(KV):
                torch.stack(kv, out=block[:, :, start:end])
                kv = dest
        else:
            kv = list(part.read_into(*(d if w else None for d, w in zip(dest, writes)), dtype))
            kv = [x if x is d else _laid_out(x, rows, lo, hi, d) for x, d in zip(kv, dest)]
        for x, d, piece in zip(kv, dest, pieces):
            if d is None:
                piece.append(x)
            elif x is not d:
                d.copy_(x)
        start = end
    keys, values = (
        b if b is not None else p[0] if len(p) == 1 else torch.cat(p, dim=1) for b, p in zip(bufs, pieces)
    )
    return keys, values


def whole_decoder(
    segs: list[Any], dtype: torch.dtype, head_dim: int
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
    """:func:`decode_rows` of every head-row of ``segs`` (compressed segments, then the
    full-precision rows) as a function, made once for the compressed segments' present tokens
    (valid until the store's next edit: :meth:`kvbench.cache.store.LayerStore.whole_decoder`), where
    each compressed segment holds the same number of tokens in every head-row and carries no bias;
    else None. Each call decodes as :func:`decode_rows` does, without asking each segment again how
    it decodes:

    - where every segment gives a decoder into slots (:meth:`Segment.slots_decoder`), as
      :func:`_decoded_in_one`: one buffer, the full-precision rows copied in by one ``stack``, each
      part decoded into its slots;
    - where none writes into slots (:meth:`Segment.writes_into`), each segment's decoded keys and
      values (through its :meth:`Segment.reader` where it gives one) and the full-precision rows'
      are joined by one ``cat`` per field.

    ``head_dim``: the keys' and values' (the full-precision rows' last dimension, named here
    without reading their fields, which would write their pending positions: :attr:`Rows.fields`)."""
    *parts, fp = segs
    if not parts or not isinstance(fp, FPSegment) or "k" not in fp.rows:
        return None
    decoders, reads = [], []
    start = 0
    for seg in parts:
        rows = seg.rows
        if not rows.uniform or "bias" in rows:
            return None
        decode = seg.slots_decoder(dtype)
        if decode is not None:
            decoders.append((start, start + rows.width, decode))
        elif seg.writes_into() == (False, False):
            reads.append((rows.width, seg.reader(dtype) or partial(seg.read_into, None, None, dtype)))
        else:
            return None
        start += rows.width
    if decoders and reads:
        return None
    fp_rows = fp.rows
    bh = fp_rows.bh

    def decoded() -> tuple[torch.Tensor, torch.Tensor]:
        block = torch.empty(2, bh, start + fp_rows.width, head_dim, dtype=dtype, device=fp_rows.device)
        keys, values = block.unbind(0)
        torch.stack((fp_rows.get("k"), fp_rows.get("v")), out=block[:, :, start:])
        for a, b, decode in decoders:
            decode(keys[:, a:b], values[:, a:b])
        return keys, values

    def joined() -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = [], []
        for width, read in reads:  # (flat tokens, or per head-row already)
            k, v = read()
            keys.append(k if k.dim() == 3 else k.view(bh, width, -1))
            values.append(v if v.dim() == 3 else v.view(bh, width, -1))
        keys.append(fp_rows.get("k"))
        values.append(fp_rows.get("v"))
        return torch.cat(keys, 1), torch.cat(values, 1)

    return joined if reads else decoded


def _decoded_in_one(
    segs: list[Any], parts: list[Any], lo: int, hi: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_rows` where every representation decodes both fields straight into slots of
    uninitialized memory (a quantized cache on the torch path whose head-rows each hold the same
    number of tokens, as every decode step of one sequence does): one buffer
    ``(2, hi - lo, T, D)``, the full-precision rows copied in by one ``stack``, each part decoded
    into its slots, without the general case's bookkeeping."""
    held, bufs = _buffers(segs, hi - lo, dtype, [True, True], False)
    block, keys, values = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], (held, *bufs))  # all wanted
    start = 0
    for seg, part in zip(segs, parts):
        rows = seg.rows
        end = start + rows.width
        if part is None:
            torch.stack((rows.get("k")[lo:hi], rows.get("v")[lo:hi]), out=block[:, :, start:end])
        else:
            dest = keys[:, start:end], values[:, start:end]
            for x, d in zip(part.read_into(*dest, dtype), dest):
                if x is not d:
                    _laid_out(x, rows, lo, hi, d)
        start = end
    return keys, values


def _buffers(
    segs: list[Any], n: int, dtype: torch.dtype, wanted: list[bool], zeroed: bool
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """One block of ``(n, T, D)`` rectangles, one per ``wanted`` field, for the slots of ``n``
    head-rows of every segment (``D``: the full-precision rows' head size), which each segment's
    part fills: uninitialized, or zeros (``zeroed``: for a part that writes some channels only,
    :attr:`Segment.ZEROED`); and each field's rectangle (None where not wanted)."""
    if not any(wanted):
        return None, [None] * len(wanted)
    fp = segs[-1].rows
    width = sum(seg.rows.width for seg in segs)
    make = torch.zeros if zeroed else torch.empty
    block = make(sum(wanted), n, width, fp.get("k").shape[-1], dtype=dtype, device=fp.device)
    rects = iter(block.unbind(0))  # (a tensor's own iterator is Python around the same unbind)
    return block, [next(rects) if w else None for w in wanted]


def _laid_out(
    flat: torch.Tensor, rows: Any, lo: int, hi: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Flat head-major tokens ``(N, D)`` of rows ``lo .. hi - 1`` in their slots ``(hi - lo, width,
    D)`` (tokens given per head-row already, ``(hi - lo, width, D)``, stay as they are), into ``out``
    when given (then ``out``, or a view to join when not)."""
    if rows.uniform:
        x = flat if flat.dim() == 3 else flat.view(hi - lo, rows.width, *flat.shape[1:])
        return x if out is None else out.copy_(x)
    out = flat.new_zeros(hi - lo, rows.width, *flat.shape[1:]) if out is None else out.zero_()
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
