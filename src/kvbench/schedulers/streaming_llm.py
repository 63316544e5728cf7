"""StreamingLLM: attention sinks plus the most recent tokens (arXiv:2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache.surface import TechniqueStore
from kvbench.errors import ConfigError
from kvbench.roles import Flags, Scheduler
from kvbench.select import ScoredSelection


@dataclass
class StreamingLLMScheduler(ScoredSelection, Scheduler):
    """Keeps ``sinks`` first tokens and the most recent ``capacity - sinks`` tokens.

    Args:
        position_mode: ``original`` keeps each token's original rotary position (kvbench's
            default); the paper's ``cache`` mode re-assigns positions inside the cache and is not
            implemented yet, so it is refused.
    """

    name: str = "streaming_llm"
    version = 2  # 2: the decode step of issue 29 (CHANGELOG.md)
    distinct_scores = True  # positions, exact in float32 below 2**24
    position_mode: str = "original"
    flags = Flags(evicts_tokens=True)

    def check_knobs(self) -> None:
        if self.position_mode != "original":
            raise ConfigError(
                f"scheduler.position_mode={self.position_mode!r}: only 'original' is implemented"
            )

    def score(self, layer: int, store: TechniqueStore) -> torch.Tensor:
        return store.view().pos.float()  # the newest first
