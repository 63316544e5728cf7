"""H2O: heavy hitters by accumulated attention received, plus the recent window (arXiv:2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache.store import LayerStore
from kvbench.roles import Flags, Scheduler, keep_top


@dataclass
class H2OScheduler(Scheduler):
    """Keeps sinks, the window, and the stored tokens with the highest accumulated attention.

    Accumulated attention of a token is the sum, over every query that has attended to it
    (prefill and later chunks), of its softmax probability, summed over the query heads of its
    KV head's group.
    """

    name: str = "h2o"
    flags = Flags(needs_attention_scores=True, evicts_tokens=True)

    def observe(self, layer: int, store: LayerStore, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        store.add_aux("h2o", probs.sum(2))

    def evict(self, layer: int, store: LayerStore) -> None:
        view, budget = store.view(), self.budget_cfg
        cap = budget.capacity(store.seen)
        if int(view.valid.sum(-1).max()) <= cap:
            return
        score = store.aux("h2o").masked_fill(
            budget.protected(view.pos, store.seen, store.protect_from), float("inf")
        )
        store.keep(keep_top(score, view.valid, cap))
