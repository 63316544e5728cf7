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

from dataclasses import dataclass

import torch

from kvbench.cache.side import SideData, TokenState
from kvbench.cache.store import LayerStore
from kvbench.roles import Budget
from kvbench.routers.expert import block_means, expert_counts, expert_onehot, expert_sums, position_blocks

EXPERT = TokenState("expert")  # 1 + the token's expert, 0 while unassigned


@dataclass
class Centroids(SideData):
    """Running centroids ``(B, H, E, D)`` and their member counts ``(B, H, E)``."""

    centroid: torch.Tensor
    count: torch.Tensor


LLOYD_ITERS = 3


def held_experts(store: LayerStore, experts: int) -> torch.Tensor:
    """Stored assignment ``(B, H, T)`` aligned with ``store.view()``: expert id, -1 if none."""
    return store.state(EXPERT).round().long().clamp(0, experts) - 1


def sq_dist(keys: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """Squared distance ``(B, H, T, E)`` from keys ``(B, H, T, D)`` to centroids ``(B, H, E, D)``."""
    cross = keys @ cent.transpose(-1, -2)
    return keys.square().sum(-1, keepdim=True) - 2 * cross + cent.square().sum(-1)[:, :, None, :]


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
    keys: torch.Tensor, pos: torch.Tensor, new: torch.Tensor, cent: torch.Tensor, defined: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give undefined experts a centroid from the new tokens.

    Args:
        keys: ``(B, H, T, D)`` fp32; pos, new: ``(B, H, T)``; cent: ``(B, H, E, D)``;
            defined: ``(B, H, E)`` experts that hold a centroid.

    Returns:
        ``cent``, ``defined`` and ``seeded`` ``(B, H, T)`` (the expert a new token seeded, or -1).
    """
    experts = cent.shape[2]
    fresh = ~defined.any(-1) & (new.sum(-1) >= experts)  # (B, H)
    if bool(fresh.any()):
        cent = torch.where(fresh[..., None, None], lloyd(keys, pos, new & fresh[..., None], experts), cent)
        defined = defined | fresh[..., None]
    undefined = ~defined
    rank = new.long().cumsum(-1) - 1  # order of the new tokens within the row
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
    :meth:`update` (default: running mean over every token ever assigned).
    """

    num_experts: int
    budget: Budget

    def experts(self, layer: int, store: LayerStore, routable: torch.Tensor) -> torch.Tensor:
        held = held_experts(store, self.num_experts)
        return torch.where(routable, held, torch.full_like(held, -1))

    def summarize(
        self, layer: int, store: LayerStore, eid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return expert_counts(eid, self.num_experts), self.state(store)[0]

    def state(self, store: LayerStore) -> tuple[torch.Tensor, torch.Tensor]:
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

    def write(self, layer: int, store: LayerStore) -> None:
        """Write routing: tokens leaving the window join an expert (the routing is stale after)."""
        self.forget(layer)  # type: ignore[attr-defined]
        self.assign_new(store)

    def assign_new(self, store: LayerStore) -> tuple[torch.Tensor, torch.Tensor]:
        """Assign the tokens that became routable.

        Returns:
            the assignment ``(B, H, T)`` (-1: none) and the tokens assigned now ``(B, H, T)`` bool.
        """
        view = store.view()
        routable = view.valid & ~self.budget.protected_view(store)
        held = held_experts(store, self.num_experts)
        new = routable & (held < 0)
        # One host read for both decisions: anything to assign, and (centroids held, every expert
        # defined) a decode step's one token per row. No centroids exist before the first write.
        side = store.side(Centroids)
        checks = [new.any()]
        if side is not None:
            checks.append((side.count > 0).all() & (new.sum(-1) <= 1).all())
        flags = torch.stack(checks).tolist()
        if not flags[0]:
            return torch.where(view.valid, held, torch.full_like(held, -1)), new
        cent, count = self.state(store)
        if len(flags) > 1 and flags[1]:
            return self._assign_one(store, new, cent, count, held), new
        keys = view.k.float()
        cent, defined, seeded = seed(keys, view.pos, new, cent, count > 0)
        eid = self.place(keys, cent, defined, new, seeded, held, view.valid)
        cent, count = self.update(cent, count, keys, eid, new, view.pos)
        store.set_side(Centroids(cent.contiguous(), count.contiguous()))
        held = torch.where(new, eid, held)
        store.set_state(EXPERT, (held + 1).float())
        return torch.where(view.valid, held, torch.full_like(held, -1)), new

    def _assign_one(
        self,
        store: LayerStore,
        new: torch.Tensor,
        cent: torch.Tensor,
        count: torch.Tensor,
        held: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`assign_new` when every expert holds a centroid (nothing to seed) and each head-row
        has at most one new token (a decode step): the new token's distances, placement
        (:meth:`place_one`), centroid update and stored expert touch that token alone, so a step
        costs O(E·D) per head-row here, not O(T·D). (An expert sum over one member is that
        member's key exactly; the distances of one row may differ from those of a T-row matmul in
        the last bit, which decides a placement only between equidistant centroids.)

        Returns:
            the assignment ``(B, H, T)`` as :meth:`assign_new`.
        """
        view = store.view()
        col = new.long().argmax(-1, keepdim=True)  # (B, H, 1): the row's new token, if any
        one = view.k.gather(2, col[..., None].expand(-1, -1, 1, view.k.shape[-1])).float()
        one_new = new.gather(-1, col)
        placed = self.place_one(sq_dist(one, cent), one_new, held, view.valid)  # (B, H, 1)
        cent, count = self.update(cent, count, one, placed, one_new, view.pos.gather(-1, col))
        store.set_side(Centroids(cent.contiguous(), count.contiguous()))
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
    ) -> torch.Tensor:
        """Expert of each new token ``(B, H, T)``: its seed, else the nearest defined centroid."""
        dist = sq_dist(keys, cent).masked_fill(~defined[:, :, None, :], float("inf"))
        return torch.where(seeded >= 0, seeded, dist.argmin(-1))

    def place_one(
        self, dist: torch.Tensor, new: torch.Tensor, held: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`place` of at most one new token per head-row when every centroid is defined and
        nothing is seeded: ``dist`` ``(B, H, 1, E)`` its distances, ``new`` ``(B, H, 1)`` whether the
        head-row has one; ``held``, ``valid`` ``(B, H, T)`` as in :meth:`place`. Returns ``(B, H, 1)``."""
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
