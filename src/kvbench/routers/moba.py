"""MoBA-style block routing, the router named ``base``: contiguous position blocks, each query reads
the top-k blocks by q · mean(K_block) (arXiv:2502.13189). Sinks, the window and the current chunk
are always read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache.surface import TechniqueStore
from kvbench.errors import ConfigError
from kvbench.routers.expert import ExpertRouter, PositionExperts, top_k_choice


@dataclass
class BaseRouter(PositionExperts, ExpertRouter):
    """Splits each layer's stored tokens into ``num_experts`` position blocks; reads ``top_k``."""

    name: str = "base"
    # 2: a block's mean key as its keys weighted by 1 / its size (issue 29, CHANGELOG.md);
    # 3: block sums in the keys' dtype (bfloat16/float16 only)
    version = 3
    num_experts: int = 8
    top_k: int = 2

    def check_knobs(self) -> None:
        self.check_experts()
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"router.top_k={self.top_k}: must be in 1..num_experts ({self.num_experts})")

    def most_read(self) -> int:
        return self.top_k

    def choose(
        self, layer: int, store: TechniqueStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        return top_k_choice(score, self.top_k, finite=self.none_empty(count), pad=True)
