"""kvbench's merge ("distillation"): old tokens of each head-row become k-means centroids on keys,
read with ToMe's proportional attention (docs/methods.md; arXiv:2210.09461; related: CaM, D2O).

At every compression point, each head-row (one sequence, one KV head) holding more old units than
its budget allows is re-merged: its old units (stored units that are not sinks, window or
protected positions, in every segment, earlier merged units included) are clustered into
``M = capacity - protected`` centroids by a few weighted Lloyd iterations on keys, initialized at
units evenly spaced in position order, so the head-row stores exactly its budget of units. A
centroid stores the mean key and the mean value of its member tokens (an earlier merged unit
weighs by its count, so re-merging weights every original token equally), its member count, and
reads with ``log(count)`` added to its attention logit: a unit of ``c`` identical tokens then gets
exactly the attention mass of the ``c`` tokens. A unit's position is its latest member's.
Per-token technique state (e.g. H2O's accumulated attention) is summed over a unit's members, the
mass the unit receives under proportional attention. Head-rows within budget are left as they are.

Where protected tokens alone fill a head-row's budget (``M = 0``), its old units are evicted. A
centroid left without members (rare; e.g. duplicate keys) keeps its place during the Lloyd
steps and is dropped at the end, so a head-row may then store fewer units than its budget. The
re-merge runs at every compression point where a head-row is over budget (each decode step once
the budget binds): a few ``S x M x D`` distance passes per head-row, blocked to bound memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.cache import ragged
from kvbench.cache.segments import Segment, flat_rows
from kvbench.cache.surface import TechniqueStore
from kvbench.compressors.kmeans import kmeans
from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.roles import Compressor, Flags
from kvbench.select import within


@dataclass
class MergedSegment(Segment):
    """Merged units. ``k``, ``v`` ``(N, D)``, ``count`` ``(N,)`` int32 member tokens per unit.

    ``mpos`` ``(sum(count),)`` holds the member positions, unit after unit: bookkeeping for the
    KV-hit probe, reported in ``aux_nbytes``, not in ``nbytes``.
    """

    IN_MOVE_ORDER = False  # its units are k-means slots, each at its latest member's position

    k: torch.Tensor = None  # type: ignore[assignment]
    v: torch.Tensor = None  # type: ignore[assignment]
    count: torch.Tensor = None  # type: ignore[assignment]
    mpos: torch.Tensor = None  # type: ignore[assignment]
    member_rows: int | None = None  # member tokens of every head-row, when the same (host), else None

    def data_fields(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "count": self.count}

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.to(dtype), self.v.to(dtype)

    def bias(self) -> torch.Tensor:
        return self.count.float().log()

    def members(self) -> tuple[torch.Tensor, torch.Tensor]:
        owner = torch.repeat_interleave(torch.arange(self.size, device=self.count.device), self.count.long())
        return self.mpos, owner

    def attend_partials(self, query: torch.Tensor, scaling: float, batch: int) -> Any:
        """On the Triton path, the decode kernel's state over the units as stored (their keys and
        values are full precision: nothing decoded), each unit's logit plus its ``log(count)`` (the
        rows' ``bias``), each head-row read to its length as :meth:`FPSegment.attend_partials` reads
        the window: no mask, no positions (the engine asks only for a step that reads every stored
        unit, and a unit stands at its latest member's position, in the query's past). None on the
        torch path: the step is decoded and attended whole with the bias, as before."""
        attention_kernels = dispatch.kernels("attention", batch, self.rows.width)
        if attention_kernels is None:
            return None
        rows = self.rows
        shape = (batch, rows.bh // batch, rows.width, query.shape[-1])
        if rows.uniform:  # every head-row holds ``width`` units: the flat units are the rectangle
            k, v, lens = self.k.view(shape), self.v.view(shape), None
        else:  # each head-row's units at its first slots (past its length: the next row's, unread)
            first = ragged.starts(self.lens)[:, None] + torch.arange(rows.width, device=self.k.device)
            at = first.clamp_(max=self.size - 1)
            k, v, lens = self.k[at].view(shape), self.v[at].view(shape), rows.lens.view(batch, -1)
        bias = rows.get("bias").view(shape[:3])
        return attention_kernels.partials(query, k, v, None, scaling, bias, lens)

    def aux_nbytes(self) -> int:
        return super().aux_nbytes() + self.mpos.numel() * self.mpos.element_size()

    def keep(self, keep: torch.Tensor) -> None:
        self.mpos = self.mpos[torch.repeat_interleave(keep, self.count.long())]
        self.member_rows = None
        super().keep(keep)

    def member_lens(self) -> torch.Tensor:
        """Member tokens per head-row ``(BH,)``."""
        rows = ragged.segment_ids(self.lens)
        return torch.zeros_like(self.lens).index_add_(0, rows, self.count.long())

    def extend(self, other: Segment) -> None:
        assert isinstance(other, MergedSegment)
        self.mpos = ragged.concat(self.mpos, self.member_lens(), other.mpos, other.member_lens())
        self.member_rows = None
        super().extend(other)


@dataclass
class _Units:
    """The selected old units of a layer, flat and head-major (``lens`` ``(BH,)`` per head-row)."""

    k: torch.Tensor  # (S, D) fp32
    v: torch.Tensor  # (S, D) fp32
    count: torch.Tensor  # (S,) long member tokens
    pos: torch.Tensor  # (S,)
    lens: torch.Tensor  # (BH,)
    aux: dict[str, torch.Tensor]  # name -> (S, *rest)
    mpos: torch.Tensor  # (Mm,) member positions
    munit: torch.Tensor  # (Mm,) owning selected unit


def _padded(store: TechniqueStore, flats: list[torch.Tensor]) -> torch.Tensor:
    """Per-segment flat tensors laid out like ``store.view()``: ``(B * H, T)``."""
    parts = []
    for seg, flat in zip(store.segments, flats):
        valid = seg.rows.valid()
        part = flat.new_zeros(valid.shape)
        part[valid] = flat
        parts.append(part)
    return torch.cat(parts, dim=1)


def _members(store: TechniqueStore, seg, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Member positions of a segment's units with the (head-row, view column) owning each."""
    rows, col = seg.rows.valid().nonzero(as_tuple=True)
    col = col + start
    members = seg.members()
    if members is None:
        return flat_rows(seg)[1], rows, col
    mpos, owner = members
    return mpos, rows[owner], col[owner]


def _leading_merged(store: TechniqueStore) -> MergedSegment | None:
    """The store's first segment when it holds merged units, else None."""
    first = store.segments[0]
    return first if isinstance(first, MergedSegment) else None


def same_everywhere(store: TechniqueStore, merged: MergedSegment | None, figures: list[list[int]]) -> bool:
    """Whether a merge can go in rectangles (:func:`gather_rows`, ``merge_units(whole=)``): the
    store holds the full-precision rows after at most ``merged``, every segment's head-rows hold the
    same number of units, and ``figures`` (per head-row: old units, slots, old units of ``merged``)
    say every head-row is over budget by the same figures, every merged unit among its old ones."""
    n_old, n_slots, n_merged_old = figures
    per_row, width = n_old[0], n_slots[0]
    w0 = 0 if merged is None else merged.rows.width
    return (
        store.view().dense
        and len(store.segments) == 1 + (merged is not None)
        and (merged is None or merged.member_rows is not None)
        and all(o == per_row for o in n_old)
        and all(m == width for m in n_slots)
        and all(m == w0 for m in n_merged_old)
        and 0 < width < per_row
    )


def gather_units(store: TechniqueStore, sel: torch.Tensor) -> _Units:
    """Keys, values, member counts, positions, state and members of the units where ``sel`` ``(B, H, T)``."""
    view = store.view()
    bh = store.batch * store.kv_heads
    flat_sel = sel.reshape(bh, -1)
    uid = torch.full(flat_sel.shape, -1, dtype=torch.long, device=store.device)
    uid[flat_sel] = torch.arange(int(flat_sel.sum()), device=store.device)
    counts, mpos, munit, start = [], [], [], 0
    for seg, width in zip(store.segments, view.widths):
        pos, rows, col = _members(store, seg, start)
        owner = uid[rows, col]
        mpos.append(pos[owner >= 0])
        munit.append(owner[owner >= 0])
        members = seg.members()
        ones = torch.ones(seg.size, dtype=torch.long, device=store.device)
        counts.append(ones if members is None else torch.bincount(members[1], minlength=seg.size))
        start += width
    return _Units(
        k=view.k[sel].float(),
        v=view.v[sel].float(),
        count=_padded(store, counts)[flat_sel],
        pos=view.pos[sel],
        lens=flat_sel.sum(-1),
        aux={st.name: store.state(st)[sel] for st in store.states()},
        mpos=torch.cat(mpos),
        munit=torch.cat(munit),
    )


def gather_rows(
    store: TechniqueStore, sel: torch.Tensor, per_row: int, merged: MergedSegment | None
) -> _Units:
    """:func:`gather_units` where every head-row selects ``per_row`` units, every unit of ``merged``
    (the store's first segment, its member count per head-row known) among them, and every
    segment's head-rows hold the same number: known on the host, so no synchronisation. The same
    units in the same order."""
    view = store.view()
    bh, t = store.batch * store.kv_heads, view.pos.shape[2]
    flat = sel.reshape(bh, t)
    # the selected columns, in order (a stable sort, descending: ties keep their order)
    cols = torch.argsort(flat.to(torch.int8), dim=-1, descending=True, stable=True)[:, :per_row]

    def pick(x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, H, T, *rest)`` at the selected columns: ``(BH * per_row, *rest)``."""
        x = x.reshape(bh, t, *x.shape[3:])
        index = cols.view(bh, per_row, *[1] * (x.dim() - 2)).expand(bh, per_row, *x.shape[2:])
        return torch.gather(x, 1, index).reshape(bh * per_row, *x.shape[2:])

    device = store.device
    pos = pick(view.pos)
    units = torch.arange(bh, device=device)[:, None] * per_row  # the first unit id of each head-row
    w0 = 0 if merged is None else merged.rows.width
    counts = [torch.ones(bh, t - w0, dtype=torch.long, device=device)]
    mpos = [pos.view(bh, per_row)[:, w0:].reshape(-1)]  # a token is its own member
    munit = [(units + torch.arange(w0, per_row, device=device)).reshape(-1)]
    if merged is not None:  # its units are the first w0 selected of each head-row
        assert merged.member_rows is not None
        counts.insert(0, merged.count.long().view(bh, w0))
        owner = torch.repeat_interleave(
            torch.arange(bh * w0, device=device), merged.count.long(), output_size=bh * merged.member_rows
        )
        mpos.insert(0, merged.mpos)
        munit.insert(0, owner // w0 * per_row + owner % w0)
    return _Units(
        k=pick(view.k).float(),
        v=pick(view.v).float(),
        count=torch.gather(torch.cat(counts, dim=1), 1, cols).reshape(-1),
        pos=pos,
        lens=ragged.tell(torch.full((bh,), per_row, device=device), per_row),
        aux={st.name: pick(store.state(st)) for st in store.states()},
        mpos=torch.cat(mpos),
        munit=torch.cat(munit),
    )


def merge_units(
    units: _Units, slot: torch.Tensor, width: int, dtype: torch.dtype, whole: int | None = None
) -> tuple[MergedSegment, dict[str, torch.Tensor]]:
    """One merged unit per non-empty (head-row, slot): mean key, mean value, summed count, and the
    summed per-token state (flat, returned beside the segment).

    ``slot`` ``(S,)`` is each unit's cluster within its head-row (-1: dropped); ``width`` bounds it.
    ``whole``: known on the host, every unit is live and every (head-row, slot) has one, and no
    position reaches ``whole``: each cell is then a merged unit, found with no synchronisation
    (the same floats, summed in the same order).
    """
    bh = units.lens.numel()
    if whole is not None:
        per_row = units.pos.numel() // max(1, bh)
        gid = torch.arange(bh, device=slot.device).repeat_interleave(per_row) * width + slot
        n, lens = bh * width, ragged.tell(torch.full((bh,), width, device=slot.device), width)
        g, cnt, k, v, pos, aux = gid, units.count, units.k, units.v, units.pos, units.aux
        mg, mpos, span = gid[units.munit], units.mpos, whole
    else:
        row = ragged.segment_ids(units.lens)
        live = slot >= 0
        cell = row * width + slot.clamp(min=0)
        filled = torch.zeros(bh * width, dtype=torch.bool, device=slot.device)
        filled[cell[live]] = True
        gid_of_cell = filled.long().cumsum(0) - 1
        n, lens = int(filled.sum()), filled.view(bh, width).sum(-1)
        gid = torch.where(live, gid_of_cell[cell], torch.full_like(cell, -1))
        g, cnt, k, v, pos = gid[live], units.count[live], units.k[live], units.v[live], units.pos[live]
        aux = {name: val[live] for name, val in units.aux.items()}
        mg = gid[units.munit]
        mlive = mg >= 0
        mg, mpos = mg[mlive], units.mpos[mlive]
        span = int(units.mpos.max()) + 1 if units.mpos.numel() else 1
    count = torch.zeros(n, dtype=torch.long, device=slot.device).index_add_(0, g, cnt)
    w = cnt.float()[:, None]
    ksum = torch.zeros(n, k.shape[1], device=slot.device).index_add_(0, g, k * w)
    vsum = torch.zeros(n, v.shape[1], device=slot.device).index_add_(0, g, v * w)
    latest = torch.full((n,), -1, dtype=pos.dtype, device=slot.device).scatter_reduce(
        0, g, pos, reduce="amax"
    )
    state = {
        name: torch.zeros(n, *val.shape[1:], device=slot.device).index_add_(0, g, val.float())
        for name, val in aux.items()
    }
    order = (mg * span + mpos).argsort()  # members unit after unit, each unit's in position order
    seg = MergedSegment(
        lens=lens,
        pos=latest,
        k=(ksum / count[:, None]).to(dtype),
        v=(vsum / count[:, None]).to(dtype),
        count=count.to(torch.int32),
        mpos=mpos[order],
    )
    return seg, state


@dataclass
class DistillationCompressor(Compressor):
    """Merges each head-row's old tokens into k-means centroids read with a ``log(count)`` bias.

    Args:
        iters: Lloyd iterations per merge (>= 0; 0 keeps the evenly spaced initial centroids).
    """

    name: str = "distillation"
    iters: int = 3
    flags = Flags(evicts_tokens=True)
    _units: list[int] = field(default_factory=lambda: [0, 0], init=False, repr=False)  # merged units, tokens

    def check_knobs(self) -> None:
        if self.iters < 0:
            raise ConfigError(f"compressor.iters={self.iters}: must be >= 0")

    def compress(self, layer: int, store: TechniqueStore) -> None:
        if within(store, self.budget.capacity_host):  # no head-row over budget: nothing to merge
            return
        view = store.view()
        protected = self.budget.protected_view(store) & view.valid
        old = view.valid & ~protected
        slots = (self.budget.capacity(store.seen)[:, None] - protected.sum(-1)).clamp(min=0)  # (B, H)
        merged = _leading_merged(store)
        w0 = 0 if merged is None else merged.rows.width
        # the one synchronisation: old units and slots per head-row, and old units among the merged
        figures = torch.stack([old.sum(-1), slots, old[..., :w0].sum(-1)]).view(3, -1).tolist()
        n_old, n_slots, _ = figures
        if not any(o > m for o, m in zip(n_old, n_slots)):
            return
        if same_everywhere(store, merged, figures):
            self._merge_rows(store, old, merged, per_row=n_old[0], width=n_slots[0])
        else:
            self._merge(store, old, slots)

    def _merge_rows(
        self, store: TechniqueStore, sel: torch.Tensor, merged: MergedSegment | None, per_row: int, width: int
    ) -> None:
        """Re-merge the ``per_row`` old units ``sel`` of every head-row into ``width`` centroids, in
        rectangles (:func:`same_everywhere`): one read, whether every centroid has members."""
        units = gather_rows(store, sel, per_row, merged)
        bh = store.batch * store.kv_heads
        slot = kmeans(
            units.k,
            units.count,
            units.pos,
            units.lens,
            torch.full_like(units.lens, width),
            self.iters,
            uniform=(per_row, width),
        )
        filled = torch.zeros(bh * width, dtype=torch.bool, device=store.device)
        filled[torch.arange(bh, device=store.device).repeat_interleave(per_row) * width + slot] = True
        if not bool(filled.all()):  # a centroid left without members: the general merge drops it
            seg, state = merge_units(units, slot, width, store.dtype)
            self._replace(store, sel, seg, state)
            return
        seg, state = merge_units(units, slot, width, store.dtype, whole=store.seen_max)
        w0, m0 = (0, 0) if merged is None else (merged.rows.width, merged.member_rows or 0)
        seg.member_rows = m0 + per_row - w0  # the merged units' members and the old tokens
        fp_kept = store.fp.rows.width - (per_row - w0)
        store.replace(sel, seg, state, kept=[0, fp_kept] if merged is not None else [fp_kept], per_row=width)
        self._account(bh * width, bh * seg.member_rows)

    def _merge(self, store: TechniqueStore, old: torch.Tensor, slots: torch.Tensor) -> None:
        """Re-merge every head-row over budget, in any layout (ragged head-rows, several segments)."""
        need = old.sum(-1) > slots
        sel = old & need[..., None]
        units = gather_units(store, sel)
        slots = torch.where(need, slots, torch.zeros_like(slots)).reshape(-1)
        slot = kmeans(units.k, units.count, units.pos, units.lens, slots, self.iters)
        merged, state = merge_units(units, slot, max(1, int(slots.max())), store.dtype)
        self._replace(store, sel, merged, state)

    def _replace(self, store: TechniqueStore, sel: torch.Tensor, seg: MergedSegment, state) -> None:
        """Store ``seg`` in place of the units ``sel``, in any layout; the merged segment then learns
        its member tokens per head-row (read once), so that the next merge can go uniform."""
        store.replace(sel, seg, state)
        self._account(seg.size, int(seg.count.sum()))
        kept = _leading_merged(store)
        if kept is not None:
            kept.member_rows = ragged.same_count(kept.member_lens())

    def _account(self, units: int, tokens: int) -> None:
        self._units[0] += units
        self._units[1] += tokens

    def metrics(self) -> dict[str, float | list[float] | None]:
        units, tokens = self._units
        return {"tokens_per_merged_unit": tokens / units if units else None}
