"""Write routing into running centroids (online k-means), shared by ``topk_balanced``, ``pikv`` and
``eplb``.

A token is assigned once, when it becomes routable (it leaves the sinks/window/protected set):
to the nearest running centroid of its head-row. The assignment is per-token state ``expert``
(expert id + 1; 0 = not assigned yet) that follows the token through compression and eviction.
The centroids ``(B, H, E, D)`` fp32 and the running counts ``(B, H, E)`` fp32 live in
``store.side``, so their bytes are counted.

Seeding: a head-row with no centroid whose first batch holds at least E tokens starts from a few
Lloyd iterations over that batch (initialised by position blocks); otherwise each expert that has
never held a token is seeded by one new token (MacQueen's online k-means).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.cache import attention as att
from kvbench.cache import devices
from kvbench.cache.side import SideData, TokenState
from kvbench.cache.surface import TechniqueStore, every_position
from kvbench.roles import Budget
from kvbench.routers.expert import (
    ExpertRouter,
    Experts,
    block_means,
    expert_ids,
    expert_onehot,
    expert_sums,
    first_chosen,
    paged_columns,
    position_blocks,
    routable_columns,
    unprotected_columns,
)

EXPERT = TokenState("expert")  # 1 + the token's expert, 0 while unassigned


@dataclass
class Centroids(SideData):
    """Running centroids ``(B, H, E, D)`` and their member counts ``(B, H, E)``.

    Two host figures ride along (not stored): ``full``, every expert of every head-row has held a
    token (counts only grow, so it stays so once seen); ``assigned``, where every slot has held
    its own position since the first write, the end of the assigned columns: every column from
    the sinks up to it holds an assignment and no other does (None: not known).
    """

    centroid: torch.Tensor
    count: torch.Tensor
    full: bool = False
    assigned: int | None = None


@dataclass
class Assigned:
    """What a write assigned: every token's expert ``held`` ``(B, H, T)`` (-1: none) and the tokens
    assigned now ``new`` ``(B, H, T)`` bool; or, where the host knows it, the one ``column``
    assigned in every head-row and its ``expert`` there ``(B, H, 1)``. All None: the host knows
    nothing was assigned."""

    held: torch.Tensor | None = None
    new: torch.Tensor | None = None
    column: int | None = None
    expert: torch.Tensor | None = None


LLOYD_ITERS = 3


def held_experts(store: TechniqueStore, experts: int) -> torch.Tensor:
    """Stored assignment ``(B, H, T)`` aligned with ``store.view()``: expert id, -1 if none.

    The stored values are whole numbers (``1 + expert``, or sums of them where
    :mod:`kvbench.compressors.distillation` merged tokens, which sums every per-token state), exact
    in float32 and never negative: converted as they are, and capped at ``experts``."""
    return store.state(EXPERT).long().clamp(max=experts) - 1


_COLUMN_OF: dict[tuple[int, object], torch.Tensor] = {}


def held_columns(store: TechniqueStore, experts: int) -> torch.Tensor:
    """:func:`held_experts` with ``experts`` (not -1) where none: the column of a padded choice
    each token reads (:attr:`Experts.column`) where the assigned tokens are the routed ones.

    The capped stored value is looked up in ``[E, 0, 1, ..., E - 1]`` (made once per process and
    device, read-only), one operation for the two of ``value - 1`` with none at ``E``."""
    state = store.state(EXPERT)
    key = (experts, devices.device_of(state))
    table = _COLUMN_OF.get(key)
    if table is None:
        table = _COLUMN_OF[key] = (torch.arange(experts + 1, device=state.device) + experts) % (experts + 1)
    return table[state.long().clamp(max=experts)]


# Columns a kept copy of :func:`held_columns` holds past the width when made: the decode steps that
# follow append into it (a column each) before it is made again.
COLUMN_ROOM = 64


def write_columns(budget: Budget, store: TechniqueStore) -> tuple[int, int] | None:
    """The tokens a write routes (valid, not protected) as the columns ``lo .. hi - 1`` of every
    head-row, where every slot holds its own position
    (:func:`kvbench.cache.surface.every_position`) with one protected start; None elsewhere."""
    return unprotected_columns(budget, store, store.seen_max) if every_position(store) else None


def sq_dist(keys: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """Squared distance ``(B, H, T, E)`` from keys ``(B, H, T, D)`` to centroids ``(B, H, E, D)``,
    as ``|k|² - 2 k·c + |c|²`` (one product for every key)."""
    cross = keys @ cent.transpose(-1, -2)
    # |k|² - 2·cross in one operation: doubling is exact, so it rounds as the two did
    near = torch.sub(keys.square().sum(-1, keepdim=True), cross, alpha=2)
    return near + cent.square().sum(-1)[:, :, None, :]


def one_dist(key: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """Distance ``(B, H, 1, E)`` from one key ``(B, H, 1, D)`` per head-row to the centroids
    ``(B, H, E, D)``: the norm of the differences, two operations (the form of :func:`sq_dist`
    takes seven). Its order is the squared distances' up to rounding."""
    return torch.linalg.vector_norm(cent - key, dim=-1)[:, :, None, :]


def lloyd(keys: torch.Tensor, pos: torch.Tensor, member: torch.Tensor, experts: int) -> torch.Tensor:
    """k-means centroids ``(B, H, E, D)`` of the ``member`` keys, from position blocks."""
    cent = block_means(keys, position_blocks(pos, member, experts), member, experts)
    for _ in range(LLOYD_ITERS):
        eid = sq_dist(keys, cent).argmin(-1)
        onehot = expert_onehot(eid, member, experts)
        size = onehot.sum(2)
        mean = expert_sums(onehot, keys) / size.clamp(min=1)[..., None]
        cent = torch.where(size[..., None] > 0, mean, cent)  # an emptied cluster keeps its centroid
    return cent


def seed(
    keys: torch.Tensor,
    pos: torch.Tensor,
    new: torch.Tensor,
    cent: torch.Tensor,
    defined: torch.Tensor,
    by_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give undefined experts a centroid from the new tokens, the earliest new tokens first.

    Args:
        keys: ``(B, H, T, D)`` fp32; pos, new: ``(B, H, T)``; cent: ``(B, H, E, D)``;
            defined: ``(B, H, E)`` experts that hold a centroid.
        by_pos: the columns in position order where the slots are not in it (after drops).

    Returns:
        ``cent``, ``defined`` and ``seeded`` ``(B, H, T)`` (the expert a new token seeded, or -1).
    """
    experts = cent.shape[2]
    fresh = ~defined.any(-1) & (new.sum(-1) >= experts)  # (B, H)
    if bool(fresh.any()):
        cent = torch.where(fresh[..., None, None], lloyd(keys, pos, new & fresh[..., None], experts), cent)
        defined = defined | fresh[..., None]
    undefined = ~defined
    if by_pos is None:
        rank = new.long().cumsum(-1) - 1  # order of the new tokens within the row
    else:  # counted in position order, then back to the slots
        ranked = new.gather(-1, by_pos).long().cumsum(-1) - 1
        rank = torch.empty_like(ranked).scatter_(-1, by_pos, ranked)
    seeding = new & (rank < undefined.sum(-1, keepdim=True))
    free = (~undefined).long().argsort(dim=-1, stable=True)  # undefined experts first
    seeded = torch.where(seeding, free.gather(-1, rank.clamp(0, experts - 1)), torch.full_like(rank, -1))
    onehot = expert_onehot(seeded, seeding, experts)
    got = onehot.sum(2) > 0
    cent = torch.where(got[..., None], expert_sums(onehot, keys), cent)
    return cent, defined | got, seeded


class CentroidExperts:
    """Mixin for an :class:`~kvbench.routers.expert.ExpertRouter`: nearest-running-centroid write.

    Subclasses may override :meth:`place` (default: nearest defined centroid) and
    :meth:`update` (default: running mean over every token ever assigned), with their one-token
    forms :meth:`place_one` and :meth:`update_one`.
    """

    num_experts: int
    top_k: int
    budget: Budget
    _held: dict[int, tuple[Any, torch.Tensor]]  # declared by ExpertRouter
    _columns: dict[int, tuple[Any, torch.Tensor]]  # declared by ExpertRouter

    def all_held(self, store: TechniqueStore, count: torch.Tensor) -> bool:
        """Known on the host that every expert holds a token: ``count`` is the centroids' counts
        (:meth:`route_experts`'s fast path) and every expert has held one. Every score is then
        finite (no expert is masked empty)."""
        side = store.side(Centroids)
        return side is not None and side.full and count is side.count

    def held(self, layer: int, store: TechniqueStore) -> torch.Tensor:
        """:func:`held_experts`, read once per view: the read of a step and its write share it."""
        held = self._held
        view = store.view()
        cached = held.get(layer)
        if cached is None or cached[0] is not view:
            cached = held[layer] = (view, held_experts(store, self.num_experts))
        return cached[1]

    def experts(self, layer: int, store: TechniqueStore, routable: torch.Tensor) -> torch.Tensor:
        return torch.where(routable, self.held(layer, store), -1)

    def route_experts(self, layer: int, store: TechniqueStore, qpos: torch.Tensor) -> Experts:
        """Where every slot has held its own position since the first write (the assigned columns
        are known, :attr:`Centroids.assigned`) and all of them are routable now, the routed tokens
        are exactly the assigned ones: the experts' sizes are the centroids' counts and, once every
        expert has held a token, none is empty. Else as any router's."""
        side = store.side(Centroids)
        cols = routable_columns(self.budget, store, qpos)
        if side is None or not side.full or side.assigned is None or cols is None or cols[1] < side.assigned:
            return ExpertRouter.route_experts(self, layer, store, qpos)  # type: ignore[arg-type]
        column = self.kept_columns(layer, store, side)[:, :, None, :]
        return Experts(side.count, column=column, none_empty=True, routed_host=side.assigned - cols[0])

    def kept_columns(self, layer: int, store: TechniqueStore, side: Centroids) -> torch.Tensor:
        """:func:`held_columns` ``(B, H, T)``, kept per layer while each write assigns one column
        (:meth:`_assign_column` writes that column's experts into the copy: one operation a step,
        not three over every token). The copy stands while ``side`` is the layer's centroids (a
        write that assigns otherwise, or a new sequence, replaces them) and holds the width; it is
        made again, with :data:`COLUMN_ROOM` columns of room, where not. Columns past the
        assigned ones hold ``E``, as the tokens appended since (not assigned yet) read."""
        width = store.columns()
        kept = self._columns.get(layer)
        if kept is None or kept[0]() is not side or kept[1].shape[-1] < width:
            held = held_columns(store, self.num_experts)
            copy = held.new_full((*held.shape[:2], width + COLUMN_ROOM), self.num_experts)
            copy[..., :width] = held
            kept = self._columns[layer] = (weakref.ref(side), copy)
        return kept[1][..., :width]

    def summarize(self, layer: int, store: TechniqueStore, experts: Experts) -> torch.Tensor:
        return self.state(store)[0]

    def read_pages(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> att.Pages | None:
        """:meth:`read_mask` as the experts each query reads, for a kernel whose grid covers those
        experts' tokens and the columns always read only (as :meth:`PositionExperts.read_pages`).
        An expert is a set of slots, not a run: the routed columns are listed expert by expert
        (:attr:`att.Pages.order`, one stable sort of their experts), the columns not assigned yet
        last, as page ``E``, which every query reads (the mask reads them too). Where the routed
        columns are known on the host, in a one-token step, and a query reads fewer than ``E``
        experts; None elsewhere (the engine then asks :meth:`read_mask`)."""
        k, experts = self.top_k, self.num_experts
        cols = paged_columns(self.budget, store, qpos, k, experts)
        if cols is None:
            return None
        routing = self.route(layer, store, query, qpos)  # type: ignore[attr-defined]
        lo, hi = cols
        held, order = routing.experts.column[:, :, 0, lo:hi].sort(dim=-1, stable=True)  # (B, H, n)
        ids = expert_ids(experts + 2, held).expand(*held.shape[:2], experts + 2)
        bounds = torch.searchsorted(held, ids.contiguous())
        first = first_chosen(routing.chosen, k, then=experts)  # the first k chosen, then E (unassigned)
        return att.Pages(first, hi - lo, lo, hi, lo, experts + 1, order=order.add_(lo), bounds=bounds)

    def state(self, store: TechniqueStore) -> tuple[torch.Tensor, torch.Tensor]:
        """Running centroids ``(B, H, E, D)`` and counts ``(B, H, E)`` (zeros before any write)."""
        side = store.side(Centroids)
        if side is None:
            shape = (store.batch, store.kv_heads, self.num_experts)
            side = Centroids(
                torch.zeros(*shape, store.head_dim, device=store.device),
                torch.zeros(*shape, device=store.device),
            )
            store.set_side(side)
        return side.centroid, side.count

    def write(self, layer: int, store: TechniqueStore) -> None:
        """Write routing: tokens leaving the window join an expert (the routing is stale after)."""
        self.forget(layer)  # type: ignore[attr-defined]
        self.assign_new(layer, store)
        self._held.pop(layer, None)

    def assign_new(self, layer: int, store: TechniqueStore) -> Assigned:
        """Assign the tokens that became routable.

        Where every slot holds its own position, the columns that became routable since the last
        write are known on the host (:attr:`Centroids.assigned`): none, or one per head-row (a
        decode step) once every expert holds a centroid, is then assigned without reading the
        device (:meth:`_assign_column`). Elsewhere one host read decides.

        Returns:
            what was assigned (:class:`Assigned`).
        """
        side = store.side(Centroids)
        cols = write_columns(self.budget, store)
        if cols is not None and side is not None and side.full and side.assigned is not None:
            first = max(side.assigned, cols[0])
            if cols[1] <= first:
                return Assigned()
            if cols[1] == first + 1:
                return self._assign_column(layer, store, side, first)
        out = self._assign_read(layer, store, side)
        after = store.side(Centroids)
        if after is not None:  # every routable token now holds an assignment
            if cols is None or (side is not None and side.assigned is None):
                after.assigned = None
            else:  # no assignment before the first write; later ones below the last end
                after.assigned = cols[1] if side is None else max(cols[1], side.assigned or 0)
        return out

    def _assign_read(self, layer: int, store: TechniqueStore, side: Centroids | None) -> Assigned:
        """:meth:`assign_new` with one host read: anything to assign, every expert defined, and at
        most one new token per head-row (a decode step)."""
        view = store.view()
        routable = view.valid & ~self.budget.protected_view(store)
        held = self.held(layer, store)
        new = routable & (held < 0)
        # One host read for the decisions: anything to assign, and (centroids held) every expert
        # defined and at most one new token per row. No centroids exist before the first write.
        checks = [new.any()]
        if side is not None:
            checks += [(side.count > 0).all(), (new.sum(-1) <= 1).all()]
        flags = torch.stack(checks).tolist()
        if side is not None and flags[1]:
            side.full = True
        if not flags[0]:
            return Assigned(torch.where(view.valid, held, torch.full_like(held, -1)), new)
        cent, count = self.state(store)
        if side is not None and flags[1] and flags[2]:
            return Assigned(self._assign_one(layer, store, new, cent, count), new)
        keys = view.k.float()
        # the new tokens in arrival order where drops (or a merge) left the slots out of it
        by_pos = None if store.unprotected_in_position_order() else store.by_position()
        cent, defined, seeded = seed(keys, view.pos, new, cent, count > 0, by_pos)
        eid = self.place(keys, cent, defined, new, seeded, held, view.valid, by_pos)
        cent, count = self.update(cent, count, keys, eid, new, view.pos)
        self._set_centroids(store, cent, count)
        held = torch.where(new, eid, held)
        store.set_state(EXPERT, (held + 1).float())
        return Assigned(torch.where(view.valid, held, torch.full_like(held, -1)), new)

    @staticmethod
    def _set_centroids(store: TechniqueStore, cent: torch.Tensor, count: torch.Tensor) -> None:
        """Store updated centroids and counts, with the host figures of the ones they replace."""
        side = store.side(Centroids)
        full, assigned = (False, None) if side is None else (side.full, side.assigned)
        store.set_side(Centroids(cent.contiguous(), count.contiguous(), full, assigned))

    def _assign_column(self, layer: int, store: TechniqueStore, side: Centroids, col: int) -> Assigned:
        """:meth:`assign_new` of the one token that became routable in every head-row, at column
        ``col`` (known on the host), every expert holding a centroid: as :meth:`_assign_one` (the
        same arithmetic on the same values), without finding the column on the device.

        Returns:
            ``col`` and the expert each head-row put there.
        """
        one = store.keys()[:, :, col : col + 1].float()  # (B, H, 1, D)
        placed = self.place_one(layer, store, one_dist(one, side.centroid), None)  # (B, H, 1)
        cent, count = self.update_one(side.centroid, side.count, one, placed)
        after = Centroids(cent.contiguous(), count.contiguous(), True, col + 1)
        store.set_side(after)
        store.put_state(EXPERT, (slice(None), slice(None), slice(col, col + 1)), placed, add=1)
        kept = self._columns.get(layer)
        if kept is not None and kept[0]() is side and kept[1].shape[-1] > col:  # the kept columns
            # (:meth:`kept_columns`) follow: the column's experts, as the state holds them
            kept[1][..., col : col + 1] = placed
            self._columns[layer] = (weakref.ref(after), kept[1])
        return Assigned(column=col, expert=placed)

    def _assign_one(
        self, layer: int, store: TechniqueStore, new: torch.Tensor, cent: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`assign_new` when every expert holds a centroid (nothing to seed) and each head-row
        has at most one new token (a decode step): the new token's distances, placement
        (:meth:`place_one`), centroid update and stored expert touch that token alone, so a step
        costs O(E·D) per head-row here, not O(T·D). (The one-token forms round differently from
        the batch forms: the distance is the norm of the differences (:func:`one_dist`), and the
        update one interpolation (:meth:`update_one`); they agree with them at float tolerance,
        which decides a placement only between centroids equidistant within it.)

        Returns:
            the assignment ``(B, H, T)`` as :meth:`assign_new`.
        """
        view = store.view()
        held = self.held(layer, store)
        col = new.long().argmax(-1, keepdim=True)  # (B, H, 1): the row's new token, if any
        one = view.k.gather(2, col[..., None].expand(-1, -1, 1, view.k.shape[-1])).float()
        one_new = new.gather(-1, col)
        placed = self.place_one(layer, store, one_dist(one, cent), one_new)  # (B, H, 1)
        cent, count = self.update(cent, count, one, placed, one_new, view.pos.gather(-1, col))
        self._set_centroids(store, cent, count)
        placed = torch.where(one_new, placed, held.gather(-1, col))
        b = torch.arange(store.batch, device=col.device)[:, None, None]
        h = torch.arange(store.kv_heads, device=col.device)[None, :, None]
        store.put_state(EXPERT, (b, h, col), (placed + 1).float())
        held = held.scatter(-1, col, placed)
        return torch.where(view.valid, held, torch.full_like(held, -1))

    def place(
        self,
        keys: torch.Tensor,
        cent: torch.Tensor,
        defined: torch.Tensor,
        new: torch.Tensor,
        seeded: torch.Tensor,
        held: torch.Tensor,
        valid: torch.Tensor,
        by_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Expert of each new token ``(B, H, T)``: its seed, else the nearest defined centroid.
        ``by_pos``: the columns in position order where the slots are not in it (a placement that
        takes the tokens one after another takes them in arrival order)."""
        dist = sq_dist(keys, cent).masked_fill(~defined[:, :, None, :], float("inf"))
        return torch.where(seeded >= 0, seeded, dist.argmin(-1))

    def place_one(
        self, layer: int, store: TechniqueStore, dist: torch.Tensor, new: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`place` of at most one new token per head-row when every centroid is defined and
        nothing is seeded: ``dist`` ``(B, H, 1, E)`` its distances, ``new`` ``(B, H, 1)`` whether
        the head-row has one (None: every head-row has one, and the routed tokens before it are
        the assigned columns, :attr:`Centroids.assigned`). Returns ``(B, H, 1)``."""
        return dist.argmin(-1)

    def update(
        self,
        cent: torch.Tensor,
        count: torch.Tensor,
        keys: torch.Tensor,
        eid: torch.Tensor,
        new: torch.Tensor,
        pos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Running mean: ``c ← (n·c + Σ new keys) / (n + m)``."""
        onehot = expert_onehot(eid, new, self.num_experts)
        m = onehot.sum(2)
        total = count + m
        mean = (cent * count[..., None] + expert_sums(onehot, keys)) / total.clamp(min=1)[..., None]
        return torch.where(m[..., None] > 0, mean, cent), total

    def update_one(
        self, cent: torch.Tensor, count: torch.Tensor, key: torch.Tensor, eid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`update` with one new key ``(B, H, 1, D)`` per head-row, in expert ``eid``
        ``(B, H, 1)``, every expert having held a token (every count positive): its expert's mean
        moves ``1 / (n + 1)`` of the way to the key (one interpolation), the other experts keep
        theirs."""
        hit = (eid[..., None] == expert_ids(self.num_experts, eid))[:, :, 0]  # (B, H, E)
        total = count + hit  # at least 1: every expert has held a token
        # c + (k - c) / (n + 1) for the hit expert, c + 0 (c exactly) for the others
        return cent.lerp(key, (hit / total)[..., None]), total
