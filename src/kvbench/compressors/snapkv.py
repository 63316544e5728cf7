"""SnapKV: keep the tokens the last observation window attends to, pooled, per KV head
(arXiv:2404.14469); PyramidKV is its preset with a pyramid layer budget (arXiv:2406.02069).

Differences from the papers, all from kvbench's protocol (docs/methods.md):

- SnapKV and PyramidKV compress the prompt once, after prefill. Here the selection runs at every
  compression point (after each forward chunk), so the kept fraction stays at the budget as the
  sequence grows; the scores are always those of the latest ``obs_window`` queries.
- The observation window's softmax runs over every stored token (the window included), not only
  over the prefix; the ranking among the prefix tokens is the paper's up to that normalization.
- The stack's ``window`` (not ``obs_window``) is what stays protected, and sinks are kept too; both
  count inside the capacity. Scores of a KV head are summed over its query group (GQA).
- PyramidKV's schedule (bottom layer ``2 - 1/beta`` times the mean, top layer ``1/beta``) splits the
  whole per-layer capacity, sinks and window included, and no layer keeps fewer than
  ``sinks + window`` tokens; the paper splits the budget net of its observation window. As in
  PyramidKV's code, a sequence that fits the uniform budget (budget 1) keeps every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache.surface import TechniqueStore
from kvbench.roles import Compressor, Flags
from kvbench.select import Allocated, ObservationWindow, ScoredSelection, check_window


@dataclass
class SnapKVCompressor(ScoredSelection, Allocated, ObservationWindow, Compressor):
    """Keeps, per KV head, the stored tokens with the highest pooled observation-window attention.

    Args:
        obs_window: the last queries whose attention scores the stored tokens.
        pool: max-pooling kernel over neighbouring stored tokens (odd; 1 disables pooling).
        allocation: how the budget is split across layers (``uniform``, ``pyramid``, ...).
        beta: ``pyramid`` only: the top layer keeps ``1 / beta`` of the mean.
    """

    name: str = "snapkv"
    # 2: the decode step of issue 29; 3: a selection kept where the slots are out of position order
    # breaks ties by position, as its evictions do (CHANGELOG.md)
    # 4: its logits in the keys' dtype (bfloat16/float16 only, CHANGELOG.md)
    version = 4
    obs_window: int = 16
    pool: int = 7
    flags = Flags(needs_attention_scores=True, evicts_tokens=True)

    def check_knobs(self) -> None:
        check_window(self.role, self.obs_window, self.pool)

    capacity = Allocated.allocated_capacity_host

    def score(self, layer: int, store: TechniqueStore) -> torch.Tensor:
        return self.window_scores(store)

    def score_in_order(self, layer: int, store: TechniqueStore, order: torch.Tensor | None) -> torch.Tensor:
        return self.window_scores_in_order(store, order)
