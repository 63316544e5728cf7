"""Online k-means routing (Routing Transformer, arXiv:2003.05997) with a locality bonus
(kvbench's own).

Write: a token leaving the window joins its nearest running centroid; centroids move by an
exponential moving average, ``μ ← λ·μ + (1 − λ)·k`` per assigned key in position order
(``λ = centroid_decay``; an expert's first keys set it to their mean). Read: each query takes the
``top_k`` experts by Σ_g q_g · μ_e / √D + ``locality_bonus`` · [e was read at the previous step
by this KV head]. "The previous step" is the last real query of the previous forward (a decode
step, or a chunk); every query of a chunk uses it. The previous choice ``(B, H, E)`` bool is kept
in the layer's side data with the centroids, so its bytes are counted.

Differences from the Routing Transformer: there, queries and keys share centroids on the unit
sphere (keys and queries are layer-normalised) and the EMA is taken over a batch's sum; here the
centroids cluster the cached (rotated, unnormalised) keys only, the nearest centroid is by
Euclidean distance, and the EMA is applied token by token, so a read's q · μ is the logit of a
mean key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache.side import SideData
from kvbench.cache.surface import TechniqueStore, every_query_real
from kvbench.errors import ConfigError
from kvbench.routers.centroids import CentroidExperts
from kvbench.routers.expert import ExpertRouter, expert_ids, expert_onehot, expert_sums, top_k_choice


@dataclass
class PreviousChoice(SideData):
    """``chosen`` ``(B, H, E)`` bool: the experts each KV head read at the previous step."""

    chosen: torch.Tensor


def ema_update(
    cent: torch.Tensor,
    count: torch.Tensor,
    keys: torch.Tensor,
    eid: torch.Tensor,
    new: torch.Tensor,
    pos: torch.Tensor,
    decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token EMA of each expert's new keys, in position order; an expert with no history
    takes the mean of its new keys. Returns the centroids ``(B, H, E, D)`` and counts ``(B, H, E)``."""
    experts = cent.shape[2]
    onehot = expert_onehot(eid, new, experts)  # (B, H, T, E)
    m = onehot.sum(2)
    order = torch.where(new, pos, torch.full_like(pos, torch.iinfo(pos.dtype).max)).argsort(-1)
    idx = order[..., None].expand_as(onehot)
    rank = torch.zeros_like(onehot).scatter(2, idx, onehot.gather(2, idx).cumsum(2) - 1)
    later = ((m[:, :, None, :] - 1 - rank) * onehot).sum(-1)  # new keys of its expert after this one
    weight = (1 - decay) * torch.pow(torch.full_like(later, decay), later) * new
    ema = decay ** m[..., None] * cent + expert_sums(onehot * weight[..., None], keys)
    mean = expert_sums(onehot, keys) / m.clamp(min=1)[..., None]
    moved = torch.where(count[..., None] > 0, ema, mean)
    return torch.where(m[..., None] > 0, moved, cent), count + m


@dataclass
class PikvRouter(CentroidExperts, ExpertRouter):
    """Online k-means experts; top-k read with a bonus for the experts read at the previous step."""

    # 2: the decode step's one-token distance, update and choice; 3: a write after drops seeds
    # from its earliest new tokens (issue 29, CHANGELOG.md)
    version = 3
    name: str = "pikv"
    num_experts: int = 8
    top_k: int = 2
    locality_bonus: float = 0.5
    centroid_decay: float = 0.99

    def check_knobs(self) -> None:
        self.check_experts()
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"router.top_k={self.top_k}: must be in 1..num_experts ({self.num_experts})")
        if not self.locality_bonus >= 0:
            raise ConfigError(f"router.locality_bonus={self.locality_bonus}: must be >= 0")
        if not 0.0 <= self.centroid_decay < 1.0:
            raise ConfigError(f"router.centroid_decay={self.centroid_decay}: must be in [0, 1)")

    def update(
        self,
        cent: torch.Tensor,
        count: torch.Tensor,
        keys: torch.Tensor,
        eid: torch.Tensor,
        new: torch.Tensor,
        pos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ema_update(cent, count, keys, eid, new, pos, self.centroid_decay)

    def update_one(
        self, cent: torch.Tensor, count: torch.Tensor, key: torch.Tensor, eid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`ema_update` with one new key ``(B, H, 1, D)`` per head-row, in expert ``eid``
        ``(B, H, 1)``, every expert having held a token (every count positive, so every centroid
        moves by the EMA): its expert's new keys are that key alone (``m = 1``, no later key, so
        weight ``1 - λ``), the other experts keep their centroids: ``c + (1 - λ)·(k - c)``, one
        interpolation whose weight is 0 for the others (``c + 0``, exactly ``c``)."""
        hit = (eid[..., None] == expert_ids(self.num_experts, eid))[:, :, 0]  # (B, H, E)
        weight = torch.where(hit, 1 - self.centroid_decay, 0.0)[..., None]
        return cent.lerp(key, weight), count + hit

    def choose(
        self, layer: int, store: TechniqueStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        b, h, _, e = score.shape
        side = store.side(PreviousChoice)
        prev = None if side is None else side.chosen
        if prev is None:
            prev = torch.zeros(b, h, e, dtype=torch.bool, device=score.device)
        # score/√D + bonus·prev ranked as score + (bonus·√D)·prev: the same order, one operation
        ranked = score.add(prev[:, :, None, :], alpha=self.locality_bonus * store.head_dim**0.5)
        chosen = top_k_choice(ranked, self.top_k, self.all_held(store, count))
        if every_query_real(store, qpos):  # every query real
            now = chosen[:, :, -1].contiguous()  # the last query's
        else:
            last = qpos.argmax(-1)[:, None, None, None].expand(b, h, 1, e)  # the last real query
            now = chosen.gather(2, last).squeeze(2)
            now = torch.where((qpos >= 0).any(-1)[:, None, None], now, prev)
        store.set_side(PreviousChoice(now))
        return chosen
