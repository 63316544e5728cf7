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
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.cache import partials, ragged
from kvbench.cache.rows import Rows
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

    def writes_into(self) -> tuple[bool, bool]:
        """Whether :meth:`read_into` decodes the keys, the values straight into slots it is given,
        without a decoded copy of its own (a decoded layer is then one buffer, not a concatenation
        of decoded parts: :func:`kvbench.cache.view.decode_rows`)."""
        return False, False

    def read_into(
        self, k: torch.Tensor | None, v: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`read`, the keys decoded into ``k`` and the values into ``v`` where given: ``(BH, n,
        D)`` slots of ``dtype`` (each head-row's ``n`` tokens in order, any strides), returned in
        place of the flat ``(N, D)``. Given for the fields of :meth:`writes_into` (elsewhere, copied)."""
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
        return self.rows.token_nbytes(list(KV)) if self.rows.capacity else 0

    def aux_nbytes(self) -> int:
        if not self.rows.capacity:
            return 0
        return self.size * self.rows.token_nbytes([n for n in self.rows.fields if n not in NOT_STATE])

    def bias(self) -> None:
        return None

    def members(self) -> None:
        return None

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


class _Joined:
    """A per-token field of a :class:`RowCounts` segment (see :func:`joined_on_read`): reading it
    first joins the tokens that extends have queued."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        obj.join()
        return obj.__dict__[self.name]

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value


def joined_on_read(*names: str):
    """Class decorator (outside ``@dataclass``) for a :class:`RowCounts` segment: its per-token
    fields ``names`` (and ``pos``) are joined with the tokens queued by :meth:`RowCounts.extend`
    when read, not at every extend."""

    def install(cls: type) -> type:
        cls.JOINED = (*names, "pos")  # type: ignore[attr-defined]
        for name in cls.JOINED:  # type: ignore[attr-defined]
            setattr(cls, name, _Joined(name))
        return cls

    return install


JOIN_EVERY = 64  # queued extends joined at the latest after this many (see RowCounts.extend)


class RowCounts:
    """Mixin for a :class:`Segment`: its tokens per head-row on the host, when every head-row holds
    the same number (as a decode step moves one token of each), so per-head layouts and appends are
    views and one ``cat`` instead of ragged padding with device synchronisations.

    With :func:`joined_on_read`, an extend by a segment of the same count in every head-row only
    queues it (O(its tokens)); its fields are joined, by one ``cat`` per field for every queued
    segment, when one is read (decoding, an eviction, a test) or after ``JOIN_EVERY`` extends: a
    decode step that moves a token in copies the tokens already stored once per ``JOIN_EVERY``
    steps, not every step, and the queue's memory stays bounded. Counting bytes reads no field.

    The count is cached against the ``lens`` tensor it was read from: anything that replaces
    ``lens`` (an eviction, an append) makes it read again, or set by :meth:`extend`.
    """

    lens: torch.Tensor
    JOINED: tuple[str, ...] = ()

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

    @staticmethod
    def flat(padded: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Inverse of :meth:`per_row`."""
        return padded.reshape(-1, *padded.shape[2:]) if valid is None else ragged.from_padded(padded, valid)

    def extend(self, other: Segment) -> None:
        """:meth:`Segment.extend`; when both hold the same number of tokens in every head-row, queued
        (:func:`joined_on_read`) or one ``cat`` per field (bitwise what the ragged concatenation
        gives)."""
        assert isinstance(other, RowCounts)
        mine, theirs = self.row_count(), other.row_count()
        if mine is None or theirs is None:
            self.join()
            super().extend(other)  # type: ignore[misc]
            return
        if self.JOINED:
            queue = self.__dict__.setdefault("_queued", [])
            if not queue:
                queue.append((self, mine))
            queue.append((other, theirs))
            if len(queue) > JOIN_EVERY:  # a bounded queue: each token is copied 1/JOIN_EVERY as often
                self.join()
        else:
            self._cat([(self, mine), (other, theirs)], [*self.data_fields(), "pos"])  # type: ignore[attr-defined]
        self.lens = _added(self.lens, other.lens, (mine, theirs))

    def join(self) -> None:
        """Join the queued segments' fields to this one's."""
        queue = self.__dict__.pop("_queued", None)
        if queue:
            self._cat(queue, self.JOINED)

    def _cat(self, parts: list[tuple[Any, int]], names) -> None:
        """Each field ``names`` of ``parts`` (segments, tokens per head-row) joined per head-row."""
        bh = self.lens.numel()
        for name in names:
            fields = [seg.__dict__[name] for seg, _ in parts]
            if fields[0] is None:  # an optional field this layout does not store
                continue
            rest = fields[0].shape[1:]
            both = torch.cat([f.view(bh, n, *rest) for f, (_, n) in zip(fields, parts)], dim=1)
            self.__dict__[name] = both.view(-1, *rest)

    @property
    def size(self) -> int:
        n = self.row_count()
        return n * self.lens.numel() if n is not None else int(self.lens.sum())

    def token_nbytes(self) -> int:
        """Bytes of one token's per-token data (read from the fields' shapes, nothing joined)."""
        if not self.size:
            return 0
        names = [n for n in self.JOINED if n != "pos"] or list(self.data_fields())  # type: ignore[attr-defined]
        fields = [self.__dict__[n] for n in names]  # as stored, queued tokens not joined
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in fields if t is not None)

    def nbytes(self) -> int:
        return self.size * self.token_nbytes()
