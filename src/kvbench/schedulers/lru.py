"""LRU: kvbench's own least-recently-used token eviction under the budget (docs/methods.md).

A stored token is *used* at a query position when any query head of its KV head's group gives it
attention of at least ``tau``. Each token carries the last position at which it was used (its
arrival position until then); beyond the capacity the least recently used tokens are evicted.
Sinks, the window and protected positions are always kept and count inside the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache import attention as att
from kvbench.cache import devices
from kvbench.cache.side import TokenState
from kvbench.cache.surface import TechniqueStore
from kvbench.errors import ConfigError
from kvbench.roles import Flags, Scheduler
from kvbench.select import ScoredSelection


def used(probs: torch.Tensor, qpos: torch.Tensor, tau: float) -> torch.Tensor:
    """Which stored token each real query uses: ``(B, H, q, T)`` bool.

    Args:
        probs: ``(B, H, g, q, T)`` attention probabilities (padding queries are zero rows).
        qpos: ``(B, q)`` query positions, -1 for padding.
        tau: the smallest probability that counts as a use.
    """
    return (probs.amax(2) >= tau) & (qpos >= 0)[:, None, :, None]


POSITION_SPAN = 2**24  # above every position a float32 last use holds exactly


def ranked(primary: torch.Tensor, by_second: torch.Tensor) -> torch.Tensor:
    """Rank of each token by ``(primary, secondary)``, both ascending: ``(B, H, T)`` float, where
    ``by_second`` holds the columns in ascending order of the secondary key (positions:
    :meth:`LayerStore.by_position`).

    Ties of the primary key (tokens last used by the same query) go to the more recent arrival.
    """
    order = by_second.gather(-1, primary.gather(-1, by_second).argsort(dim=-1, stable=True))
    rank = torch.empty_like(order, dtype=torch.float32)  # whole ranks, exact in float32
    ranks = devices.arange(order.shape[-1], order, torch.float32)
    return rank.scatter_(-1, order, ranks.expand_as(order))


@dataclass
class LRUScheduler(ScoredSelection, Scheduler):
    """Keeps sinks, the window and the most recently used tokens (per-token state ``lru``).

    Args:
        tau: attention probability (max over the query heads of the group) that counts as a use.
    """

    name: str = "lru"
    distinct_scores = True  # a token's position is part of its score
    # 2: the decode step of issue 29 (CHANGELOG.md); 3: its logits in the keys' dtype
    # (bfloat16/float16 only)
    version = 3
    tau: float = 0.01
    flags = Flags(needs_attention_scores=True, evicts_tokens=True)
    LAST = TokenState("lru")  # last position at which the token was used

    def check_knobs(self) -> None:
        if not 0.0 < self.tau <= 1.0:
            raise ConfigError(f"scheduler.tau={self.tau}: must be in (0, 1]")

    def observe(self, layer: int, store: TechniqueStore, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        pos = store.view().pos
        hit = probs.amax(2) >= self.tau  # a padding query's position is -1: no use either way
        if hit.shape[2] == 1:  # one query: used at its position, else last used as before (a
            # query's position is at least every stored one's, so the arrival need not be kept apart)
            hit = att.widen(hit[:, :, 0], pos.shape[2], False)
            # positions converted inside the maximum (whole numbers, exact in float32)
            last = torch.where(hit, qpos[:, None, :], pos)
            if len(store.segments) == 1:  # the state is the store's own: written there in place
                state = store.state(self.LAST)
                torch.maximum(state, last, out=state)
            else:
                store.set_state(self.LAST, torch.maximum(store.state(self.LAST), last))
            return
        last = torch.where(hit, qpos.int()[:, None, :, None], -1).amax(2)  # (B, H, w), -1 if unused
        state = torch.maximum(store.state(self.LAST), pos.float())  # arrival position initially
        store.set_state(self.LAST, torch.maximum(state, att.widen(last.float(), pos.shape[2], -1.0)))

    def last_used(self, store: TechniqueStore) -> torch.Tensor:
        """``(B, H, T)`` last position at which each stored token was used (arrival if never)."""
        return torch.maximum(store.state(self.LAST), store.view().pos)  # float32: the state's type

    def score(self, layer: int, store: TechniqueStore) -> torch.Tensor:
        """``(B, H, T)`` eviction scores: by last use, then by arrival, as one float64 key
        ``last use · 2**24 + position``, distinct in each head-row (positions are distinct). The
        last uses are whole numbers in float32, exact below 2**24, as the positions are: the key is
        exact, and orders the tokens as the two keys do one after the other (:func:`ranked`)."""
        return torch.add(store.view().pos, self.last_used(store).double(), alpha=POSITION_SPAN)
