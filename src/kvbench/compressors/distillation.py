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

import torch

from kvbench.cache import ragged
from kvbench.cache.segments import Segment
from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError
from kvbench.roles import Compressor, Flags
from kvbench.select import within

_BLOCK_ELEMS = 1 << 26  # bound on one block of unit-to-centroid distances (fp32)


@dataclass
class MergedSegment(Segment):
    """Merged units. ``k``, ``v`` ``(N, D)``, ``count`` ``(N,)`` int32 member tokens per unit.

    ``mpos`` ``(sum(count),)`` holds the member positions, unit after unit: bookkeeping for the
    KV-hit probe, reported in ``aux_nbytes``, not in ``nbytes``.
    """

    k: torch.Tensor = None  # type: ignore[assignment]
    v: torch.Tensor = None  # type: ignore[assignment]
    count: torch.Tensor = None  # type: ignore[assignment]
    mpos: torch.Tensor = None  # type: ignore[assignment]

    def data_fields(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "count": self.count}

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.to(dtype), self.v.to(dtype)

    def bias(self) -> torch.Tensor:
        return self.count.float().log()

    def members(self) -> tuple[torch.Tensor, torch.Tensor]:
        owner = torch.repeat_interleave(torch.arange(self.size, device=self.count.device), self.count.long())
        return self.mpos, owner

    def aux_nbytes(self) -> int:
        return super().aux_nbytes() + self.mpos.numel() * self.mpos.element_size()

    def keep(self, keep: torch.Tensor) -> None:
        self.mpos = self.mpos[torch.repeat_interleave(keep, self.count.long())]
        super().keep(keep)

    def member_lens(self) -> torch.Tensor:
        """Member tokens per head-row ``(BH,)``."""
        rows = ragged.segment_ids(self.lens)
        return torch.zeros_like(self.lens).index_add_(0, rows, self.count.long())

    def extend(self, other: Segment) -> None:
        assert isinstance(other, MergedSegment)
        self.mpos = ragged.concat(self.mpos, self.member_lens(), other.mpos, other.member_lens())
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


def _padded(store: LayerStore, flats: list[torch.Tensor]) -> torch.Tensor:
    """Per-segment flat tensors laid out like ``store.view()``: ``(B * H, T)``."""
    parts = []
    for seg, flat in zip(store.segments, flats):
        valid = seg.rows.valid()
        part = flat.new_zeros(valid.shape)
        part[valid] = flat
        parts.append(part)
    return torch.cat(parts, dim=1)


def _members(store: LayerStore, seg, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Member positions of a segment's units with the (head-row, view column) owning each."""
    rows, col = seg.rows.valid().nonzero(as_tuple=True)
    col = col + start
    members = seg.members()
    if members is None:
        return store.flat_rows(seg)[1], rows, col
    mpos, owner = members
    return mpos, rows[owner], col[owner]


def gather_units(store: LayerStore, sel: torch.Tensor) -> _Units:
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


def _nearest(x: torch.Tensor, c: torch.Tensor, cvalid: torch.Tensor) -> torch.Tensor:
    """Nearest valid centroid of every unit: ``x`` ``(R, n, D)``, ``c`` ``(R, M, D)`` -> ``(R, n)``."""
    r, n, _ = x.shape
    csq = c.pow(2).sum(-1)[:, None, :]  # (R, 1, M); |x|^2 is the same for every centroid
    # An invalid centroid is infinitely far: inf plus any finite product is inf, as masking gives.
    csq = csq.masked_fill(~cvalid[:, None, :], float("inf"))
    block = max(1, _BLOCK_ELEMS // max(1, r * c.shape[1]))
    out = []
    for s in range(0, n, block):
        # csq - 2·(x·c), in place: (-2·p) + csq is the same float as csq - 2·p
        dist = torch.einsum("rnd,rmd->rnm", x[:, s : s + block], c).mul_(-2).add_(csq)
        out.append(dist.argmin(-1))
    return torch.cat(out, dim=1) if out else torch.zeros(r, 0, dtype=torch.long, device=x.device)


def _means(x: torch.Tensor, w: torch.Tensor, assign: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Weighted means of ``x`` ``(R, n, D)`` per centroid; empty centroids keep ``c``."""
    idx = assign[..., None].expand_as(x)
    total = torch.zeros_like(c).scatter_add_(1, idx, x * w[..., None])
    mass = torch.zeros(c.shape[:2], device=c.device).scatter_add_(1, assign, w)
    return torch.where(mass[..., None] > 0, total / mass.clamp(min=1e-30)[..., None], c)


def kmeans(
    keys: torch.Tensor,
    weight: torch.Tensor,
    pos: torch.Tensor,
    lens: torch.Tensor,
    slots: torch.Tensor,
    iters: int,
) -> torch.Tensor:
    """Weighted k-means of each head-row's units into ``slots`` ``(BH,)`` centroids.

    Args:
        keys: ``(S, D)`` flat head-major units (``lens`` ``(BH,)`` per head-row); weight, pos ``(S,)``.
        slots: centroids per head-row; initial centroids are units evenly spaced in position order.
        iters: Lloyd iterations (assign, then re-center); they stop early at a fixed point (an
            assignment that repeats), which every further iteration would return unchanged.

    Returns:
        ``(S,)`` the centroid slot of every unit (``0 <= slot < slots``), -1 where ``slots`` is 0.
    """
    x, valid = ragged.to_padded(keys, lens)  # (R, n, D)
    w = ragged.to_padded(weight.float(), lens)[0] * valid
    key = ragged.to_padded(pos, lens, fill=torch.iinfo(pos.dtype).max)[0]
    order = key.argsort(-1)  # position order of each row's units
    slots = torch.where(lens > 0, slots, torch.zeros_like(slots))
    width = max(1, int(slots.max()))
    j = torch.arange(width, device=keys.device)
    cvalid = j[None, :] < slots[:, None]  # (R, M)
    pick = ((j[None, :] + 0.5) * lens[:, None] / slots.clamp(min=1)[:, None]).long()
    pick = pick.clamp(max=(lens - 1).clamp(min=0)[:, None])
    first = torch.gather(order, 1, pick)  # (R, M) unit index of each initial centroid
    c = torch.gather(x, 1, first[..., None].expand(-1, -1, x.shape[-1]))
    assign = _nearest(x, c, cvalid)
    for _ in range(iters):
        c = _means(x, w, assign, c)
        after = _nearest(x, c, cvalid)
        # A repeated assignment is a fixed point: the same members give the same centroids (an
        # empty one keeps its own), so every later pass would return it again.
        if torch.equal(after, assign):
            break
        assign = after
    assign = torch.where(slots[:, None] > 0, assign, torch.full_like(assign, -1))
    return ragged.from_padded(assign, valid)


def merge_units(
    units: _Units, slot: torch.Tensor, width: int, dtype: torch.dtype
) -> tuple[MergedSegment, dict[str, torch.Tensor]]:
    """One merged unit per non-empty (head-row, slot): mean key, mean value, summed count, and the
    summed per-token state (flat, returned beside the segment).

    ``slot`` ``(S,)`` is each unit's cluster within its head-row (-1: dropped); ``width`` bounds it.
    """
    bh = units.lens.numel()
    row = ragged.segment_ids(units.lens)
    live = slot >= 0
    cell = row * width + slot.clamp(min=0)
    filled = torch.zeros(bh * width, dtype=torch.bool, device=slot.device)
    filled[cell[live]] = True
    gid_of_cell = filled.long().cumsum(0) - 1
    n = int(filled.sum())
    gid = torch.where(live, gid_of_cell[cell], torch.full_like(cell, -1))
    g, cnt = gid[live], units.count[live]
    count = torch.zeros(n, dtype=torch.long, device=slot.device).index_add_(0, g, cnt)
    w = cnt.float()[:, None]
    k = torch.zeros(n, units.k.shape[1], device=slot.device).index_add_(0, g, units.k[live] * w)
    v = torch.zeros(n, units.v.shape[1], device=slot.device).index_add_(0, g, units.v[live] * w)
    pos = torch.full((n,), -1, dtype=units.pos.dtype, device=slot.device)
    pos = pos.scatter_reduce(0, g, units.pos[live], reduce="amax")
    aux = {
        name: torch.zeros(n, *val.shape[1:], device=slot.device).index_add_(0, g, val[live].float())
        for name, val in units.aux.items()
    }
    mg = gid[units.munit]
    mlive = mg >= 0
    span = int(units.mpos.max()) + 1 if units.mpos.numel() else 1
    order = (mg[mlive] * span + units.mpos[mlive]).argsort()
    seg = MergedSegment(
        lens=filled.view(bh, width).sum(-1),
        pos=pos,
        k=(k / count[:, None]).to(dtype),
        v=(v / count[:, None]).to(dtype),
        count=count.to(torch.int32),
        mpos=units.mpos[mlive][order],
    )
    return seg, aux


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

    def compress(self, layer: int, store: LayerStore) -> None:
        if within(store, self.budget.capacity_host):  # no head-row over budget: nothing to merge
            return
        view = store.view()
        protected = self.budget.protected_view(store) & view.valid
        old = view.valid & ~protected
        slots = (self.budget.capacity(store.seen)[:, None] - protected.sum(-1)).clamp(min=0)  # (B, H)
        need = old.sum(-1) > slots
        if not bool(need.any()):
            return
        sel = old & need[..., None]
        units = gather_units(store, sel)
        slots = torch.where(need, slots, torch.zeros_like(slots)).reshape(-1)
        slot = kmeans(units.k, units.count, units.pos, units.lens, slots, self.iters)
        merged, state = merge_units(units, slot, max(1, int(slots.max())), store.dtype)
        store.replace(sel, merged, state)
        self._units[0] += merged.size
        self._units[1] += int(merged.count.sum())

    def metrics(self) -> dict[str, float | list[float] | None]:
        units, tokens = self._units
        return {"tokens_per_merged_unit": tokens / units if units else None}
