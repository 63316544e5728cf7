"""Capacity-factor routing (Switch Transformer's capacity factor, arXiv:2101.03961, applied to a
sharded KV cache): every expert has a write capacity of c·T/E tokens and a read capacity of
c·k·Q/E queries per block.

Write: a token leaving the window goes to its nearest running centroid (online mean) that still
has room under ⌈c·T/E⌉ (T: routed tokens of its head-row after the write); a full expert
overflows it to the next nearest with room. Tokens claim room in cache order. Read: each query
takes its top-k experts by q · centroid, each expert serving at most ⌈c·k·Q/E⌉ of the block's
Q real queries (in query order), the overflow going to the query's next best expert.

Differences from Switch: Switch drops overflowing tokens (or, in later variants, re-routes
them); here nothing is dropped, overflow goes to the next best expert. Experts that hold no
token are not experts yet: the read capacity uses the E' non-empty experts and k' = min(k, E'),
so capacity always covers the demand. The greedy can still leave a query short of k experts
when everything left on its list is full; ``read_shortfall`` measures how often.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.cache.surface import TechniqueStore, every_query_real
from kvbench.errors import ConfigError
from kvbench.routers.centroids import CentroidExperts, Centroids, sq_dist, write_columns
from kvbench.routers.expert import ExpertRouter, choice_at, expert_counts, expert_onehot, fill_by_preference


def capacity(factor: float, demand: torch.Tensor, experts: torch.Tensor | int) -> torch.Tensor:
    """⌈factor · demand / experts⌉ as long (demand, experts broadcast)."""
    per = max(experts, 1) if isinstance(experts, int) else experts.clamp(min=1)
    return (factor * demand.double() / per - 1e-9).ceil_().long()


def first_finite(
    score: torch.Tensor, k: torch.Tensor | int, finite: bool = False, pad: bool = False
) -> torch.Tensor:
    """``(B, H, 1, E)`` bool: the first ``k`` (``(B, H, 1)``, or one for all) experts with a finite
    score, by score (ties by expert): :func:`fill_by_preference` of one query under a capacity it
    never meets. ``finite``: known on the host that every score is finite (and ``k`` one for all),
    so the first ``k`` by score are taken without counting. ``pad``: as :func:`no_choice`'s."""
    ranked, order = score.sort(dim=-1, descending=True, stable=True)
    if finite and isinstance(k, int):
        return choice_at(score, order[..., :k], None, pad)
    ok = ranked.isfinite()
    took = ok & (ok.long().cumsum(-1) <= (k if isinstance(k, int) else k[..., None]))
    return choice_at(score, order, took, pad)


def shortfalls(calls: list[tuple[torch.Tensor, torch.Tensor | int]]) -> list[int]:
    """The (query, head-row) pairs of each call ``(chosen (B, H, q, E), need (B, H, q) or one for
    all)`` that chose fewer experts than they need, the calls of one shape at once (whole counts:
    exact)."""
    out = [0] * len(calls)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (chosen, need) in enumerate(calls):
        kind = need if isinstance(need, int) else (need.shape, need.device)
        groups.setdefault((chosen.shape, chosen.device, kind), []).append(i)
    for (*_, kind), idx in groups.items():
        chosen = torch.stack([calls[i][0] for i in idx]).sum(-1)
        need = kind if isinstance(kind, int) else torch.stack([torch.as_tensor(calls[i][1]) for i in idx])
        for i, n in zip(idx, (chosen < need).flatten(1).sum(-1).tolist()):
            out[i] = n
    return out


@dataclass
class TopKBalancedRouter(CentroidExperts, ExpertRouter):
    """Nearest-centroid write and top-k read, both under a capacity factor ``capacity_factor``."""

    # 2: the decode step's one-token distance and update; 3: a write's greedy offers its new tokens,
    # and seeds from them, in arrival order where the slots are out of it (issue 29, CHANGELOG.md)
    version = 3
    name: str = "topk_balanced"
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    short: list[float] = field(default_factory=list, init=False, repr=False)  # per call with a real query
    # per call not yet in ``short``: its short and real (query, head-row) pairs as tensors (and
    # None); or, every query real, the experts it chose and needed and the number of pairs
    _short_pending: list[tuple[torch.Tensor, torch.Tensor | int, int | None]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def check_knobs(self) -> None:
        self.check_experts()
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"router.top_k={self.top_k}: must be in 1..num_experts ({self.num_experts})")
        if not self.capacity_factor >= 1.0:
            raise ConfigError(f"router.capacity_factor={self.capacity_factor}: must be >= 1")

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
        experts = self.num_experts
        seeds = expert_onehot(seeded, seeded >= 0, experts).sum(2)
        room = self.write_room(held, valid, new) - seeds
        dist = sq_dist(keys, cent).masked_fill(~defined[:, :, None, :], float("inf"))
        want = (new & (seeded < 0)).long()
        if by_pos is None:
            took = self.take(dist, want, room)
        else:  # the greedy offers the new tokens in arrival order (version 3), then back to their slots
            at = by_pos[..., None].expand_as(dist)
            took = self.take(dist.gather(2, at), want.gather(-1, by_pos), room)
            took = torch.empty_like(took).scatter_(-1, by_pos, took)
        return torch.where(seeded >= 0, seeded, took)

    def place_one(
        self, layer: int, store: TechniqueStore, dist: torch.Tensor, new: torch.Tensor | None
    ) -> torch.Tensor:
        # Tokens that want no expert offer nothing, so the greedy over the one new token alone
        # takes what the greedy over every token gives it.
        if new is not None:
            held = self.held(layer, store)
            return self.take(dist, new.long(), self.write_room(held, store.view().valid, new))
        # One new token in every head-row after the assigned columns, nothing ever evicted: the
        # routed tokens after the write are a host figure, and the experts' live tokens are the
        # centroids' counts (every assignment ever made).
        cols = write_columns(self.budget, store)
        side = store.side(Centroids)
        assert cols is not None and side is not None
        # Some expert has room: E·cap >= factor·n > n - 1 tokens held (factor >= 1, whole rooms).
        cap = math.ceil(self.capacity_factor * float(cols[1] - cols[0]) / max(self.num_experts, 1) - 1e-9)
        return self.take_first(dist, side.count >= cap)

    def write_room(self, held: torch.Tensor, valid: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``(B, H, E)`` float: room under the write capacity, counting the ``new`` tokens in ``T``."""
        live = expert_counts(torch.where(valid, held, -1), self.num_experts)  # (B, H, E)
        cap = capacity(self.capacity_factor, live.sum(-1) + new.sum(-1), self.num_experts)  # (B, H)
        return cap[..., None] - live

    @staticmethod
    def take(dist: torch.Tensor, want: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
        """Nearest expert with room for each wanting token, in cache order: ``(B, H, N)``."""
        order = dist.argsort(dim=-1, stable=True)
        room = room.clamp(min=0).long()
        took = fill_by_preference(order, torch.ones_like(dist, dtype=torch.bool), want, room)
        return took.long().argmax(-1)

    @staticmethod
    def take_first(dist: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """:meth:`take` of one token per head-row that wants an expert, some expert having room
        for it: its nearest with room (``full`` ``(B, H, E)``: the experts without), ``(B, H, 1)``."""
        # the nearest of those with room, ties to the first expert (as a stable order by distance)
        return dist.masked_fill(full[:, :, None, :], float("inf")).argmin(-1)

    def read_capacity(self, count: torch.Tensor, qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts each query wants ``(B, H)`` and queries each expert serves ``(B, H)``."""
        nonempty = (count > 0).sum(-1)
        k = nonempty.clamp(max=self.top_k)
        queries = (qpos >= 0).sum(-1)[:, None]
        return k, capacity(self.capacity_factor, k * queries, nonempty)

    def choose(
        self, layer: int, store: TechniqueStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        if qpos.shape[1] == 1 and every_query_real(store, qpos):
            # One real query per head-row: every expert gets one offer at most, and has room for it
            # whenever the query wants any (k > 0 gives a capacity of at least 1), so the query
            # takes its first k finite experts by score. Where ``count`` is the centroids' counts
            # and every expert has held a token, none is empty: k is top_k.
            full = self.all_held(store, count)
            if full:
                k: torch.Tensor | int = min(self.top_k, self.num_experts)
            else:
                k = (count > 0).sum(-1).clamp(max=self.top_k)[..., None]  # (B, H, 1)
            padded = first_finite(score, k, full, pad=True)
            chosen = padded[..., : self.num_experts]
            self._short_pending.append((chosen, k, chosen.shape[:3].numel()))  # counted when settled
            return padded
        k, cap = self.read_capacity(count, qpos)
        real = (qpos >= 0)[:, None, :]
        need = torch.where(real, k[..., None], torch.zeros_like(k[..., None]))
        room = cap[..., None].expand(-1, -1, self.num_experts)
        order = score.argsort(dim=-1, descending=True, stable=True)
        chosen = fill_by_preference(order, torch.isfinite(score), need, room)
        short = (chosen.sum(-1) < need) & real
        self._short_pending.append((short.sum(), real.expand_as(short).sum(), None))  # no host sync here
        return chosen

    def _settle(self) -> None:
        super()._settle()
        pending, self._short_pending = self._short_pending, []
        counted = iter(shortfalls([(chosen, need) for chosen, need, n in pending if n is not None]))
        for a, b, n in pending:
            short, pairs = (next(counted), n) if n is not None else (int(a), int(b))
            if pairs:
                self.short.append(short / pairs)

    def metrics(self) -> dict[str, float | list[float] | None]:
        out = super().metrics()
        if out:
            out["read_shortfall"] = sum(self.short) / len(self.short) if self.short else None
        return out
