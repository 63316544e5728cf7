"""Two-level routing (kvbench's own): ``num_experts`` position blocks form ``num_groups`` groups
of contiguous blocks; each query picks the ``top_groups`` groups by q · group centroid, then the
``top_k`` experts by q · expert centroid among the chosen groups' experts.

A group centroid is the mean key of all its tokens (the token-weighted mean of its experts'
centroids); scores are summed over the query heads of the KV head's group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError
from kvbench.routers.expert import ExpertRouter, PositionExperts, top_k_choice


def group_choice(
    score: torch.Tensor, count: torch.Tensor, groups: int, top_groups: int, k: int
) -> torch.Tensor:
    """``(B, H, q, E)`` bool: top-``k`` experts inside the ``top_groups`` best groups.

    Args:
        score: ``(B, H, q, E)``, -inf for empty experts; count: ``(B, H, E)`` tokens per expert.
    """
    *lead, experts = score.shape
    per = experts // groups
    weight = count[:, :, None, :].expand_as(score).float()
    scaled = torch.where(weight > 0, score, torch.zeros_like(score)) * weight
    mass = weight.reshape(*lead, groups, per).sum(-1)
    gscore = scaled.reshape(*lead, groups, per).sum(-1) / mass.clamp(min=1)  # q · mean key of the group
    gscore = gscore.masked_fill(mass == 0, float("-inf"))
    inside = top_k_choice(gscore, top_groups).repeat_interleave(per, -1)
    return top_k_choice(score.masked_fill(~inside, float("-inf")), k)


@dataclass
class HierarchicalRouter(PositionExperts, ExpertRouter):
    """Position-block experts in groups; top groups first, then top experts inside them."""

    name: str = "hierarchical"
    num_experts: int = 16
    num_groups: int = 4
    top_groups: int = 2
    top_k: int = 4

    def check_knobs(self) -> None:
        self.check_experts()
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ConfigError(
                f"router.num_groups={self.num_groups}: must divide num_experts ({self.num_experts})"
            )
        if not 1 <= self.top_groups <= self.num_groups:
            raise ConfigError(
                f"router.top_groups={self.top_groups}: must be in 1..num_groups ({self.num_groups})"
            )
        inside = self.top_groups * (self.num_experts // self.num_groups)
        if not 1 <= self.top_k <= inside:
            raise ConfigError(
                f"router.top_k={self.top_k}: must be in 1..top_groups*num_experts/num_groups ({inside})"
            )

    def choose(
        self, layer: int, store: LayerStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        return group_choice(score, count, self.num_groups, self.top_groups, self.top_k)
