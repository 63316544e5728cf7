"""Two-level routing (kvbench's own): ``num_experts`` position blocks form ``num_groups`` groups
of contiguous blocks; each query picks the ``top_groups`` groups by q · group centroid, then the
``top_k`` experts by q · expert centroid among the chosen groups' experts.

A group centroid is the mean key of all its tokens (the token-weighted mean of its experts'
centroids); scores are summed over the query heads of the KV head's group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvbench.cache import devices
from kvbench.cache.surface import TechniqueStore
from kvbench.errors import ConfigError
from kvbench.routers.expert import ExpertRouter, PositionExperts, top_k_choice


class GroupMass:
    """What the group scores take from the experts' sizes ``count`` ``(B, H, E)`` alone, each made
    once when first needed."""

    def __init__(self, count: torch.Tensor, groups: int):
        b, h, experts = count.shape
        self.count, self.groups = count, groups
        self.mass = count.float().reshape(b, h, 1, groups, experts // groups).sum(-1)  # (B, H, 1, G)

    @classmethod
    def of(cls, count: torch.Tensor, groups: int) -> GroupMass:
        return cls(count, groups)

    @cached_property
    def held(self) -> torch.Tensor:
        """``(B, H, 1, E)`` bool, the experts that hold a token."""
        return (self.count > 0)[:, :, None, :]

    @cached_property
    def divisor(self) -> torch.Tensor:
        """``(B, H, 1, G)`` tokens per group (1 for an empty group)."""
        return self.mass.clamp(min=1)

    @cached_property
    def empty(self) -> torch.Tensor:
        """``(B, H, 1, G)`` bool, the groups without a token."""
        return self.mass == 0

    @cached_property
    def weights(self) -> torch.Tensor:
        """``(B, H, E, G)``: an expert's share of its group's tokens in its group's column, zero in
        the others, so that experts' scores times these weights are their groups' scores (the
        token-weighted mean of the experts' scores) in one product."""
        b, h, experts = self.count.shape
        g = self.groups
        share = self.count.float().view(b, h, g, experts // g) / self.divisor.view(b, h, g, 1)
        share = share.view(b, h, experts)
        return torch.where(_in_group(experts, g, share), share[..., None], 0.0)


_IN_GROUP: dict[tuple[int, int, object], torch.Tensor] = {}


def _in_group(experts: int, groups: int, like: torch.Tensor) -> torch.Tensor:
    """``(E, G)`` bool: expert ``e`` lies in group ``e // (E / G)``; kept per shape and device
    (read-only)."""
    key = (experts, groups, devices.device_of(like))
    held = _IN_GROUP.get(key)
    if held is None:
        with torch.inference_mode(False):  # a plain tensor, also when first asked inside a forward
            e = torch.arange(experts, device=like.device)[:, None]
            held = _IN_GROUP[key] = e // (experts // groups) == torch.arange(groups, device=like.device)
    return held


def group_choice(
    score: torch.Tensor,
    count: torch.Tensor,
    groups: int,
    top_groups: int,
    k: int,
    mass: GroupMass | None = None,
    none_empty: bool = False,
    pad: bool = False,
) -> torch.Tensor:
    """``(B, H, q, E)`` bool: top-``k`` experts inside the ``top_groups`` best groups.

    Args:
        score: ``(B, H, q, E)``, -inf for empty experts; count: ``(B, H, E)`` tokens per expert.
        mass: :meth:`GroupMass.of` ``count``, when already made.
        none_empty: known on the host that every expert holds a token (nothing to mask).
    """
    *lead, experts = score.shape
    per = experts // groups
    mass = GroupMass.of(count, groups) if mass is None else mass
    # q · mean key of the group: the experts' scores weighted by their shares of its tokens, in one
    # product (version 3; version 2 summed the scores times the sizes and divided by the group's)
    gscore = (score if none_empty else torch.where(mass.held, score, 0.0)) @ mass.weights
    if not none_empty:
        gscore = gscore.masked_fill(mass.empty, float("-inf"))
    inside = top_k_choice(gscore, top_groups, none_empty)[..., None]  # (B, H, q, G, 1)
    kept = torch.where(inside, score.reshape(*lead, groups, per), float("-inf"))
    # the k best lie inside the chosen groups (k <= top_groups * per), finite where none is empty
    return top_k_choice(kept.view(*lead, experts), k, none_empty, pad)


@dataclass
class HierarchicalRouter(PositionExperts, ExpertRouter):
    """Position-block experts in groups; top groups first, then top experts inside them."""

    name: str = "hierarchical"
    # 2: a block's mean key as its keys weighted by 1 / its size; 3: a group's score as its experts'
    # scores weighted by their shares of its tokens, one product (issue 29, CHANGELOG.md)
    # 4: block sums in the keys' dtype (bfloat16/float16 only, CHANGELOG.md)
    version = 4
    num_experts: int = 16
    num_groups: int = 4
    top_groups: int = 2
    top_k: int = 4
    _mass: GroupMass | None = field(default=None, init=False, repr=False, compare=False)  # the step's

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

    def most_read(self) -> int:
        return self.top_k

    def choose(
        self, layer: int, store: TechniqueStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        mass = self._mass
        if mass is None or mass.count is not count:  # once per step where the layers share ``count``
            mass = self._mass = GroupMass.of(count, self.num_groups)
        full = self.none_empty(count)
        return group_choice(score, count, self.num_groups, self.top_groups, self.top_k, mass, full, pad=True)
