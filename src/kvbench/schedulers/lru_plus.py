"""LRU+: kvbench's own LRFU eviction, recency and frequency of use in one score (docs/methods.md).

A token's score at position ``now`` is ``sum over its uses t of decay ** (now - t)``, a use being
what :mod:`kvbench.schedulers.lru` calls one (any query head of the group gives it attention of at
least ``tau``). ``decay = 1`` counts uses (LFU); a small ``decay`` approaches LRU. The score is
updated per observed block of queries: ``score <- score * decay ** delta + sum of the block's
uses``, where ``delta`` is how far ``now`` moved (the block's real queries). It is kept as its
natural logarithm, so that a long context cannot underflow old scores to a tie at zero; a token
never used has score 0 (log -inf) and ranks by arrival among its peers. Beyond the capacity the
lowest scores are evicted; sinks, the window and protected positions are always kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbench.cache import attention as att
from kvbench.cache.side import TokenState
from kvbench.cache.surface import TechniqueStore, every_query_real
from kvbench.errors import ConfigError
from kvbench.roles import Flags, Scheduler
from kvbench.schedulers.lru import ranked, used
from kvbench.select import ScoredSelection

# above every position a key holds exactly: a float32's order (an int32, at most 2**31 in
# magnitude) times it, plus a position, stays below 2**53
KEY_SPAN = 2**21


@dataclass
class LRUPlusScheduler(ScoredSelection, Scheduler):
    """LRFU: keeps sinks, the window and the tokens with the highest decayed use count.

    Per-token state: ``lrfu``, the log score at the sequence's latest query (-inf, no use, for a
    token stored since).

    Args:
        decay: weight of a use per position of age, in (0, 1].
        tau: attention probability (max over the query heads of the group) that counts as a use.
    """

    name: str = "lru_plus"
    # 2: the decode step of issue 29; 3: no per-token "seen" flag (CHANGELOG.md);
    # 4: its logits in the keys' dtype (bfloat16/float16 only)
    version = 4
    distinct_scores = True  # keys with the position in them (past KEY_SPAN, ranks: a permutation)
    decay: float = 0.9
    tau: float = 0.01
    flags = Flags(needs_attention_scores=True, evicts_tokens=True)
    SCORE = TokenState("lrfu", fill=float("-inf"))  # log of the decayed use count (-inf: none yet)

    def check_knobs(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError(f"scheduler.decay={self.decay}: must be in (0, 1]")
        if not 0.0 < self.tau <= 1.0:
            raise ConfigError(f"scheduler.tau={self.tau}: must be in (0, 1]")

    def observe(self, layer: int, store: TechniqueStore, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        if qpos.shape[1] == 1:
            self._observe_one(store, probs, qpos)
            return
        real = qpos >= 0  # (B, q)
        if not bool(real.any()):
            return
        log_decay = math.log(self.decay)
        # A block's real queries of one sequence are consecutive positions, the first one right
        # after the previous reference point: now moves by their count.
        delta = real.sum(-1).float()  # (B,)
        now = qpos.amax(-1)  # (B,)
        age = (now[:, None] - qpos).float() * log_decay  # (B, q) log decay ** (now - t)
        hit = used(probs, qpos, self.tau)
        gained = age[:, None, :, None].masked_fill(~hit, float("-inf")).logsumexp(2)  # (B, H, w)
        gained = att.widen(gained, store.columns(), float("-inf"))
        old = store.state(self.SCORE)
        store.set_state(self.SCORE, torch.logaddexp(old + (delta * log_decay)[:, None, None], gained))

    def _observe_one(self, store: TechniqueStore, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        """:meth:`observe` of one query per sequence, without reading the device: a real query
        moves ``now`` by one and adds a use of weight 1 (log 0) to each token it uses; a padding
        one moves nothing and uses nothing (its tokens' scores stay as they were). Where no query
        is padding (known on the host), each moves ``now`` by one."""
        old = store.state(self.SCORE)
        whole = every_query_real(store, qpos)
        hit = probs.amax(2)[:, :, 0] >= self.tau if whole else used(probs, qpos, self.tau)[:, :, 0]
        hit = att.widen(hit, old.shape[2], False)  # (B, H, T)
        gained = torch.where(hit, 0.0, float("-inf"))  # log of one use, or of none (float32)
        if whole:
            older = old + math.log(self.decay)
        else:
            moved = (qpos[:, 0] >= 0).float() * math.log(self.decay)  # (B,) log decay ** delta
            older = old + moved[:, None, None]
        if len(store.segments) == 1:  # the state is the store's own (``old``): written there in place
            torch.logaddexp(older, gained, out=old)
        else:
            store.set_state(self.SCORE, torch.logaddexp(older, gained))

    def log_scores(self, store: TechniqueStore) -> torch.Tensor:
        """``(B, H, T)`` log score of every stored token at its sequence's latest query (-inf: unused)."""
        return store.state(self.SCORE)

    def score(self, layer: int, store: TechniqueStore) -> torch.Tensor:
        """``(B, H, T)`` eviction scores: by decayed use, then by arrival, distinct in each head-row.

        Below :data:`KEY_SPAN` positions, one float64 key ``order(log score) · KEY_SPAN + position``,
        where ``order`` maps a float32 to an int32 in the same order (its bits, the lower 31
        flipped where it is negative; zero's sign dropped first, so that ``-0.0`` ties with ``0.0``
        as the floats do): whole numbers below 2**53, exact, ordering the tokens as the two keys do
        one after the other, as :func:`ranked` does with two sorts. Past it, those ranks."""
        log = self.log_scores(store)
        if store.seen_max >= KEY_SPAN:
            return ranked(log, store.by_position())
        bits = (log + 0.0).view(torch.int32)
        order = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return torch.add(store.view().pos, order.double(), alpha=KEY_SPAN)
