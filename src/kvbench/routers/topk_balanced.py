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

from dataclasses import dataclass, field

import torch

from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError
from kvbench.routers.centroids import CentroidExperts, sq_dist
from kvbench.routers.expert import ExpertRouter, expert_counts, expert_onehot, fill_by_preference


def capacity(factor: float, demand: torch.Tensor, experts: torch.Tensor | int) -> torch.Tensor:
    """⌈factor · demand / experts⌉ as long (demand, experts broadcast)."""
    per = max(experts, 1) if isinstance(experts, int) else experts.clamp(min=1)
    return (factor * demand.double() / per - 1e-9).ceil_().long()


@dataclass
class TopKBalancedRouter(CentroidExperts, ExpertRouter):
    """Nearest-centroid write and top-k read, both under a capacity factor ``capacity_factor``."""

    name: str = "topk_balanced"
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    short: list[float] = field(default_factory=list, init=False, repr=False)  # per call with a real query
    # short and real (query, head-row) pairs of the calls not yet in ``short``, as tensors
    _short_pending: list[tuple[torch.Tensor, torch.Tensor]] = field(
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
    ) -> torch.Tensor:
        experts = self.num_experts
        seeds = expert_onehot(seeded, seeded >= 0, experts).sum(2)
        room = self.write_room(held, valid, new) - seeds
        dist = sq_dist(keys, cent).masked_fill(~defined[:, :, None, :], float("inf"))
        want = (new & (seeded < 0)).long()
        return torch.where(seeded >= 0, seeded, self.take(dist, want, room))

    def place_one(
        self, dist: torch.Tensor, new: torch.Tensor, held: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        # Tokens that want no expert offer nothing, so the greedy over the one new token alone
        # takes what the greedy over every token gives it.
        return self.take(dist, new.long(), self.write_room(held, valid, new))

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

    def read_capacity(self, count: torch.Tensor, qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts each query wants ``(B, H)`` and queries each expert serves ``(B, H)``."""
        nonempty = (count > 0).sum(-1)
        k = nonempty.clamp(max=self.top_k)
        queries = (qpos >= 0).sum(-1)[:, None]
        return k, capacity(self.capacity_factor, k * queries, nonempty)

    def choose(
        self, layer: int, store: LayerStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        k, cap = self.read_capacity(count, qpos)
        real = (qpos >= 0)[:, None, :]
        need = torch.where(real, k[..., None], torch.zeros_like(k[..., None]))
        room = cap[..., None].expand(-1, -1, self.num_experts)
        order = score.argsort(dim=-1, descending=True, stable=True)
        chosen = fill_by_preference(order, torch.isfinite(score), need, room)
        short = (chosen.sum(-1) < need) & real
        self._short_pending.append((short.sum(), real.expand_as(short).sum()))  # no host sync here
        return chosen

    def _settle(self) -> None:
        super()._settle()
        self.short.extend(int(s) / int(n) for s, n in self._short_pending if int(n))
        self._short_pending.clear()

    def metrics(self) -> dict[str, float | list[float] | None]:
        out = super().metrics()
        if out:
            out["read_shortfall"] = sum(self.short) / len(self.short) if self.short else None
        return out
