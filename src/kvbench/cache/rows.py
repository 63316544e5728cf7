"""Per-head-row token tables: the layout attention, kernels and techniques read.

Every KV head of every sequence (a *head-row*) keeps its own tokens, so heads can keep different
numbers of tokens and an evicted token is really freed from the count. A :class:`Rows` holds named
fields of shape ``(BH, capacity, *rest)``: row ``i``'s live tokens are its first ``lens[i]`` slots,
in the order they arrived, and ``[:, :width]`` (``width = lens.max()``) is the padded rectangle
attention reads, a free slice. Keys, values and positions sit side by side, so a GPU kernel can
read row ``i`` at ``field[i, :lens[i]]``.

Costs: appending ``q`` tokens writes ``q`` slots per row (capacity grows by a quarter at a time,
amortised O(1) per token); keeping a subset compacts the kept slots to the front of each row,
once, in order; nothing is rebuilt per step. ``width`` and whether every row is full (``uniform``)
are kept on the host, so reading the rectangle needs no device synchronisation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from kvbench.cache import devices
from kvbench.cache.ragged import segment_ids, starts, valid_mask
from kvbench.kernels import dispatch

_MIN_GROWTH = 64
_KV_POS = frozenset(("k", "v", "pos"))  # the fields a decode step's append gives (:meth:`Rows.append_kv`)

# A field's whole tensor, its 4-d view ``(batch, BH / batch, capacity, *rest)``, ``(batch, BH /
# batch)``, ``rest``, the view's strides and its storage offset (:meth:`Rows._head_view`).
HeadView = tuple[torch.Tensor, torch.Tensor, tuple[int, int], torch.Size, tuple[int, ...], int]


def prefix(field: torch.Tensor, width: int) -> torch.Tensor:
    """``field.narrow(1, 0, width)`` of a field ``(BH, capacity, *rest)``: the same view, taken as
    ``as_strided`` with the field's own strides, which costs the host about half of ``narrow``'s
    time (a decode step takes a few of these a layer, where a GPU waits on the host)."""
    shape = field.shape
    return field.as_strided((shape[0], width, *shape[2:]), field.stride())


def with_room(tokens: int) -> int:
    """The capacity per row for ``tokens``: a quarter more, at least :data:`_MIN_GROWTH` slots (rows,
    packed segments and the view grow so; amortised O(1) copies per token)."""
    return tokens + max(_MIN_GROWTH, tokens // 4)


def kept_capacity(kept: int, capacity: int) -> int:
    """The capacity after a compaction to ``kept`` slots per row: as it is, or a smaller one once the
    kept tokens fill less than half of it (rows emptied by evictions or moves do not hold the memory
    of their longest past)."""
    return capacity if 2 * kept >= capacity else with_room(kept)


# Columns past the width that :meth:`Rows._open` (past the width it opens) and a compaction of rows
# ending short leave zeroed: the next appends to ragged rows, a column each, then clear nothing (a
# decode step's append writes zeros once every ``ZERO_AHEAD + 1`` steps, not at each).
ZERO_AHEAD = 4

_ON = contextlib.nullcontext()


def inference() -> contextlib.AbstractContextManager:
    """Inference mode for writes in place into a forward's tensors (inference tensors), entered
    only where it is not on already (the hooks of a step run inside the forward's)."""
    return _ON if torch.is_inference_mode_enabled() else torch.inference_mode()


@dataclass
class _Compaction:
    """Where the kept slots of ``keep`` ``(BH, W)`` go when each row's are moved to its front, in
    order: ``order`` ``(BH, W)``, each row's columns with the kept ones first, in order (a stable
    sort); ``lens`` ``(BH,)`` kept per row, between ``least`` and ``width``; ``keep`` itself, which
    the Triton path's kernel reads instead of a plan (:mod:`kvbench.kernels.compaction`: there
    ``order`` is empty); ``kernel``, that module on the Triton path (asked once, when planning, so
    the plan and its application take the same path), else None; ``counts``, ``lens`` on the host."""

    order: torch.Tensor
    lens: torch.Tensor
    least: int
    width: int
    keep: torch.Tensor
    kernel: ModuleType | None = None
    counts: list[int] = dataclasses.field(default_factory=list)
    # the columns each field's new tensor takes, per (capacity, zero column); the slots ending short rows
    _cols: dict[tuple[int, int | None], torch.Tensor] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )
    _pad: torch.Tensor | None = dataclasses.field(default=None, init=False, repr=False)

    @classmethod
    def of(
        cls,
        keep: torch.Tensor,
        lens: torch.Tensor | None = None,
        counts: list[int] | None = None,
    ) -> _Compaction:
        """The plan of ``keep``; ``lens`` ``(BH,)`` and ``counts`` (the same on the host), the kept
        slots per row, when the caller has them already."""
        if lens is None or counts is None:
            lens = keep.sum(-1)
            counts = lens.tolist()  # the one synchronisation: the new width
        low, high = (min(counts), max(counts)) if counts else (0, 0)
        kernel = dispatch.kernels("compaction", slots=keep.shape[1])
        if kernel is not None:  # the kernel ranks the kept slots itself: no plan to make
            return cls(keep.new_empty(0, dtype=torch.long), lens, low, high, keep, kernel, counts)
        # kept first, each part in order (a stable sort, descending: ties keep their order)
        order = torch.argsort(keep.to(torch.int8), dim=-1, descending=True, stable=True)
        return cls(order, lens, low, high, keep, counts=counts)

    def zeroed_to(self, capacity: int) -> int:
        """The column up to which :meth:`take` leaves zeros past every row's count (at a new
        ``capacity``): :data:`ZERO_AHEAD` past the width where rows end short on the torch path
        (where the next appends go: they then clear nothing), else the width."""
        if self.kernel is not None or self.least == self.width:
            return self.width
        return min(capacity, self.width + ZERO_AHEAD)

    def take(
        self,
        values: torch.Tensor,
        capacity: int,
        zero: int | None = None,
    ) -> torch.Tensor:
        """A new ``(BH, capacity, ...)`` tensor (``capacity >= width``) holding the kept slots of
        ``values`` ``(BH, stride, ...)`` at the front of each row, in order, zeros past a row's
        count up to :meth:`zeroed_to`, its slots from there on unset: one ``gather`` of whole slots,
        each row's from its own row (and, where rows end short, zeros written over the columns where
        some row does). On
        the Triton path, one kernel pass (kept slots read once, written at their new columns).

        ``zero``: a column of ``values`` that holds zeros in every row, where the caller knows one:
        the slots past each row's count then take it in the same ``gather`` (zeros up to
        ``capacity``), and nothing is written over them after."""
        bh, stride, *rest = values.shape
        if self.kernel is not None:
            out = values.new_empty(bh, capacity, *rest)
            self.kernel.compact_into(values, self.keep, out, self.width)
            return out
        short = self.least < self.width  # some row ends short: zeros past its tokens
        zero = zero if short else None
        cols = self._cols.get((capacity, zero))
        if cols is None:
            order, width = self.order, self.order.shape[1]
            # past the kept slots: any slot of the row (those up to ``width`` zeroed below), or the
            # zero column
            cols = (
                order[:, :capacity]
                if capacity <= width
                else torch.cat(
                    [order, (order[:, :1] if width else order.new_zeros(bh, 1)).expand(bh, capacity - width)],
                    1,
                )
            )
            if zero is not None:
                cols = cols.masked_fill(devices.arange(capacity, self.lens) >= self.lens[:, None], zero)
            self._cols[(capacity, zero)] = cols
        # each row's slots taken from its own row: one gather of whole slots (the columns the same
        # for every trailing element)
        out = values.gather(1, cols.view(bh, capacity, *[1] * len(rest)).expand(bh, capacity, *rest))
        if short and zero is None:  # zeros past each row's tokens, and in the columns past the
            # width up to :meth:`zeroed_to`
            stop = self.zeroed_to(capacity)
            if self._pad is None or self._pad.shape[1] != stop - self.least:
                self._pad = devices.arange(stop, self.lens)[self.least :] >= self.lens[:, None]
            tail = out[:, self.least : stop]
            tail.masked_fill_(self._pad.view(*self._pad.shape, *[1] * len(rest)), 0)
        return out


@dataclass(frozen=True)
class Columns:
    """Columns ``start ..< stop`` of every row: a move the host knows (:meth:`Rows.take_columns`)."""

    start: int
    stop: int


_CLOSING: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

# ``torch.nonzero_static`` has a CUDA kernel since PyTorch 2.6 (the CPU one is older).
_STATIC_NONZERO_ANYWHERE = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 6)


def true_slots(mask: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask.nonzero(as_tuple=True)`` of a ``(rows, cols)`` mask holding ``count`` True slots, a
    count the caller knows on the host: taken at that size, so it is not read again from the device
    (``nonzero`` reads it: a synchronisation on a GPU). ``nonzero`` where this PyTorch has no
    ``nonzero_static`` for the device."""
    if _STATIC_NONZERO_ANYWHERE or mask.device.type == "cpu":
        rows, cols = torch.nonzero_static(mask, size=count).unbind(1)
        return rows, cols
    rows, cols = mask.nonzero(as_tuple=True)
    return rows, cols


# ``valid()`` of ragged rows per ``lens`` tensor, made once for the readers of a step (read-only;
# outside the rows, so what a cache holds is measured as before; gone with its ``lens``)
_VALID = devices.TensorMemo()


def _closing(
    capacity: int, col: int, stop: int, rows: tuple[bool, ...], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`Rows.close_column`'s flat slots (``dst``, ``src``) and marked rows ``(BH,)`` long, made
    once per process and device for the same arguments (read-only; the layers of a step and the
    steps until the capacity grows ask for the same ones)."""
    key = (capacity, col, stop, rows, devices.device_of(like))
    made = _CLOSING.get(key)
    if made is None:
        if len(_CLOSING) >= 256:  # a long run's past capacities and layouts
            _CLOSING.clear()
        every = all(rows)
        moved = stop - col - (1 if every else 0)  # with the padding slot past them, where ragged
        first = torch.tensor([r * capacity + col for r, m in enumerate(rows) if m], device=like.device)
        dst = (first[:, None] + torch.arange(moved, device=like.device)).reshape(-1)
        marked = torch.tensor(rows, dtype=torch.long, device=like.device)
        made = _CLOSING[key] = (dst, dst + 1, marked)
    return made


def compact(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``values`` ``(BH, W, ...)`` without the slots where ``keep`` ``(BH, W)`` is False, per row, in
    order: aligned with the rows after :meth:`Rows.keep` with the same ``keep`` (freed slots zero)."""
    plan = _Compaction.of(keep)
    return plan.take(values.contiguous(), values.shape[1])[:, : plan.width]


class Rows:
    """Named per-token fields ``(BH, capacity, *rest)`` with ``lens`` ``(BH,)`` live tokens per row.

    Args:
        bh: head-rows (batch x KV heads).
        device: where the fields live.
    """

    def __init__(self, bh: int, device: torch.device):
        self.bh, self.device = bh, device
        self._lens: torch.Tensor | None = None  # None while every row holds ``width``: made when read
        # ``_lens`` (a weak reference: what the rows hold is ``_lens`` alone, :mod:`kvbench.cache.held`)
        # and the same on the host, where known: checked against ``_lens`` when read
        self._lens_host: tuple[weakref.ref[torch.Tensor], list[int]] | None = None
        self.width = 0  # lens.max(), on the host
        self.uniform = True  # every row holds ``width`` tokens
        self.capacity = 0
        self._fields: dict[str, torch.Tensor] = {}
        # columns ``width ..< _zeroed`` of every field hold zeros (a compaction, a resize or
        # :meth:`_open` left them so): an append there has nothing to clear
        self._zeroed = 0
        self.fill: dict[str, float] = {}  # what a token holds in a field until set, where not 0
        # A field's values still to write: (name, first column, its value, the last append's values)
        # for columns ``first ..< width`` that hold ``value, value + 1, ...`` in every row (the
        # positions of tokens appended in order): written when the field is next read (:attr:`fields`).
        self._run: tuple[str, int, int, torch.Tensor] | None = None
        self._ones: torch.Tensor | None = None  # ``valid()`` of full rows: a slice of this, no launch
        self._starts: torch.Tensor | None = None  # ``(BH, 1)`` each row's first flat slot, at the capacity
        self._heads: dict[str, HeadView] = {}  # field -> (it, its 4-d view, and how to slice it)
        self._token_bytes: dict[tuple[str, ...], int] = {}  # token_nbytes by names (fields' shapes fixed)
        # Positions increase along each row (arrival order): appends, keeps and moves preserve it;
        # :meth:`drop` (a token into a freed slot) ends it, :meth:`sort_by` restores it.
        self.ordered = True
        self.changed_from: int | None = 0  # first column of the rectangle changed since :meth:`changes`

    def changes(self) -> int | None:
        """The first column of the rectangle that may have changed since the last call (None: no
        change), for a reader that keeps a copy of the rectangle up to date (the store's view)."""
        out, self.changed_from = self.changed_from, None
        return out

    def _changed(self, start: int) -> None:
        self.changed_from = start if self.changed_from is None else min(self.changed_from, start)

    # --- reading ---------------------------------------------------------------------------
    @property
    def fields(self) -> dict[str, torch.Tensor]:
        """The fields ``(BH, capacity, *rest)`` by name, every value written."""
        if self._run is not None:
            self._write_run()
        return self._fields

    def _write_run(self) -> None:
        """Write the pending run of consecutive values, in one launch (the values of several
        appends: a slice of a held ``arange``)."""
        assert self._run is not None
        name, first, value, last = self._run
        self._run = None
        field = self._fields[name]
        n = self.width - first
        with inference():  # as the appends it stands for: a forward's fields are inference tensors
            if n == last.shape[-1]:
                field[:, first : self.width] = last
            else:
                field[:, first : self.width] = devices.arange(value + n, field, field.dtype)[value:]

    @property
    def lens(self) -> torch.Tensor:
        """``(BH,)`` live tokens per row (made from ``width`` when every row is full, once per change)."""
        if self._lens is None:
            self._lens = torch.full((self.bh,), self.width, dtype=torch.long, device=self.device)
        return self._lens

    @lens.setter
    def lens(self, value: torch.Tensor) -> None:
        self._lens = value

    @property
    def lens_host(self) -> list[int] | None:
        """:attr:`lens` on the host where known without reading the device (every row full, or the
        lengths a compaction counted, grown by the appends since), else None."""
        if self.uniform:
            return [self.width] * self.bh
        held = self._lens_host
        lens = None if held is None else held[0]()
        return held[1] if held is not None and lens is not None and lens is self._lens else None

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def heads(self, name: str, batch: int) -> torch.Tensor:
        """Field ``name`` of full rows as ``(batch, BH / batch, width, *rest)``: a view, its 4-d form
        kept per field tensor, so a decode step slices it once."""
        self._flush(name)
        _, view, lead, rest, strides, _ = self._head_view(name, batch)
        return view.as_strided((*lead, self.width, *rest), strides)

    def kv_heads(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`heads` of the keys and of the values, in one call (a bare decode step's read)."""
        run = self._run
        if run is not None and run[0] in ("k", "v"):
            self._write_run()
        _, k, lead, rest, k_strides, _ = self._head_view("k", batch)
        _, v, _, _, v_strides, _ = self._head_view("v", batch)
        size = (*lead, self.width, *rest)
        return k.as_strided(size, k_strides), v.as_strided(size, v_strides)

    def _head_view(self, name: str, batch: int) -> HeadView:
        """Field ``name``'s whole tensor as ``(batch, BH / batch, capacity, *rest)``, kept while the
        field is that tensor (:meth:`append_kv` writes through it): ``(field, view, (batch, BH /
        batch), rest, the view's strides, its storage offset)``. A slice of it is taken as
        ``as_strided`` with the kept strides, the same view as ``narrow`` at half the host's time
        (:func:`prefix`)."""
        field = self._fields[name]
        held = self._heads.get(name)
        if held is None or held[0] is not field:
            view = field.view(batch, self.bh // batch, *field.shape[1:])
            lead, rest = (batch, self.bh // batch), field.shape[2:]
            held = self._heads[name] = field, view, lead, rest, view.stride(), int(view.storage_offset())
        return held

    def get(self, name: str) -> torch.Tensor:
        """The padded rectangle of a field: ``(BH, width, *rest)``, a view (slots past a row's
        length read as zeros)."""
        self._flush(name)
        return prefix(self._fields[name], self.width)

    def _flush(self, name: str) -> None:
        """Write the pending run if it is field ``name``'s (a reader of that field needs it)."""
        if self._run is not None and self._run[0] == name:
            self._write_run()

    def valid(self) -> torch.Tensor:
        """``(BH, width)`` bool: the live slots."""
        if self.uniform:  # read-only: a slice of one tensor of ones, kept at the capacity
            if self._ones is None or self._ones.shape[1] < self.width:
                self._ones = torch.ones(self.bh, self.capacity, dtype=torch.bool, device=self.device)
            return prefix(self._ones, self.width)
        lens = self.lens
        made = _VALID.get(lens)
        if made is None or made.shape[1] != self.width:
            made = _VALID[lens] = valid_mask(lens, self.width)
        return made

    def size(self) -> int:
        """Live tokens over all rows."""
        return self.bh * self.width if self.uniform else int(self.lens.sum())

    def token_nbytes(self, names: Sequence[str]) -> int:
        """Bytes of one token's ``names`` fields (held per names: a field's shape past its slots and
        its dtype never change, and a new field clears what is held)."""
        key = tuple(names)
        held = self._token_bytes.get(key)
        if held is None:
            fields = self._fields
            held = self._token_bytes[key] = sum(
                math.prod(fields[n].shape[2:]) * fields[n].element_size() for n in key
            )
        return held

    # --- writing ---------------------------------------------------------------------------
    def ensure(self, name: str, rest: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
        """Create field ``name`` unless it exists: ``fill`` for the tokens already stored and, where
        an append does not give the field, for the tokens appended."""
        if name not in self._fields:
            self._token_bytes.clear()
            shape = (self.bh, self.capacity, *rest)
            if fill == 0:
                self._fields[name] = torch.zeros(shape, dtype=dtype, device=self.device)
            else:
                self._fields[name] = torch.full(shape, fill, dtype=dtype, device=self.device)
                self.fill[name] = fill
                self._zeroed = min(self._zeroed, self.width)  # its columns past the width hold the fill
        elif fill != 0 and name not in self.fill:  # made by an append that gave it: later ones may not
            self.fill[name] = fill
        self._flush(name)  # a pending run of another field stays pending
        return self._fields[name]

    def set(self, name: str, values: torch.Tensor) -> None:
        """Overwrite field ``name`` with ``values`` ``(BH, width, *rest)`` (padding slots included:
        zeros there, as :meth:`get` reads them and as the appends into them rely on)."""
        self.ensure(name, tuple(values.shape[2:]), values.dtype)[:, : self.width] = values
        self._changed(0)

    def _reserve(self, need: int) -> None:
        if need > self.capacity:
            self._resize(with_room(need))

    def _resize(self, cap: int) -> None:
        """Move every field into new tensors of ``cap`` slots per row (at least ``width``), zeros past it."""
        for name, old in self._fields.items():  # a pending run's columns are written later, to the new one
            new = old.new_zeros(self.bh, cap, *old.shape[2:])
            new[:, : self.width] = old[:, : self.width]
            self._fields[name] = new
        self.capacity = cap
        self._zeroed = cap  # new zeros past the width
        self._ones = self._starts = None
        self._heads.clear()

    def _open(self, width: int) -> None:
        """Make room for ``width`` slots and zero the new span past the current width (where a
        compaction or a resize has not left zeros there), with up to :data:`ZERO_AHEAD` columns
        more within the capacity: the appends to ragged rows that follow clear nothing."""
        self._reserve(width)
        start = max(self.width, self._zeroed)
        if width > start:
            stop = min(self.capacity, width + ZERO_AHEAD)
            for field in self.fields.values():
                field[:, start:stop] = 0
            self._zeroed = stop

    def append_kv(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, start: int) -> bool:
        """:meth:`append`'s first path for the fields ``k``, ``v`` and ``pos`` alone, given as a
        batch's heads: keys and values ``(B, H, q, D)`` written through the 4-d views :meth:`kv_heads`
        keeps, positions ``pos`` ``(1, q)`` = ``start, start + 1, ...`` in every row joining the
        pending run (written when read); the other fields (a technique's per-token state) take their
        fill (:meth:`_fill_others`). A decode step of one sequence's append, without the general
        path's dict and reshapes; the views are made here where no reader has made them (a
        segment's decode reads the fields whole). Returns False, having written nothing, where it
        does not apply (rows of different lengths, no room, a run it does not continue):
        :meth:`append` then does it."""
        fields, pending, width, q = self._fields, self._run, self.width, k.shape[2]
        if (
            not self.uniform
            or "pos" not in fields
            or "k" not in fields
            or width + q > self.capacity
            or not (pending is None or (pending[0] == "pos" and pending[2] + width - pending[1] == start))
        ):
            return False
        held = self._heads
        kh, vh = held.get("k"), held.get("v")
        if kh is None or kh[0] is not fields["k"]:  # no reader took them yet (a segment's decode
            kh = self._head_view("k", k.shape[0])  # reads the rows' fields whole), or they were replaced
        if vh is None or vh[0] is not fields["v"]:
            vh = self._head_view("v", k.shape[0])
        if len(fields) != 3:
            self._fill_others(width, q, _KV_POS)
        # the ``q`` slots past ``width``, each field's through its held view (_head_view's fields)
        _, view, lead, rest, strides, offset = kh
        view.as_strided((*lead, q, *rest), strides, offset + width * strides[2]).copy_(k)
        _, view, lead, rest, strides, offset = vh
        view.as_strided((*lead, q, *rest), strides, offset + width * strides[2]).copy_(v)
        first, start = (width, start) if pending is None else pending[1:3]
        self._run = ("pos", first, start, pos)
        if self.changed_from is None or self.changed_from > width:
            self.changed_from = width
        self._lens, self.width = None, width + q
        return True

    def _fill_others(self, width: int, q: int, given: Collection[str]) -> None:
        """Every field not ``given`` takes its fill in columns ``width ..< width + q`` of full rows,
        where it does not hold it already (zeros past ``_zeroed``): what an append writes for a
        field it is not given (a technique's per-token state, set after the append)."""
        fill, zeroed = self.fill, self._zeroed
        for name, field in self._fields.items():
            if name not in given:
                value = fill.get(name, 0)
                if value != 0 or width + q > zeroed:
                    field.narrow(1, width, q).fill_(value)

    def append(self, new: dict[str, torch.Tensor], run: tuple[str, int] | None = None) -> None:
        """Append ``q`` tokens to every row: ``new[name]`` ``(BH, q, *rest)`` (or ``(1, q, *rest)``,
        the same for every row); fields not given get zeros.

        ``run``: ``(name, value)`` when field ``name``'s new values are ``value, value + 1, ...`` in
        every row (positions in order): full rows then write them when the field is next read, in
        one launch for every append since (a decode step of a cache that no technique reads
        positions of writes none)."""
        q = next(iter(new.values())).shape[1]
        fields, pending, width = self._fields, self._run, self.width
        if (  # a decode step's append: every field known, the positions continuing the pending run
            # (or starting one, where a reader of the positions wrote the last)
            self.uniform
            and run is not None
            and (pending is None or (pending[0] == run[0] and pending[2] + width - pending[1] == run[1]))
            and new.keys() <= fields.keys()
        ):
            if width + q > self.capacity:
                self._reserve(width + q)
                fields = self._fields
            for name, value in new.items():
                if name != run[0]:
                    fields[name].narrow(1, width, q).copy_(value)
            self._fill_others(width, q, new)  # the fields not given take their fill
            first, start = (width, run[1]) if pending is None else pending[1:3]
            self._run = (run[0], first, start, new[run[0]])
            if self.changed_from is None or self.changed_from > width:
                self.changed_from = width
            self._lens, self.width = None, width + q
            return
        for name, value in new.items():
            if name not in self._fields:
                self.ensure(name, tuple(value.shape[2:]), value.dtype)
        self._changed(self.width if self.uniform else 0)
        later = run if run is not None and self.uniform and self._continues(*run) else None
        if self._run is not None and later is None:
            self._write_run()
        if self.uniform:
            self._reserve(self.width + q)
            for name, field in self._fields.items():
                if later is None or name != later[0]:
                    field[:, self.width : self.width + q] = new.get(name, self.fill.get(name, 0))
            if later is not None:
                key, start = later
                first, start = (self.width, start) if self._run is None else self._run[1:3]
                self._run = (key, first, start, new[key])
        else:
            self._open(self.width + q)
            # (BH, q): a decode step's one token goes at each row's length, indexed without arithmetic
            cols = self.lens[:, None] if q == 1 else self.lens[:, None] + torch.arange(q, device=self.device)
            rows = devices.arange(self.bh, cols)[:, None].expand_as(cols)
            for name, value in new.items():
                self.fields[name][rows, cols] = value
            self._fill_absent(new, rows, cols)
        if self.uniform:
            self._lens = None
        else:
            known = self.lens_host
            self._lens = self.lens + q
            if known is not None:
                self._lens_host = weakref.ref(self._lens), [n + q for n in known]
        self.width += q

    def _fill_absent(self, new: dict[str, torch.Tensor], rows: torch.Tensor, cols: torch.Tensor) -> None:
        """The slots ``rows, cols`` just appended hold their fill in the fields ``new`` does not give
        (zeros where :meth:`_open` made room)."""
        for name, fill in self.fill.items():
            if name not in new:
                self.fields[name][rows, cols] = fill

    def _continues(self, name: str, value: int) -> bool:
        """Appending ``value, value + 1, ...`` to field ``name`` continues its pending run (or starts one)."""
        if self._run is None:
            return True
        pending, first, start, _ = self._run
        return pending == name and start + self.width - first == value

    def append_ragged(self, new: dict[str, torch.Tensor], new_lens: torch.Tensor) -> None:
        """Append flat head-major tokens, ``new_lens`` ``(BH,)`` per row: ``new[name]`` ``(n, *rest)``."""
        for name, value in new.items():
            self.ensure(name, tuple(value.shape[1:]), value.dtype)
        self._changed(self.width if self.uniform else 0)
        lens = self.lens + new_lens
        most = int(lens.max())
        self._open(most)
        rows = segment_ids(new_lens)
        cols = self.lens[rows] + torch.arange(rows.numel(), device=self.device) - starts(new_lens)[rows]
        for name, value in new.items():
            self.fields[name][rows, cols] = value
        self._fill_absent(new, rows, cols)
        self.lens = lens
        self.width = most
        self.uniform = bool((lens == most).all())

    def take_out(
        self, move: torch.Tensor, per_row: int | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, int | None] | None:
        """Remove the slots where ``move`` ``(BH, width)`` holds (the rest kept, as :meth:`keep`).

        ``per_row``: the slots every (full) row moves, when the caller knows it on the host; then
        no count is read from the device.

        Returns:
            None when no live slot moves; else every field's moved tokens, flat and head-major
            ``(n, *rest)``, their count per row ``(BH,)``, and that count on the host when every
            row moves the same number (else None).
        """
        if per_row is not None and self.uniform:
            if per_row == 0:
                return None
            counts = [per_row] * self.bh
            kept_counts = [self.width - per_row] * self.bh
            lens = torch.full((self.bh,), per_row, dtype=torch.long, device=self.device)
            kept = torch.full((self.bh,), self.width - per_row, dtype=torch.long, device=self.device)
            # the moved slots, row after row, in order: each row's first ``per_row`` after a stable sort
            cols = torch.argsort(move.to(torch.int8), dim=-1, descending=True, stable=True)[:, :per_row]
            src = (self._row_starts() + cols).reshape(-1)
        else:
            if not self.uniform:
                move = move & self.valid()
            lens = move.sum(-1)
            kept = self.lens - lens
            counts, kept_counts = torch.stack([lens, kept]).tolist()  # the one synchronisation
            if not any(counts):
                return None
            rows, cols = true_slots(move, sum(counts))  # the moved slots, row after row, in order
            src = rows * self.capacity + cols
        taken = {
            name: field.view(self.bh * self.capacity, *field.shape[2:]).index_select(0, src)
            for name, field in self.fields.items()
        }
        stays = ~move if self.uniform else ~move & self.valid()
        self._compact(_Compaction.of(stays, kept, kept_counts))
        return taken, lens, counts[0] if len(set(counts)) == 1 else None

    def take_columns(self, cols: Columns) -> tuple[dict[str, torch.Tensor], torch.Tensor, int] | None:
        """:meth:`take_out` of the same columns of every row, full rows (a move the host knows: the
        oldest unprotected tokens of rows in position order, :func:`kvbench.select.leaving_columns`):
        each field's columns copied out, the others joined in new tensors by one ``cat`` per field,
        at the capacity :meth:`_compact` would keep. Nothing is counted or planned on the device.

        Returns:
            None when no column moves; else as :meth:`take_out`.
        """
        assert self.uniform, "take_columns: full rows only (rows of different lengths: take_out)"
        start, stop, width = cols.start, cols.stop, self.width
        moved = stop - start
        if moved <= 0:
            return None
        fields = self.fields
        taken = {
            name: field[:, start:stop]
            .reshape(self.bh * moved, *field.shape[2:])
            .clone(memory_format=torch.contiguous_format)
            for name, field in fields.items()
        }
        self._changed(start)  # the columns before the move are as they were
        kept = width - moved
        cap = kept_capacity(kept, self.capacity)
        for name, field in fields.items():
            new = field.new_empty(self.bh, cap, *field.shape[2:])
            torch.cat([field[:, :start], field[:, stop:width]], dim=1, out=new[:, :kept])
            fields[name] = new
        self._heads.clear()  # views of the tensors replaced
        if cap != self.capacity:
            self._ones = self._starts = None
        self.capacity, self.width, self._lens, self._zeroed = cap, kept, None, kept
        lens = torch.full((self.bh,), moved, dtype=torch.long, device=self.device)
        return taken, lens, moved

    def keep(
        self,
        mask: torch.Tensor,
        kept: int | None = None,
        counted: tuple[torch.Tensor, list[int]] | None = None,
    ) -> None:
        """Keep the slots where ``mask`` ``(BH, width)`` holds, in order, compacted to each row's front;
        ``kept``: the slots every row keeps, when the caller knows it on the host (no synchronisation);
        ``counted``: each row's kept slots ``(BH,)`` and the same on the host, read by the caller,
        ``mask`` then within the live slots already.

        Writes new tensors: rectangles read before keep what they showed.
        """
        keep = mask if self.uniform or counted is not None else mask & self.valid()
        lens, counts = counted if counted is not None else (None, None)
        if kept is not None and counted is None:
            counts = [kept] * self.bh
            lens = torch.full((self.bh,), kept, dtype=torch.long, device=self.device)
        self._compact(_Compaction.of(keep, lens, counts))  # one plan for every field

    def _compact(self, plan: _Compaction) -> None:
        """Apply ``plan`` to every field, into new tensors: at the present capacity, or a smaller
        one (the kept width and room to grow) once the kept tokens fill less than half of it, so that
        rows emptied by evictions or moves do not hold the memory of their longest past."""
        self._changed(0)
        cap = kept_capacity(plan.width, self.capacity)
        zero = self.width if self._zeroed > self.width else None  # a column of zeros in every field
        for name, field in self.fields.items():
            self.fields[name] = plan.take(field, cap, zero)
        self._zeroed = plan.zeroed_to(cap)
        self._heads.clear()  # views of the tensors replaced
        if cap != self.capacity:
            self._ones = self._starts = None
        self.capacity = cap
        self.lens, self.width, self.uniform = plan.lens, plan.width, plan.least == plan.width
        self._lens_host = (weakref.ref(plan.lens), plan.counts) if plan.counts else None

    def _row_starts(self) -> torch.Tensor:
        """``(BH, 1)``: each row's first slot in a flat ``(BH * capacity, ...)`` view of a field."""
        if self._starts is None:
            self._starts = torch.arange(self.bh, device=self.device)[:, None] * self.capacity
        return self._starts

    def drop(self, cols: torch.Tensor) -> None:
        """Evict the slots ``cols`` ``(BH, e)`` (distinct columns of each row) from full rows, in
        O(e) writes: each freed slot below the new width takes one of the last ``e`` slots' live
        tokens, every field alike, in place. Rows are no longer in position order (:attr:`ordered`);
        attention reads positions beside each slot, so its order does not matter there.

        A decode step's eviction (one token in, one out) writes one slot per field and row instead
        of rewriting the kept rows."""
        assert self.uniform, "drop: rows of different lengths compact (keep)"
        bh, e = cols.shape
        width = self.width - e
        if e == 1:  # the last slot's token moves into the freed one (onto itself if that is the last)
            dst, src = (self._row_starts() + cols).view(-1), None
        else:  # holes below ``width`` first, paired with the last slots that stay, in order
            holes = cols.sort(-1).values
            leaves = torch.zeros(bh, e, dtype=torch.int8, device=self.device)
            leaves.scatter_add_(1, (holes - width).clamp(min=0), (holes >= width).to(torch.int8))
            stay = torch.argsort(leaves, dim=-1, stable=True)  # the last slots that stay, first
            # pairs past the holes join a leaving slot to a leaving slot: both past the new width
            dst = (self._row_starts() + holes).view(-1)
            src = (self._row_starts() + width + stay).view(-1)
        with inference():  # in place, as appends: a forward's fields are inference tensors
            for field in self.fields.values():
                flat = field.view(bh * self.capacity, *field.shape[2:])
                # one token leaving: the last slot of each row is its column ``width``, read as a
                # view (no gather); the slot it fills lies below it, or is it. One row (one
                # sequence of one KV head): that view is a contiguous slice of the field itself,
                # which index_copy_ refuses as overlapping, so it is copied first
                moved = field[:, width] if src is None else flat.index_select(0, src)
                flat.index_copy_(0, dst, moved.clone() if src is None and bh == 1 else moved)
        self.width, self._lens = width, None  # every row still full: lengths made when read
        self._zeroed = width  # the slots past it held the tokens that moved
        self.ordered = False
        self._changed(0)

    def close_column(self, col: int, stop: int, rows: tuple[bool, ...]) -> None:
        """Evict column ``col`` of the rows marked in ``rows`` (``(BH,)`` on the host), each holding
        exactly ``stop`` tokens: their columns after it move left by one, every field alike, in
        place, in order (O(``stop - col``) writes a row, not a compaction of every row). Where the
        other rows are longer (``stop < width``), the slot a marked row frees at its end takes the
        zeros past it, as :meth:`keep` leaves them; where every row is marked, ``stop`` is the width.
        The slots are made once for the same arguments and capacity. The rows then take the capacity
        a keep gives them (smaller where the kept width fills less than half of it), so that what
        they hold is what a keep leaves."""
        every = all(rows)
        assert (every and self.uniform and stop == self.width) or (not every and stop < self.width)
        dst, src, marked = _closing(self.capacity, col, stop, rows, next(iter(self._fields.values())))
        with inference():  # in place, as appends: a forward's fields are inference tensors
            for field in self.fields.values():
                flat = field.view(self.bh * self.capacity, *field.shape[2:])
                flat.index_copy_(0, dst, flat.index_select(0, src))
        if every:
            self.width, self._lens = stop - 1, None
            self._zeroed = self.width  # its last slot held the last token
        else:
            self._lens = self.lens - marked
        self._changed(col)
        cap = kept_capacity(self.width, self.capacity)
        if cap != self.capacity:  # as a keep of the same slots would size the rows (its resident bytes)
            self._resize(cap)

    def sort_by(self, name: str) -> None:
        """Put each row's live tokens back in the order of field ``name`` (positions), every field
        alike: one rewrite of the rows, for a reader that needs arrival order after :meth:`drop`."""
        if self.ordered:
            return
        key = self.get(name)
        if not self.uniform:
            key = key.masked_fill(~self.valid(), torch.iinfo(key.dtype).max)  # padding stays last
        order = key.argsort(dim=-1, stable=True)
        with inference():
            for field in self.fields.values():
                rect = field[:, : self.width]
                idx = order.view(*order.shape, *([1] * (field.dim() - 2))).expand_as(rect)
                field[:, : self.width] = torch.gather(rect, 1, idx)
        self.ordered = True
        self._changed(0)
