"""Per-layer KV storage: segments of per-head-row tokens, with exact byte accounting.

A layer's cache is a list of segments. The last one is always full precision (:class:`FPSegment`):
new tokens land there. Representation compressors move tokens out of it into segments of their
own (packed integers, factors, merged units, ...) through :meth:`LayerStore.move_out`, older
first; no technique assigns a segment or the list itself.

Every segment keeps its tokens in a :class:`kvbench.cache.rows.Rows` table, per head-row, with
their original positions (``pos``) and any per-token technique state (:class:`TokenState`, e.g.
H2O's accumulated attention). The full-precision rows also hold the keys and values (``k``,
``v``): the stored data. A compressed segment stores its encoded form flat and head-major
(``lens`` tokens per head-row: packed codes, factors; see its ``data_fields``) and nothing
decoded: attention decodes it a block of head-rows at a time (:meth:`LayerStore.decoded`), and a
technique that reads keys gets them decoded for that step (``view().k``, dropped by
:meth:`LayerStore.release`).

Byte accounting: ``nbytes()`` counts every tensor needed to rebuild the keys and values that
attention reads (data, scales, zero points, group counts, factors) plus the technique metadata
attention needs (:class:`SideData`). Token positions and technique state are bookkeeping,
reported apart as ``aux_nbytes()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvbench.cache import ragged
from kvbench.cache.positions import step_positions
from kvbench.cache.rows import Columns, Rows, true_slots
from kvbench.cache.segments import NOT_STATE, FPSegment, Segment, nbytes
from kvbench.cache.side import SideData, TokenState
from kvbench.cache.surface import Build, every_position
from kvbench.cache.view import JoinedRows, PaddedView, decode_rows, padded_view, whole_decoder
from kvbench.kernels import dispatch

S = TypeVar("S", bound=SideData)


class LayerStore:
    """All cached tokens of one layer, for ``batch`` sequences and ``kv_heads`` heads.

    ``seen`` ``(B,)`` counts the real tokens each sequence has fed (its next position): in a padded
    batch, sequences advance at their own pace and padding is never stored. Technique metadata
    that attention needs lives in :class:`SideData` records, counted in :meth:`nbytes`.

    ``edits`` counts the changes to stored tokens other than appends (evictions, moves into a
    representation): while it stays the same, every token stored before is still stored, unchanged
    and at the same place, so metadata derived from them (Quest's page bounds) stays valid.
    ``changes`` counts every change, appends included: while it stays the same, so does the store,
    and what a read derived from it (a router's routing) can be asked again.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self._fp = FPSegment(batch * kv_heads, device)
        self._compressed: list[Segment] = []  # older tokens in other representations
        self._seen: torch.Tensor | None = None  # ``seen`` on the device, made from ``seen_host`` when read
        self.seen_host = [0] * batch  # ``seen`` on the host: decisions that need no device work
        self.protect_from: torch.Tensor | None = None  # (B,): positions >= this are never evicted
        self.protect_from_host: tuple[int, ...] | None = None  # the same, on the host
        self._side: dict[type, SideData] = {}
        self.last_qpos = torch.empty(batch, 0, dtype=torch.long, device=device)  # (B, q) of the last append
        self.last_padded = False  # the last append came with a padding mask (``real``)
        self._seen_max = 0
        self._view: PaddedView | None = None
        self.changes = 0  # changes to the stored tokens, appends included
        self._joined: JoinedRows | None = None  # the view's positions when several segments hold tokens
        self._by_pos: tuple[PaddedView, torch.Tensor] | None = None  # a view and its position order
        self.edits = 0  # changes to stored tokens other than appends (evictions, moves): see ``edits``
        # the layer's whole decoder (:func:`kvbench.cache.view.whole_decoder`) for the present edit
        # and kernel path, or None where its segments give none: :meth:`whole_decoder`
        self._whole: tuple[tuple[int, str], Callable[[], tuple[torch.Tensor, torch.Tensor]] | None] | None = (
            None
        )
        self.copies: dict[str, Any] = {}  # techniques' copies elsewhere (FlexGen's tier): resident bytes

    # --- segments (read-only to techniques) ---------------------------------------------
    @property
    def fp(self) -> FPSegment:
        return self._fp

    @property
    def compressed(self) -> tuple[Segment, ...]:
        return tuple(self._compressed)

    @property
    def segments(self) -> list[Any]:
        return [*self._compressed, self._fp]

    def next_positions(self, q: int, device: torch.device | None = None) -> torch.Tensor:
        """``(B, q)`` positions of the next ``q`` unpadded tokens of every sequence (on ``device``,
        else the store's): the tensor the layers of that step append with, made once for all."""
        return step_positions(device or self.device, self.seen_host, q)[0]

    @property
    def seen(self) -> torch.Tensor:
        """``(B,)`` on the device: the real tokens each sequence has fed."""
        if self._seen is None:
            self._seen = torch.tensor(self.seen_host, dtype=torch.long, device=self.device)
        return self._seen

    @seen.setter
    def seen(self, value: torch.Tensor) -> None:
        self._seen = value
        self.seen_host = value.tolist()
        self._seen_max = max(self.seen_host)

    @property
    def seen_max(self) -> int:
        return self._seen_max

    def set_protect_from(self, start: int | torch.Tensor | None) -> None:
        """Positions at or after ``start`` (one per sequence, or one for all) are never evicted."""
        if start is None:
            self.protect_from, self.protect_from_host = None, None
        else:
            self.protect_from = torch.as_tensor(start, device=self.device).expand(self.batch).clone()
            self.protect_from_host = tuple(self.protect_from.tolist())

    # --- writing --------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """Store new tokens. ``k``, ``v``: ``(B, H, q, D)``; ``real`` ``(B, q)`` marks non-padding.

        Positions continue from each sequence's ``seen``; padding is dropped, never stored.
        """
        b, h, q, d = k.shape
        rows = self._fp.rows
        if real is None:
            qpos, self._seen = step_positions(k.device, self.seen_host, q)
            self.last_qpos = qpos
            if b != 1 or not rows.append_kv(k, v, qpos, self.seen_host[0]):
                # every row gets positions seen, seen + 1, ...
                at_one = b == 1 or len(set(self.seen_host)) == 1
                rows.append(
                    {
                        "k": k.reshape(b * h, q, d),
                        "v": v.reshape(b * h, q, d),
                        # one sequence: its positions broadcast over its heads as they are written
                        "pos": qpos if b == 1 else qpos.repeat_interleave(h, dim=0),
                    },
                    run=("pos", self.seen_host[0]) if at_one else None,  # written when read
                )
            self.seen_host = [self.seen_host[0] + q] if b == 1 else [n + q for n in self.seen_host]
            self._seen_max += q
            self.last_padded = False
        else:
            real = real.to(k.device)
            pos = self.seen[:, None] + real.long().cumsum(-1) - 1  # (B, q)
            self.last_qpos = torch.where(real, pos, torch.full_like(pos, -1))
            keep = real[:, None, :].expand(b, h, q).reshape(b * h, q)
            pos_rows = pos[:, None, :].expand(b, h, q).reshape(b * h, q)
            rows.append_ragged(
                {
                    "k": k.reshape(b * h, q, d)[keep],
                    "v": v.reshape(b * h, q, d)[keep],
                    "pos": pos_rows[keep],
                },
                keep.sum(-1),
            )
            self._seen = self.seen + real.sum(-1)
            self.seen_host = self._seen.tolist()  # the one synchronisation of a padded append
            self._seen_max = max(self.seen_host)
            self.last_padded = True
        self._changed()

    def move_out(
        self, move: torch.Tensor | Columns, build: Build, first: bool = False, per_row: int | None = None
    ) -> Segment | None:
        """Move the full-precision tokens under ``move`` into the representation ``build`` makes.

        The one way tokens leave the full-precision window. Their positions and technique state
        follow them; the new segment merges into an existing one of the same type and
        :meth:`Segment.layout`, else joins the list (last, or first with ``first``).

        Args:
            move: ``(B * H, W)`` bool over the full-precision rows (see :meth:`fp_view`), or the
                same :class:`~kvbench.cache.rows.Columns` of every row, where the host knows them
                (:func:`kvbench.select.leaving_columns`: nothing counted or planned on the device).
            build: ``(k (n, D), v (n, D), pos (n,), lens (BH,)) -> Segment`` for the moved tokens,
                flat and head-major.
            per_row: the tokens every head-row moves, where the caller knows it on the host
                (:func:`kvbench.select.moving_per_row`): no count is read from the device.

        Returns:
            The segment built (before merging), or None if nothing moved.
        """
        rows = self._fp.rows
        taken = rows.take_columns(move) if isinstance(move, Columns) else rows.take_out(move, per_row)
        if taken is None:
            return None
        flat, lens, per_row = taken
        ragged.tell(lens, per_row)  # the builder's per-row layouts need no reads
        seg = build(flat.pop("k"), flat.pop("v"), flat["pos"], lens)
        self.adopt(seg, {n: x for n, x in flat.items() if n != "pos"}, first, per_row)
        return seg

    def replace(
        self,
        sel: torch.Tensor,
        seg: Segment,
        state: dict[str, torch.Tensor],
        kept: list[int] | None = None,
        per_row: int | None = None,
    ) -> None:
        """Evict the units where ``sel`` ``(B, H, T)`` (aligned with ``view()``) holds and store ``seg``
        (e.g. their merge) in their place, oldest first, with per-token ``state`` (flat).

        ``kept`` and ``per_row``: host figures that spare the synchronisations, when known (see
        :meth:`keep` and :meth:`adopt`)."""
        self.keep(~sel, kept)
        self.adopt(seg, state, first=True, per_row=per_row)

    def adopt(
        self, seg: Segment, state: dict[str, torch.Tensor], first: bool = False, per_row: int | None = None
    ) -> None:
        """Add a built segment's tokens (their positions and flat per-token ``state`` to its rows).

        ``per_row``: the segment's tokens of every head-row, when the same and known on the host
        (a decode step's move), so joining rows that hold the same number appends rectangles."""
        new = {"pos": seg.pos, **state}
        bias = seg.bias()
        if bias is not None:
            new["bias"] = bias
        old = next((s for s in self._compressed if type(s) is type(seg) and s.layout() == seg.layout()), None)
        if old is None:
            seg.rows = Rows(self.batch * self.kv_heads, self.device)
            self._compressed.insert(0 if first else len(self._compressed), seg)
            target = seg.rows
        else:
            old.extend(seg)
            target = old.rows
        if per_row is not None and target.uniform:
            target.append({name: x.view(target.bh, per_row, *x.shape[1:]) for name, x in new.items()})
        else:
            target.append_ragged(new, seg.lens)
        self._edited()

    def keep(self, mask: torch.Tensor, kept: list[int] | None = None, few: bool = False) -> None:
        """Evict every token where ``mask`` ``(B, H, T)`` (aligned with ``view()``) is False.

        ``kept``: per segment (as :attr:`segments`), the tokens every head-row of it keeps, when
        known on the host: a segment that keeps none goes whole, the others compact without a
        synchronisation. Otherwise each head-row's kept tokens in every segment are read in one
        synchronisation, which tells both the segments that keep every token (left as they are)
        and the compactions' widths.

        ``few``: where those counts show the full-precision rows alone, full, every head-row keeping
        the same number and a few leaving (:meth:`can_drop`), the leaving tokens go as :meth:`drop`
        takes them: the last tokens into the freed slots, O(evicted) writes, where a compaction
        rewrites the kept rows (the rows are then out of position order)."""
        segs = self.segments
        parts = self._split(mask)
        counts: list[int | None] = list(kept) if kept is not None else [None] * len(segs)
        bh = self.batch * self.kv_heads
        counted = [None] * len(segs) if kept is not None else _kept_counts(segs, parts, bh)
        if few and not self._compressed and counted[0] is not None and len(set(counted[0][2])) == 1:
            stays, width = counted[0][2][0], self._fp.rows.width
            if stays < width and self.can_drop(stays):
                # row by row, each row's ``width - stays`` leaving columns
                _, cols = true_slots(~counted[0][0], bh * (width - stays))
                self.drop(cols.view(self.batch, self.kv_heads, width - stays))
                return
        changed = False
        for seg, keep, n, count in zip(segs, parts, counts, counted):
            rows = seg.rows
            if count is not None:
                keep, lens, per_row, live = count
                if per_row == live:  # every live token stays
                    continue
            elif n is not None and rows.uniform and n == rows.width:  # keeps every token
                continue
            changed = True
            if n == 0 and isinstance(seg, Segment):
                self._compressed.remove(seg)
                continue
            if isinstance(seg, Segment):  # its flat tokens: every slot of full rows, in order
                seg.keep(keep.reshape(-1) if rows.uniform else keep[rows.valid()])
            seg.rows.keep(keep, n, None if count is None else (lens, per_row))
        if not changed:  # every token stays: the store, its view and its edits are as they were
            return
        self._compressed = [s for s in self._compressed if s.rows.width > 0]
        self._edited()

    def can_drop(self, kept: int) -> bool:
        """:meth:`drop` applies: the full-precision rows hold every token, each head-row the same
        number, and a few of them leave (at most a quarter; more compact as cheaply, in order)."""
        rows = self._fp.rows
        return not self._compressed and rows.uniform and 4 * (rows.width - kept) <= rows.width

    def drop(self, cols: torch.Tensor) -> None:
        """Evict the tokens at columns ``cols`` ``(B, H, e)`` of ``view()`` (distinct per head-row;
        see :meth:`can_drop`): the last tokens move into the freed slots, O(e) writes
        (:meth:`Rows.drop`); the rows are then out of position order until a reader needs it."""
        self._fp.rows.drop(cols.reshape(self.batch * self.kv_heads, -1))
        self._edited()

    def close_column(self, col: int, stop: int, heads: tuple[bool, ...]) -> None:
        """Evict the token at column ``col`` of ``view()`` in the head-rows of the KV heads marked in
        ``heads`` (in every sequence), each holding exactly ``stop`` tokens, the store in position
        order (:meth:`in_position_order`): the tokens after it move left by one, in place, in order
        (:meth:`Rows.close_column`: O(``stop - col``) writes a head-row, where :meth:`keep` compacts
        every row)."""
        assert self.in_position_order() and len(heads) == self.kv_heads
        self._fp.rows.close_column(col, stop, heads * self.batch)
        self._edited()

    def _in_order(self) -> None:
        """Put the full-precision rows back in position order if a :meth:`drop` left them out of it."""
        if not self._fp.rows.ordered:
            self._fp.rows.sort_by("pos")
            self._edited()

    def _edited(self) -> None:
        """A change to stored tokens other than an append: :attr:`edits` counts it, the whole
        decoder made for the tokens before goes (it holds views of their tensors), and the store
        has changed (:meth:`_changed`)."""
        self.edits += 1
        self._whole = None
        self._changed()

    def _changed(self) -> None:
        """The stored tokens changed: the view is made again when next read, and :attr:`changes`
        counts one more (what was derived from the tokens before is of an older count)."""
        self._view = None
        self.changes += 1

    # --- reading --------------------------------------------------------------------------
    def fp_view(self, name: str = "pos") -> torch.Tensor:
        """A field of the full-precision rows ``(B * H, W, ...)``, in position order (the oldest
        first); ``move_out`` masks are aligned with it."""
        self._in_order()
        return self._fp.rows.get(name)

    def fp_valid(self) -> torch.Tensor:
        self._in_order()
        return self._fp.rows.valid()

    def view(self) -> PaddedView:
        """Padded keys, values and positions over every segment, oldest representation first
        (:func:`kvbench.cache.view.padded_view`). With several segments, the keys and values are
        decoded when first read (:meth:`decoded`) and kept until :meth:`release`; their joined
        positions are kept between steps."""
        if self._view is None:
            # the segments, not the bound ``self.decoded``: a view holding its store would be a
            # reference cycle, and a finished cache's tensors would wait for the garbage collector
            decode = functools.partial(decode_rows, self.segments, 0, self.batch * self.kv_heads, self.dtype)
            self._view, self._joined = padded_view(
                self.segments, self._joined, self.batch, self.kv_heads, decode
            )
        return self._view

    def by_position(self) -> torch.Tensor:
        """``(B, H, T)`` the columns of ``view()`` in position order per head-row, padding last: made
        once per view, for every reader of this step (pooling neighbours, ties broken by position)."""
        view = self.view()
        if self._by_pos is None or self._by_pos[0] is not view:
            pos = view.pos
            if not view.dense:
                pos = torch.where(view.valid, pos, torch.iinfo(pos.dtype).max)
            self._by_pos = view, pos.argsort(dim=-1, stable=True)
        return self._by_pos[1]

    def release(self) -> None:
        """Drop the keys and values a view decoded (the end of a forward's attention, of a
        technique's step): a compressed cache holds no decoded copy between steps, nor a position
        order."""
        self._by_pos = None
        if self._view is not None:
            self._view.release()

    def keys(self) -> torch.Tensor:
        """``view().k`` ``(B, H, T, D)``, as :meth:`kv` reads it (the keys' view alone where
        :meth:`dense_kv` applies)."""
        rows = self._fp.rows
        if self._view is None and not self._compressed and rows.uniform:
            return rows.heads("k", self.batch)
        return self.kv()[0]

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``view().k`` and ``view().v`` ``(B, H, T, D)``: where no view is made and
        :meth:`dense_kv` applies, the full-precision rows' own (the view's values, with its
        strides), without making the view (its positions and valid slots)."""
        kv = self.dense_kv() if self._view is None else None
        if kv is None:
            view = self.view()
            return view.k, view.v
        return kv

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values ``(B, H, T, D)`` when the full-precision rows hold every token and
        every head-row is full (views of the rows, no mask needed to read them), else None."""
        rows = self._fp.rows
        if self._compressed or not rows.uniform:
            return None
        return rows.kv_heads(self.batch)

    def decoded(self, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of head-rows ``lo .. hi - 1`` laid out as ``view()``'s, ``(hi - lo, T, D)``
        in the store's dtype (:func:`kvbench.cache.view.decode_rows`: every representation decoded
        now and kept nowhere). A part spans whole sequences or stays within one."""
        hi = self.batch * self.kv_heads if hi is None else hi
        return decode_rows(self.segments, lo, hi, self.dtype)

    def whole_decoder(self) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
        """:meth:`decoded` of every head-row as a function (:func:`kvbench.cache.view.whole_decoder`:
        what its segments decode and how, settled once per edit and kernel path, not at every
        step), where its compressed segments give one; else None (then :meth:`decoded`). The same
        keys and values, while the full-precision rows stay full (appends keep them so)."""
        key = (self.edits, dispatch.active())
        held = self._whole
        if held is None or held[0] != key:
            held = self._whole = key, whole_decoder(self.segments, self.dtype, self.head_dim)
        return held[1]

    def units(self, positions: int) -> torch.Tensor:
        """Column of ``view()`` holding each original position ``(B, H, positions)``; -1 if not stored.

        A merged unit owns every position it absorbed.
        """
        bh = self.batch * self.kv_heads
        out = torch.full((bh, positions), -1, dtype=torch.long, device=self.device)
        start = 0
        for seg in self.segments:
            rows, cols = seg.rows.valid().nonzero(as_tuple=True)  # head-major, as flat tokens
            cols = cols + start
            members = seg.members()
            if members is None:
                out[rows, seg.rows.get("pos")[rows, cols - start]] = cols
            else:
                mpos, owner = members
                out[rows[owner], mpos] = cols[owner]
            start += seg.rows.width
        return out.view(self.batch, self.kv_heads, positions)

    def _split(self, padded: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``(B, H, T, ...)`` tensor aligned with ``view()`` into per-segment ``(BH, w, ...)``."""
        flat = padded.reshape(self.batch * self.kv_heads, padded.shape[2], *padded.shape[3:])
        out, start = [], 0
        for seg in self.segments:
            out.append(flat[:, start : start + seg.rows.width])
            start += seg.rows.width
        return out

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on this layer's device (itself if there): state another layer made, across GPUs."""
        return x.to(self.device)

    # --- per-token technique state --------------------------------------------------------
    def state(self, st: TokenState) -> torch.Tensor:
        """Per-token state laid out like ``view()``: ``(B, H, T, *shape)``, ``st.fill`` where never set."""
        parts = []
        for seg in self.segments:
            seg.rows.ensure(st.name, st.shape, torch.float32, st.fill)
            parts.append(seg.rows.get(st.name))
        flat = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return flat.view(self.batch, self.kv_heads, -1, *st.shape)

    def states(self) -> list[TokenState]:
        """Every per-token state some segment of this layer holds."""
        found: dict[str, tuple[tuple[int, ...], float]] = {}
        for seg in self.segments:
            for name, field in seg.rows.fields.items():
                if name not in NOT_STATE and name != "pos":
                    found[name] = tuple(field.shape[2:]), seg.rows.fill.get(name, 0.0)
        return [TokenState(name, shape, fill) for name, (shape, fill) in found.items()]

    def add_state(self, st: TokenState, values: torch.Tensor) -> None:
        """Add ``values`` ``(B, H, T, *shape)`` (aligned with ``view()``) to the state."""
        for seg, add in zip(self.segments, self._split(values)):
            seg.rows.ensure(st.name, st.shape, torch.float32, st.fill)
            seg.rows.get(st.name).add_(add.float())

    def put_state(
        self, st: TokenState, index: tuple[Any, ...], values: torch.Tensor | float, add: float = 0
    ) -> None:
        """``state(st)[index] = values + add``, written into the store in place: where ``index``
        is basic (slices and integers) and ``values`` a tensor of its shape, the sum is written
        into the state as it is made (one operation, not a sum and a copy)."""
        state = self.state(st)
        written = False
        if add and isinstance(values, torch.Tensor) and all(isinstance(i, (slice, int)) for i in index):
            target = state[index]  # a view into the state
            if written := target.shape == values.shape:
                torch.add(values, add, out=target)
        if not written:
            state[index] = values + add if add else values
        if len(self._compressed):  # ``state`` concatenated the segments: a copy
            self.set_state(st, state)

    def set_state(self, st: TokenState, values: torch.Tensor) -> None:
        """Replace the state with ``values`` ``(B, H, T, *shape)`` aligned with ``view()``."""
        for seg, new in zip(self.segments, self._split(values)):
            seg.rows.ensure(st.name, st.shape, torch.float32, st.fill)
            seg.rows.set(st.name, new.float())

    # --- side data --------------------------------------------------------------------------
    def side(self, kind: type[S]) -> S | None:
        """The technique metadata of type ``kind`` set on this layer, or None."""
        return self._side.get(kind)  # type: ignore[return-value]

    def set_side(self, data: SideData) -> None:
        self._side[type(data)] = data

    # --- sequences ------------------------------------------------------------------------
    def position_key(self, qpos: torch.Tensor) -> tuple[Any, ...] | None:
        """A host key of what derives from positions alone for the queries at ``qpos``: set where
        every slot holds its own position (:func:`kvbench.cache.surface.every_position`) and
        ``qpos`` is the whole last chunk, else None. Stores with the same key (the layers of one
        step) have the same stored positions, chunk and protected positions, so such derivations
        can be shared."""
        last = self.last_qpos  # the engine's read passes this very tensor: no shape compared
        if (qpos is not last and qpos.shape != last.shape) or not every_position(self):
            return None
        return (self.device, self.batch, self.kv_heads, self._seen_max, last.shape[1], self.protect_from_host)

    def in_position_order(self) -> bool:
        """Positions increase along each row of ``view()``: the full-precision rows alone, in arrival
        order (no :meth:`drop` since they were last put in order)."""
        return not self._compressed and self._fp.rows.ordered

    def unprotected_in_position_order(self) -> bool:
        """The tokens that no budget protects lie in position order along each row of ``view()``:
        the full-precision rows in arrival order, and every compressed segment built from their
        oldest tokens (:attr:`Segment.IN_MOVE_ORDER`; only the sinks, kept in the full-precision
        rows and always kept, then lie out of place). Ties broken by slot are then broken by
        position (:func:`kvbench.select.evict_by_score`), and a router's write takes its new
        tokens in arrival order (:meth:`kvbench.routers.centroids.CentroidExperts.assign_new`)."""
        return self._fp.rows.ordered and all(seg.IN_MOVE_ORDER for seg in self._compressed)

    # --- accounting -----------------------------------------------------------------------
    def nbytes(self) -> int:
        side = [t for data in self._side.values() for t in data.tensors()]
        return sum(s.nbytes() for s in self.segments) + nbytes(*side)

    def aux_nbytes(self) -> int:
        return sum(s.aux_nbytes() for s in self.segments)

    def stored_tokens(self) -> int:
        return sum(s.size for s in self.segments)

    def columns(self) -> int:
        """The columns of :meth:`view` (its ``T``: every segment's slots side by side), from host
        figures, without making the view."""
        if not self._compressed:  # the full-precision rows alone (every decode step of most stacks)
            return self._fp.rows.width
        return sum(s.rows.width for s in self.segments)

    def uniform_tokens(self) -> int | None:
        """Stored tokens of every head-row when all hold the same number (known on the host), else None."""
        if not self._compressed:
            rows = self._fp.rows
            return rows.width if rows.uniform else None
        segs = self.segments
        return sum(s.rows.width for s in segs) if all(s.rows.uniform for s in segs) else None

    def row_tokens_host(self) -> list[int] | None:
        """:meth:`row_tokens` on the host, where every segment's rows know their lengths there
        (:attr:`Rows.lens_host`), else None."""
        total = [0] * (self.batch * self.kv_heads)
        for seg in self.segments:
            lens = seg.rows.lens_host
            if lens is None:
                return None
            total = [a + b for a, b in zip(total, lens)]
        return total

    def row_tokens(self) -> torch.Tensor:
        """Stored tokens per head-row ``(B * H,)``."""
        return sum((s.lens for s in self.segments), torch.zeros_like(self._fp.lens))


def _kept_counts(
    segs: list[Any], parts: list[torch.Tensor], bh: int
) -> list[tuple[torch.Tensor, torch.Tensor, list[int], list[int]] | None]:
    """Per segment: the slots ``parts`` keep among its live ones ``(BH, w)``, their count in each
    head-row ``(BH,)``, and that count and the live tokens of each head-row on the host, every
    segment's read in one synchronisation."""
    keeps = [keep if seg.rows.uniform else keep & seg.rows.valid() for seg, keep in zip(segs, parts)]
    lens = [keep.sum(-1) for keep in keeps]
    known = [seg.rows.lens_host for seg in segs]  # every row full, or counted before
    live = [seg.rows.lens for seg, held in zip(segs, known) if held is None]
    counts = [*lens, *live]
    flat = (counts[0] if len(counts) == 1 else torch.cat(counts)).tolist()
    rows = [flat[i * bh : (i + 1) * bh] for i in range(len(lens) + len(live))]
    read = iter(rows[len(lens) :])
    return [
        (keep, n, per_row, held if held is not None else next(read))
        for keep, n, per_row, held in zip(keeps, lens, rows, known)
    ]
