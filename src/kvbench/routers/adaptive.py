"""Top-p expert routing (kvbench's own): position-block experts; each query reads the smallest set
of experts whose softmax(score/τ) mass reaches ``top_p``, clamped to ``k_min ≤ k ≤ k_max``.

The score of an expert is the attention logit of its mean key, summed over the query heads of
the KV head's group: Σ_g q_g · mean(K_e) / √D. A query whose mass is spread reads more experts,
a peaked one fewer; ``top_p = 1`` (with ``k_max = num_experts``) reads every expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError
from kvbench.routers.expert import ExpertRouter, PositionExperts


def top_p_choice(
    score: torch.Tensor, top_p: float, temperature: float, k_min: int, k_max: int
) -> torch.Tensor:
    """``(..., E)`` bool: the smallest prefix (by score) whose softmax(score/τ) mass is ≥ ``top_p``.

    The count is clamped to ``[k_min, k_max]`` and to the non-empty (finite) experts.
    """
    finite = torch.isfinite(score)
    n = finite.sum(-1, keepdim=True)
    logits = (score / temperature).masked_fill(n == 0, 0.0)
    prob = torch.softmax(logits, -1)
    sorted_p, order = prob.sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the better experts
    k = (before < top_p).sum(-1, keepdim=True) if top_p < 1 else n
    k = torch.minimum(k.clamp(k_min, k_max), n)
    ranked = torch.arange(score.shape[-1], device=score.device) < k
    return torch.zeros_like(ranked).scatter(-1, order, ranked) & finite


@dataclass
class AdaptiveRouter(PositionExperts, ExpertRouter):
    """Position blocks; each query reads a top-p set of them (between ``k_min`` and ``k_max``)."""

    name: str = "adaptive"
    num_experts: int = 8
    top_p: float = 0.9
    temperature: float = 1.0
    k_min: int = 1
    k_max: int = 4
    experts_read: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)  # per call

    def check_knobs(self) -> None:
        self.check_experts()
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"router.top_p={self.top_p}: must be in (0, 1]")
        if not self.temperature > 0:
            raise ConfigError(f"router.temperature={self.temperature}: must be > 0")
        if not 1 <= self.k_min <= self.num_experts:
            raise ConfigError(f"router.k_min={self.k_min}: must be in 1..num_experts ({self.num_experts})")
        if not self.k_min <= self.k_max <= self.num_experts:
            raise ConfigError(
                f"router.k_max={self.k_max}: must be in k_min..num_experts ({self.k_min}..{self.num_experts})"
            )

    def choose(
        self, layer: int, store: LayerStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        scaled = score * store.head_dim**-0.5
        chosen = top_p_choice(scaled, self.top_p, self.temperature, self.k_min, self.k_max)
        per_query = chosen.sum(-1)  # (B, H, q)
        if not store.last_padded and qpos.shape == store.last_qpos.shape:  # every query real
            self.experts_read.append(per_query.float().mean())  # kept a tensor: no synchronisation
        else:
            real = (qpos >= 0)[:, None, :].expand(chosen.shape[:3])
            if bool(real.any()):
                self.experts_read.append(per_query[real].float().mean())
        return chosen

    def metrics(self) -> dict[str, float | list[float] | None]:
        out = super().metrics()
        if out:
            reads = [float(x) for x in self.experts_read]
            out["mean_experts_read"] = sum(reads) / len(reads) if reads else None
        return out
