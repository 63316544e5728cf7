"""What every router shares (:class:`ExpertRouter`): which tokens are routable, expert centroids
and sizes, per-KV-head scores summed over the query group, the token read mask built from the
chosen experts, and the measured read figures; and :class:`PositionExperts`, experts as
contiguous position blocks (``base``, ``adaptive``, ``hierarchical``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from kvbench.cache import attention as att
from kvbench.cache.reads import SETTLE_EVERY, ReadCount, count_reads, resolve_all
from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.roles import Flags, Router


def routable_tokens(budget, store: LayerStore, qpos: torch.Tensor) -> torch.Tensor:
    """``(B, H, T)``: the stored tokens a router routes, every valid one but those always read (the
    sinks, the window before the chunk, protected positions and the chunk itself).

    ``qpos`` ``(B, q)``: the chunk of each sequence starts at its first real query; the chunk lies
    after the window before it, so ``pos < start - window`` excludes both.
    """
    view = store.view()
    pos = view.pos
    start = store.chunk_start(qpos)[:, None, None]
    out = view.valid & (pos >= budget.sinks) & (pos < start - budget.window)
    protect_from = store.view_protect_from()
    return out if protect_from is None else out & (pos < protect_from)


def position_blocks(
    pos: torch.Tensor, routable: torch.Tensor, experts: int, ordered: bool = False
) -> torch.Tensor:
    """Expert id of each routable token: ``experts`` contiguous position blocks per head-row.

    Args:
        pos: ``(B, H, T)`` positions; routable: ``(B, H, T)`` bool.
        ordered: positions increase along T (:meth:`LayerStore.in_position_order`), so a token's
            rank is a running count instead of two sorts.

    Returns:
        ``(B, H, T)`` long, -1 where not routable.
    """
    if ordered:
        rank = routable.long().cumsum(-1)  # 1 + rank of each routable token
        n = rank[..., -1:].clamp(min=1)
        rank = rank - 1
    else:
        key = torch.where(routable, pos, torch.full_like(pos, torch.iinfo(pos.dtype).max))
        rank = key.argsort(-1).argsort(-1)
        n = routable.sum(-1, keepdim=True).clamp(min=1)
    eid = rank * experts // n
    return eid.masked_fill_(~routable, -1)


def expert_onehot(eid: torch.Tensor, member: torch.Tensor | None, experts: int) -> torch.Tensor:
    """``(B, H, T, E)`` float: 1 where token ``t`` is a ``member`` of expert ``eid`` (a member's
    ``eid`` is an expert, ``>= 0``); ``member`` None: every token whose ``eid`` is not -1."""
    onehot = eid[..., None] == torch.arange(experts, device=eid.device)
    return (onehot if member is None else onehot & member[..., None]).float()


def expert_counts(eid: torch.Tensor, experts: int) -> torch.Tensor:
    """``(B, H, E)`` float: tokens routed to each expert (``eid`` -1: none), without a one-hot."""
    out = torch.zeros(*eid.shape[:-1], experts + 1, device=eid.device)
    return out.scatter_add_(-1, eid + 1, torch.ones_like(eid, dtype=out.dtype))[..., 1:].contiguous()


def expert_sums(onehot: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Sum of each expert's keys ``(B, H, E, D)``; ``onehot`` ``(B, H, T, E)``, keys ``(B, H, T, D)``."""
    return onehot.transpose(-1, -2) @ keys.float()


def block_means(keys: torch.Tensor, eid: torch.Tensor, member: torch.Tensor, experts: int) -> torch.Tensor:
    """Mean key of each expert's members ``(B, H, E, D)`` fp32 (zero for an empty expert)."""
    onehot = expert_onehot(eid, member, experts)
    return expert_sums(onehot, keys) / onehot.sum(2).clamp(min=1)[..., None]


def top_k_choice(score: torch.Tensor, k: int) -> torch.Tensor:
    """``(..., E)`` bool: the ``k`` best-scored experts; non-finite (empty) experts never chosen."""
    k = min(k, score.shape[-1])
    chosen = torch.zeros_like(score, dtype=torch.bool).scatter(-1, score.topk(k, dim=-1).indices, True)
    return chosen & torch.isfinite(score)


def fill_by_preference(
    order: torch.Tensor, allowed: torch.Tensor, need: torch.Tensor, room: torch.Tensor
) -> torch.Tensor:
    """Greedy capacity-limited choice: each item takes its preferred experts that still have room.

    Round ``r`` offers every item still short of ``need`` its ``r``-th preferred expert; an expert
    accepts offers in item order while it has ``room`` (Switch Transformer's overflow to the next
    best expert). An item ends short of ``need`` only when every expert left on its list is full.

    Args:
        order: ``(..., N, E)`` long, experts by preference for each of N items.
        allowed: ``(..., N, E)`` bool (indexed by expert), experts an item may take.
        need: ``(..., N)`` long, experts each item wants (0 for items that want none).
        room: ``(..., E)`` long, items each expert may still accept.

    Returns:
        ``(..., N, E)`` bool, the experts each item took.
    """
    experts = order.shape[-1]
    if order.shape[-2] == 1:  # one item (a decode step): every expert gets one offer at most, so
        # the item takes its first ``need`` allowed experts with room, in its order of preference
        ok = allowed.gather(-1, order) & (room[..., None, :].gather(-1, order) > 0)
        took = ok & (ok.long().cumsum(-1) <= need[..., None])
        return torch.zeros_like(allowed).scatter(-1, order, took)
    chosen = torch.zeros_like(allowed)
    got = torch.zeros_like(need)
    room = room.clone()
    for r in range(experts):
        pick = order[..., r]
        want = (got < need) & allowed.gather(-1, pick[..., None]).squeeze(-1)
        offer = F.one_hot(pick, experts).bool() & want[..., None]
        accept = offer & (offer.long().cumsum(-2) <= room[..., None, :])
        chosen |= accept
        got = got + accept.sum(-1)
        room = room - accept.sum(-2)
    return chosen


@dataclass
class Routing:
    """One routed read.

    Attributes:
        eid: ``(B, H, T)`` expert of each stored token, -1 where not routed (always read).
        count: ``(B, H, E)`` routed tokens per expert.
        chosen: ``(B, H, q, E)`` experts each query reads.
    """

    eid: torch.Tensor
    count: torch.Tensor
    chosen: torch.Tensor

    @cached_property
    def mask(self) -> torch.Tensor:
        """``(B, H, q, T)``: a routed token is read iff its expert is chosen; the rest always.

        Built once per routing: the read figures and attention both use it."""
        q = self.chosen.shape[2]
        idx = self.eid.clamp(min=0)[:, :, None, :].expand(-1, -1, q, -1)
        return torch.gather(self.chosen, -1, idx) | (self.eid < 0)[:, :, None, :]


@dataclass
class ExpertRouter(Router):
    """What every router shares: routable tokens, scores, the read mask and the read figures.

    A subclass defines :meth:`experts` (write routing as seen at read time), optionally
    :meth:`summarize` (default: the mean key of each expert's routed tokens, as MoBA), and
    :meth:`choose` (read routing).

    The read figures of a call are kept as tensors (no device synchronisation per layer) and
    turned into floats, in call order, by :meth:`metrics` (or every ``SETTLE_EVERY`` calls).
    """

    name: str = ""
    num_experts: int = 8
    flags = Flags(selects_reads=True)
    reads: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)  # per layer
    read_tokens: list[float] = field(default_factory=list, init=False, repr=False)
    # per layer: bytes read per real query at each call; tokens read and visible, summed
    read_bytes: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False)
    read_counts: list[float] = field(default_factory=lambda: [0.0, 0.0], init=False, repr=False)
    _last: dict[int, tuple[Any, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)
    # (layer, reads of the call, routable read fraction, its weight) not yet in the lists above
    _pending: list[tuple[int, ReadCount, torch.Tensor, torch.Tensor]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def check_experts(self) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"router.num_experts={self.num_experts}: must be >= 1")

    def experts(self, layer: int, store: LayerStore, routable: torch.Tensor) -> torch.Tensor:
        """``(B, H, T)`` expert of each routed token, -1 elsewhere (every token not ``routable``)."""
        raise NotImplementedError

    def route_experts(self, layer: int, store: LayerStore, qpos: torch.Tensor) -> torch.Tensor:
        """:meth:`experts` of the tokens routable for the queries at ``qpos``."""
        return self.experts(layer, store, routable_tokens(self.budget, store, qpos))

    def summarize(
        self, layer: int, store: LayerStore, eid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed tokens per expert ``(B, H, E)`` float and the experts' centroids ``(B, H, E, D)`` fp32.

        Default: the mean key of each expert's routed tokens (zero for an empty expert).
        """
        onehot, count = self.membership(eid)
        return count, expert_sums(onehot, store.view().k) / count.clamp(min=1)[..., None]

    def membership(self, eid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One-hot ``(B, H, T, E)`` float of each token's expert, and the experts' sizes ``(B, H, E)``."""
        onehot = expert_onehot(eid, None, self.num_experts)
        return onehot, onehot.sum(2)

    def choose(
        self, layer: int, store: LayerStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        """``(B, H, q, E)`` bool from ``score`` ``(B, H, q, E)`` (-inf for empty experts)."""
        raise NotImplementedError

    def read_mask(
        self, layer: int, store: LayerStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        return self.route(layer, store, query, qpos).mask

    def route(self, layer: int, store: LayerStore, query: torch.Tensor, qpos: torch.Tensor) -> Routing:
        """Route a block of queries ``(B, Hq, q, D)``.

        A repeated call for the same block (the engine's KV-hit probe) returns the same routing
        without counting its reads again or advancing router state.
        """
        view = store.view()
        last = self._last.get(layer)
        if (
            last is not None
            and last[0] is view
            and torch.equal(last[1], qpos)
            and torch.equal(last[2], query)
        ):
            return last[3]
        eid = self.route_experts(layer, store, qpos)
        count, centroid = self.summarize(layer, store, eid)
        empty = (count == 0)[:, :, None, :]
        score = (dispatch.kernels("scoring") or att).group_scores(query, centroid)  # the cell's path
        score = score.masked_fill(empty, float("-inf"))
        chosen = self.choose(layer, store, score, count, qpos) & ~empty
        routing = Routing(eid=eid, count=count, chosen=chosen)
        self._account(layer, store, routing, qpos)
        self._last[layer] = (view, qpos.clone(), query.clone(), routing)
        return routing

    def forget(self, layer: int) -> None:
        """Drop the remembered routing of ``layer`` (router state is about to change)."""
        self._last.pop(layer, None)

    def write(self, layer: int, store: LayerStore) -> None:
        self.forget(layer)

    def _account(self, layer: int, store: LayerStore, routing: Routing, qpos: torch.Tensor) -> None:
        """Count the reads of one call: per expert, the routable fraction, bytes and tokens."""
        real = qpos >= 0
        chosen = routing.chosen & real[:, None, :, None]
        per_expert = chosen.sum((0, 1, 2)).float()
        before = self.reads.get(layer)  # per layer: each on its layer's device
        self.reads[layer] = per_expert if before is None else before + per_expert
        read = (chosen.float() * routing.count[:, :, None, :]).sum(-1)  # routed tokens read per query
        frac = read / routing.count.sum(-1, keepdim=True).clamp(min=1)
        weight = real[:, None, :].expand_as(frac).float()
        total = weight.sum()
        fraction = (frac * weight).sum() / total
        self._pending.append((layer, count_reads(store, routing.mask, qpos), fraction, total))
        if len(self._pending) >= SETTLE_EVERY:
            self._settle()

    def _settle(self) -> None:
        """Fold the pending read records into ``read_tokens``, ``read_bytes`` and ``read_counts``
        (one read of them all per device)."""
        pending, self._pending = self._pending, []
        counts, extra = resolve_all(
            [count for _, count, _, _ in pending], [x for _, _, f, t in pending for x in (f, t)]
        )
        for (layer, _, _, _), (nbytes, n_read, n_visible), fraction, total in zip(
            pending, counts, extra[::2], extra[1::2]
        ):
            if total:
                self.read_tokens.append(fraction)
            self.read_bytes.setdefault(layer, []).append(nbytes)
            self.read_counts[0] += n_read
            self.read_counts[1] += n_visible

    def metrics(self) -> dict[str, float | list[float] | None]:
        self._settle()
        if not self.reads:
            return {}
        reads = torch.stack([r.cpu() for r in self.reads.values()]).sum(0)  # whole numbers: exact
        mean = float(reads.mean())
        return {
            "reads_per_expert": reads.tolist(),
            "load_imbalance": float(reads.max()) / mean if mean else None,
            "routable_read_fraction": sum(self.read_tokens) / len(self.read_tokens)
            if self.read_tokens
            else None,
            # a step is one query through every layer: the layers' mean bytes per query, summed
            "bytes_read_per_step": sum(sum(b) / len(b) for b in self.read_bytes.values()),
            "read_fraction": self.read_counts[0] / self.read_counts[1] if self.read_counts[1] else None,
        }


@dataclass
class _Blocks:
    """Position blocks shared by the layers of one step (:meth:`PositionExperts.route_experts`)."""

    key: tuple[Any, ...]
    eid: torch.Tensor
    onehot: torch.Tensor
    count: torch.Tensor


class PositionExperts:
    """Mixin: write = contiguous position blocks over the routed tokens, derived at read time
    (a token's block follows from its rank, so nothing is stored and ``write`` keeps nothing).

    Where every stored slot holds its own position (:meth:`LayerStore.every_position`), the blocks
    depend on the positions alone, so they are the same in every layer of a step: the first
    layer derives them (and their one-hot and sizes) and the others reuse those very tensors.
    """

    num_experts: int
    budget: Any

    def experts(self, layer: int, store: LayerStore, routable: torch.Tensor) -> torch.Tensor:
        return position_blocks(store.view().pos, routable, self.num_experts, store.in_position_order())

    def route_experts(self, layer: int, store: LayerStore, qpos: torch.Tensor) -> torch.Tensor:
        key = store.position_key(qpos)
        if key is not None:
            key = (*key, self.budget, self.num_experts)
            cached: _Blocks | None = self.__dict__.get("_blocks")
            if cached is not None and cached.key == key:
                return cached.eid
        eid = self.experts(layer, store, routable_tokens(self.budget, store, qpos))
        if key is not None:
            onehot = expert_onehot(eid, None, self.num_experts)
            self.__dict__["_blocks"] = _Blocks(key, eid, onehot, onehot.sum(2))
        return eid

    def membership(self, eid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's shared one-hot and sizes when ``eid`` is the step's shared blocks."""
        cached: _Blocks | None = self.__dict__.get("_blocks")
        if cached is not None and cached.eid is eid:
            return cached.onehot, cached.count
        onehot = expert_onehot(eid, None, self.num_experts)
        return onehot, onehot.sum(2)
