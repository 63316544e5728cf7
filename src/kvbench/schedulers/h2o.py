"""H2O: heavy hitters by accumulated attention received, plus the recent window (arXiv:2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache import attention as att
from kvbench.cache.side import TokenState
from kvbench.cache.surface import TechniqueStore
from kvbench.roles import Flags, Scheduler
from kvbench.select import Allocated, ScoredSelection

SCORE = TokenState("h2o")  # attention received, accumulated over every query


@dataclass
class H2OScheduler(ScoredSelection, Allocated, Scheduler):
    """Keeps sinks, the window, and the stored tokens with the highest accumulated attention.

    Accumulated attention of a token is the sum, over every query that has attended to it
    (prefill and later chunks), of its softmax probability, summed over the query heads of its
    KV head's group. ``allocation`` splits the budget across layers.
    """

    name: str = "h2o"
    # 2: the decode step of issue 29; 3: a selection kept where the slots are out of position order
    # breaks ties by position, as its evictions do (CHANGELOG.md)
    # 4: its logits in the keys' dtype (bfloat16/float16 only, CHANGELOG.md)
    version = 4
    flags = Flags(needs_attention_scores=True, evicts_tokens=True)

    def observe(self, layer: int, store: TechniqueStore, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        store.add_state(SCORE, att.widen(probs.sum((2, 3)), store.columns()))

    capacity = Allocated.layer_capacity_host

    def score(self, layer: int, store: TechniqueStore) -> torch.Tensor:
        return store.state(SCORE)
