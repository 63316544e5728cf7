"""Segments: the tokens of one representation within a layer's store.

:class:`FPSegment` holds the full-precision tokens: its rows (:class:`kvbench.cache.rows.Rows`)
are the stored data. A compressed :class:`Segment` stores its encoded form flat and head-major
(``lens`` tokens per head-row: packed codes, factors, merged units; subclasses define
``data_fields`` and decode flat tokens in ``read``); its rows hold only positions and technique
state. Nothing decoded is kept: attention decodes a block of head-rows at a time
(:meth:`Segment.head_rows`, :meth:`kvbench.cache.store.LayerStore.decoded`).
:class:`GroupedSegment` adds parameters shared by groups of tokens (quantization scales, block
factors), freed with a group's last token.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.cache import partials, ragged
from kvbench.cache.rows import Rows, inference, with_room
from kvbench.kernels import dispatch

KV = ("k", "v")  # the full-precision rows' stored keys and values
NOT_STATE = ("k", "v", "bias")  # rows fields that are not per-token bookkeeping


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def flat_rows(seg: Segment | FPSegment) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-row and original position of every token of ``seg``, flat and head-major."""
    valid = seg.rows.valid()
    return valid.nonzero(as_tuple=True)[0], seg.rows.get("pos")[valid]


@dataclass
class Segment:
    """Tokens of one compressed representation, stored flat and head-major.

    Subclasses add data fields with leading dim N and implement :meth:`read` for flat tokens.

    Attributes:
        lens: ``(BH,)`` tokens per head-row.
        pos: ``(N,)`` original position of each token (used by decoders that need it).
        rows: the per-head-row table (positions, technique state, merged units' logit bias),
            filled by the store when the segment joins it.
    """

    lens: torch.Tensor
    pos: torch.Tensor
    rows: Rows = dataclasses.field(default=None, repr=False)  # type: ignore[assignment]

    def data_fields(self) -> dict[str, torch.Tensor]:
        """Per-token stored tensors (leading dim N), counted in ``nbytes``."""
        raise NotImplementedError

    def set_data_fields(self, fields: dict[str, torch.Tensor]) -> None:
        for name, value in fields.items():
            setattr(self, name, value)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every token, flat ``(N, D)`` in ``dtype``."""
        raise NotImplementedError

    ZEROED = False  # whether read_into's slots must hold zeros (it writes some of their channels)
    # Whether its tokens lie in position order along each head-row, after the segments before it:
    # built from the oldest full-precision tokens of rows in position order (``move_out``), grown
    # by newer ones, compacted in order. A merge's units (distillation) are not.
    IN_MOVE_ORDER = True

    def writes_into(self) -> tuple[bool, bool]:
        """Whether :meth:`read_into` decodes the keys, the values straight into slots it is given,
        without a decoded copy of its own (a decoded layer is then one buffer, not a concatenation
        of decoded parts: :func:`kvbench.cache.view.decode_rows`)."""
        return False, False

    def slots_decoder(self, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """:meth:`read_into` of both fields into slots ``(BH, width, D)`` of ``dtype`` (every head-row
        full) as a function of the slots, made once for the present tokens and called at each decode
        step (:func:`kvbench.cache.view.whole_decoder`), where the segment decodes both fields into
        given slots; None where it does not (default: none; :func:`kvbench.cache.view.decode_rows`
        then asks :meth:`read_into`)."""
        return None

    def reader(self, dtype: torch.dtype) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
        """:meth:`read` of ``dtype`` as a function, made once for the present tokens and called at
        each decode step (:func:`kvbench.cache.view.whole_decoder`), where the segment takes
        something once that each read would take again; None where it does not (default: none;
        then :meth:`read_into` is asked at each step)."""
        return None

    def read_into(
        self, k: torch.Tensor | None, v: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`read`, the keys decoded into ``k`` and the values into ``v`` where given: ``(BH, n,
        D)`` slots of ``dtype`` (each head-row's ``n`` tokens in order, any strides), returned in
        place of the flat ``(N, D)``. Given for the fields of :meth:`writes_into` (elsewhere, copied).
        A field not given slots comes flat, or per head-row ``(BH, n, D)`` where every head-row holds
        ``n`` tokens."""
        keys, values = self.read(dtype)
        if k is not None:
            keys = k.copy_(keys.view(k.shape))
        if v is not None:
            values = v.copy_(values.view(v.shape))
        return keys, values

    def layout(self) -> tuple[Any, ...]:
        """Segments of one type and layout merge into one (see :meth:`LayerStore.move_out`)."""
        return ()

    def head_rows(self, lo: int, hi: int) -> Segment:
        """The tokens of head-rows ``lo .. hi - 1`` as a segment of the same type, for :meth:`read`
        (slices of this one's tensors, nothing copied; itself when they are every head-row). A
        part spans whole sequences or stays within one (see :meth:`LatentSegment.head_rows`)."""
        if lo == 0 and hi == self.lens.numel():
            return self
        a, b = ragged.span(self.lens, lo, hi)
        part = copy.copy(self)
        part.__dict__ = {n: x for n, x in self.__dict__.items() if not n.startswith("_")}
        part.set_data_fields({name: x[a:b] for name, x in self.data_fields().items()})
        part.pos = self.pos[a:b]
        part.lens = ragged.slice_of(self.lens, lo, hi)
        return part

    def nbytes(self) -> int:
        return nbytes(*self.data_fields().values())

    def token_nbytes(self) -> int:
        """Bytes of one token's per-token data."""
        if not self.size:
            return 0
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.data_fields().values())

    def bias(self) -> torch.Tensor | None:
        """Additive attention logit per token ``(N,)`` (merged tokens carry log(count)), or None."""
        return None

    def members(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For merged units: (member positions ``(M,)``, owning flat row ``(M,)``); None if 1:1."""
        return None

    def torch_partials(self) -> bool:
        """Whether :meth:`attend_partials` may give a state on the torch path, known on the host:
        False where it gives None there (a step whose attention is torch's then asks no segment,
        :func:`kvbench.cache.engine._attend_parts`). Default: never."""
        return False

    def attend_partials(self, query: torch.Tensor, scaling: float, batch: int) -> Any:
        """One decode step's softmax state over this segment's tokens, from its encoded form, to
        merge with the layer's other segments' by log-sum-exp: on the Triton path a kernel's
        (:class:`kvbench.kernels.attention.Partials`), on the torch path
        :class:`kvbench.cache.partials.Partial` where reading the encoded form saves work over
        decoding it. None where the representation has neither (the step is then decoded and
        attended whole). A segment with a :meth:`bias` adds it to each token's logit: only the
        Triton path's states do (the engine gathers a step with a bias on that path alone)."""
        return None

    def aux_nbytes(self) -> int:
        return self.size * self.rows.token_nbytes([n for n in self.rows.fields if n not in NOT_STATE])

    def keep(self, keep: torch.Tensor) -> None:
        """Keep the flat tokens where ``keep`` ``(N,)`` is True; the rest are freed."""
        ids = ragged.segment_ids(self.lens)
        self.lens = torch.bincount(ids[keep], minlength=self.lens.numel())
        self.pos = self.pos[keep]
        self.set_data_fields({k: v[keep] for k, v in self.data_fields().items()})

    def extend(self, other: Segment) -> None:
        """Append ``other``'s flat tokens after this segment's, per head-row (same type and layout):
        one ``cat`` per field when both hold the same number of tokens in every head-row (known on
        the host, :meth:`row_count`), else the ragged concatenation (the same tokens in the same
        order, with device synchronisations)."""
        counts = self.row_count(), other.row_count()
        _join(self, other, [*self.data_fields(), "pos"], "lens", counts)
        self.lens = _added(self.lens, other.lens, counts)

    def row_count(self) -> int | None:
        """Tokens of every head-row, or None when head-rows differ (:func:`ragged.same_count`)."""
        return ragged.same_count(self.lens)

    @property
    def size(self) -> int:
        return int(self.pos.shape[0])


def _added(a: torch.Tensor, b: torch.Tensor, counts: tuple[int | None, int | None]) -> torch.Tensor:
    """Per-head-row counts ``a + b``, with their common value when both ``counts`` are known."""
    mine, theirs = counts
    return ragged.tell(a + b, None if mine is None or theirs is None else mine + theirs)


def _join(seg: Any, other: Any, names: list[str], lens: str, counts: tuple[int | None, int | None]) -> None:
    """Each field ``names`` of ``other`` appended after ``seg``'s within each head-row (rows counted
    by ``lens``): one ``cat`` of rectangles when ``counts`` are known, else ragged."""
    mine, theirs = counts
    bh = getattr(seg, lens).numel()
    for name in names:
        a, b = getattr(seg, name), getattr(other, name)
        if mine is not None and theirs is not None:
            joined = torch.cat([a.view(bh, mine, *a.shape[1:]), b.view(bh, theirs, *b.shape[1:])], 1)
            setattr(seg, name, joined.view(-1, *a.shape[1:]))
        else:
            setattr(seg, name, ragged.concat(a, getattr(seg, lens), b, getattr(other, lens)))


class FPSegment:
    """Tokens at the model's precision: the ``k``, ``v`` rows are the stored data."""

    def __init__(self, bh: int, device: torch.device):
        self.rows = Rows(bh, device)

    @property
    def lens(self) -> torch.Tensor:
        return self.rows.lens

    @property
    def size(self) -> int:
        return self.rows.size()

    def nbytes(self) -> int:
        return self.size * self.token_nbytes() if self.rows.width else 0

    def token_nbytes(self) -> int:
        return self.rows.token_nbytes(KV) if self.rows.capacity else 0

    def aux_nbytes(self) -> int:
        if not self.rows.capacity:
            return 0
        return self.size * self.rows.token_nbytes([n for n in self.rows.fields if n not in NOT_STATE])

    def bias(self) -> None:
        return None

    def members(self) -> None:
        return None

    def torch_partials(self) -> bool:
        return True  # :func:`kvbench.cache.partials.partial` over the rows

    def attend_partials(self, query: torch.Tensor, scaling: float, batch: int) -> Any:
        """A decode step's softmax state over these rows (:meth:`Segment.attend_partials`): each
        head-row's first ``lens`` slots, read by the decode kernel on the Triton path, by
        :func:`kvbench.cache.partials.partial` on the torch path."""
        shape = (batch, self.rows.bh // batch, self.rows.width, query.shape[-1])
        k, v = (self.rows.get(n).view(shape) for n in KV)
        attention_kernels = dispatch.kernels("attention", batch, self.rows.width)
        if attention_kernels is None:
            valid = None if self.rows.uniform else self.rows.valid().view(shape[:3])
            return partials.partial(query, k, v, scaling, valid)
        lens = None if self.rows.uniform else self.rows.lens.view(batch, -1)  # None: every slot is held
        return attention_kernels.partials(query, k, v, None, scaling, None, lens)


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
        return nbytes(*self.data_fields().values(), *self.group_fields().values(), self.gcount)

    def group_nbytes(self) -> int:
        """Bytes of one group's parameters and live count."""
        per = sum(math.prod(t.shape[1:]) * t.element_size() for t in self.group_fields().values())
        return per + self.gcount.element_size()

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

    def extend(self, other: Segment) -> None:
        assert isinstance(other, GroupedSegment)
        counts = ragged.same_count(self.glens), ragged.same_count(other.glens)
        full = ragged.told(self.gcount), ragged.told(other.gcount)
        _join(self, other, [*self.group_fields(), "gcount"], "glens", counts)
        self.glens = _added(self.glens, other.glens, counts)
        if full[0] is not None and full[0] == full[1]:  # every group of both full: so are the joined
            ragged.tell(self.gcount, full[0])
        super().extend(other)

    def head_rows(self, lo: int, hi: int) -> Segment:
        part = super().head_rows(lo, hi)
        if part is self:
            return self
        assert isinstance(part, GroupedSegment)
        a, b = ragged.span(self.glens, lo, hi)
        for name, value in self.group_fields().items():
            setattr(part, name, value[a:b])
        part.gcount = ragged.slice_of(self.gcount, a, b)
        part.glens = ragged.slice_of(self.glens, lo, hi)
        return part

    def full_groups(self) -> int | None:
        """Tokens of every group when all hold the same number (as built, before any eviction; known
        on the host, :func:`ragged.same_count`), so per-group parameters broadcast over a
        ``(M, n, ...)`` view of the tokens instead of being gathered per token; else None."""
        return ragged.same_count(self.gcount)


def as_float(x: torch.Tensor) -> torch.Tensor:
    """``x.float()`` without an operation when ``x`` is float32 already (decode runs this per layer)."""
    return x if x.dtype == torch.float32 else x.float()


class _Packed:
    """A per-token field of a :class:`RowCounts` segment (see :func:`packed_rows`): reading it flat
    first unpacks the head-row buffers the segment's extends wrote into."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        obj.unpack()
        return obj.__dict__[self.name]

    def __set__(self, obj: Any, value: Any) -> None:
        obj.unpack()
        obj.__dict__[self.name] = value


def packed_rows(*names: str):
    """Class decorator (outside ``@dataclass``) for a :class:`RowCounts` segment: its per-token
    fields ``names`` (and ``pos``) grow in per-head-row buffers with room to spare, as
    :class:`kvbench.cache.rows.Rows` do, while every head-row holds the same number of tokens: an
    extend (a decode step moving a token in) writes its own tokens only, and a reader takes the
    ``(BH, n, ...)`` rectangle without a copy (:meth:`RowCounts.per_row_field`). Reading a field
    flat (an eviction, a ragged extend, a test) unpacks the buffers into flat fields, once."""

    def install(cls: type) -> type:
        cls.PACKED = (*names, "pos")  # type: ignore[attr-defined]
        for name in cls.PACKED:  # type: ignore[attr-defined]
            setattr(cls, name, _Packed(name))
        return cls

    return install


class RowCounts:
    """Mixin for a :class:`Segment`: its tokens per head-row on the host, when every head-row holds
    the same number (as a decode step moves one token of each), so per-head layouts and appends are
    views and rectangles instead of ragged padding with device synchronisations.

    With :func:`packed_rows`, an extend by a segment of the same count in every head-row writes its
    tokens into per-head-row buffers ``(BH, capacity, ...)`` after the tokens stored (the first
    such extend moves the segment's flat fields into buffers with room; a full buffer grows by a
    quarter): O(the tokens moved in) per step, amortised, not a copy of the segment. Readers that
    take :meth:`per_row_field` read the buffers in place; a flat read unpacks them.

    The count is cached against the ``lens`` tensor it was read from: anything that replaces
    ``lens`` (an eviction, an append) makes it read again, or set by :meth:`extend`.
    """

    lens: torch.Tensor
    PACKED: tuple[str, ...] = ()

    def row_count(self) -> int | None:
        """As :meth:`Segment.row_count`."""
        return ragged.same_count(self.lens)

    def per_row(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`ragged.to_padded` of ``flat`` ``(N, *rest)``: ``(BH, T, *rest)`` and the valid slots,
        None (all valid) when every head-row holds ``T`` tokens, then without a copy."""
        n = self.row_count()
        if n is None:
            return ragged.to_padded(flat, self.lens)
        return flat.view(self.lens.numel(), n, *flat.shape[1:]), None

    def per_row_field(self, name: str) -> torch.Tensor:
        """Field ``name`` ``(BH, n, *rest)`` when every head-row holds ``n`` tokens: a view of the packed
        buffer (head-rows ``capacity`` slots apart) or of the flat field, no copy."""
        field = self._per_row(name)
        assert field is not None, f"{type(self).__name__} stores no {name}"
        return field

    def _per_row(self, name: str) -> torch.Tensor | None:
        """:meth:`per_row_field`, None for an optional field this layout does not store."""
        n = self.row_count()
        assert n is not None, "per_row_field: head-rows of different lengths are read flat"
        packed = self.__dict__.get("_packed")
        if packed is not None:
            buf = packed[name]
            return None if buf is None else buf[:, :n]
        flat = self.__dict__[name]
        return None if flat is None else flat.view(self.lens.numel(), n, *flat.shape[1:])

    @staticmethod
    def flat(padded: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Inverse of :meth:`per_row`."""
        return padded.reshape(-1, *padded.shape[2:]) if valid is None else ragged.from_padded(padded, valid)

    def extend(self, other: Segment) -> None:
        """:meth:`Segment.extend`; when both hold the same number of tokens in every head-row, written
        into the packed buffers (:func:`packed_rows`, which a :class:`RowCounts` segment declares)."""
        assert isinstance(other, RowCounts)
        mine, theirs = self.row_count(), other.row_count()
        if mine is None or theirs is None:
            self.unpack()
            super().extend(other)  # type: ignore[misc]
            return
        self._pack(other, mine, theirs)
        self.lens = _added(self.lens, other.lens, (mine, theirs))

    def _pack(self, other: RowCounts, mine: int, theirs: int) -> None:
        """Write ``other``'s tokens after this segment's ``mine`` per head-row, in the packed buffers
        (made, or grown by a quarter, when they have no room for ``theirs`` more)."""
        packed, total = self.__dict__.get("_packed"), mine + theirs
        with inference():  # as the rows' appends: a forward's buffers are inference tensors
            if packed is None or next(b for b in packed.values() if b is not None).shape[1] < total:
                cap = with_room(total)
                grown: dict[str, torch.Tensor | None] = {}
                for name in self.PACKED:
                    held = self._per_row(name)
                    if held is not None:
                        grown[name] = held.new_empty(held.shape[0], cap, *held.shape[2:])
                        grown[name][:, :mine] = held  # type: ignore[index]
                    else:
                        grown[name] = None
                    self.__dict__[name] = None  # the flat field now lives in the buffer
                self.__dict__["_packed"] = packed = grown
            for name, buf in packed.items():
                if buf is not None:
                    buf[:, mine:total] = other.per_row_field(name)  # type: ignore[attr-defined]
        self.__dict__["_held"] = total

    def keep(self, keep: torch.Tensor) -> None:
        """:meth:`Segment.keep` of the flat fields (a packed segment's unpacked first)."""
        self.unpack()
        super().keep(keep)  # type: ignore[misc]

    def unpack(self) -> None:
        """Move the packed buffers' tokens back into flat head-major fields (a copy of each)."""
        packed = self.__dict__.pop("_packed", None)
        if packed is not None:
            n = self.__dict__.pop("_held")  # not from ``lens``: a keep replaces them before reading
            for name, buf in packed.items():
                self.__dict__[name] = None if buf is None else buf[:, :n].reshape(-1, *buf.shape[2:])

    def head_rows(self, lo: int, hi: int) -> Segment:
        """:meth:`Segment.head_rows`; a packed segment's part holds slices of its buffers."""
        packed = self.__dict__.get("_packed")
        if packed is None or (lo == 0 and hi == self.lens.numel()):
            return super().head_rows(lo, hi)  # type: ignore[misc]
        part = copy.copy(self)
        part.__dict__ = {n: x for n, x in self.__dict__.items() if not n.startswith("_")}
        part.__dict__["_packed"] = {n: None if b is None else b[lo:hi] for n, b in packed.items()}
        part.__dict__["_held"] = self.__dict__["_held"]
        part.lens = ragged.slice_of(self.lens, lo, hi)
        return part  # type: ignore[return-value]

    @property
    def size(self) -> int:
        n = self.row_count()
        return n * self.lens.numel() if n is not None else int(self.lens.sum())

    def token_nbytes(self) -> int:
        """Bytes of one token's per-token data (read from the fields' shapes, nothing unpacked)."""
        if not self.size:
            return 0
        packed = self.__dict__.get("_packed")
        names = [n for n in self.PACKED if n != "pos"] or list(self.data_fields())  # type: ignore[attr-defined]
        fields = [self.__dict__[n] if packed is None else packed[n] for n in names]
        skip = 1 if packed is None else 2  # flat (N, ...) or per head-row (BH, capacity, ...)
        return sum(math.prod(t.shape[skip:]) * t.element_size() for t in fields if t is not None)

    def nbytes(self) -> int:
        return self.size * self.token_nbytes()
