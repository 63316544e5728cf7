"""Top-p expert routing (kvbench's own): position-block experts; each query reads the smallest set
of experts whose softmax(score/τ) mass reaches ``top_p``, clamped to ``k_min ≤ k ≤ k_max``.

The score of an expert is the attention logit of its mean key, summed over the query heads of
the KV head's group: Σ_g q_g · mean(K_e) / √D. A query whose mass is spread reads more experts,
a peaked one fewer; ``top_p = 1`` (with ``k_max = num_experts``) reads every expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from kvbench.cache import devices
from kvbench.cache.reads import read_all
from kvbench.cache.surface import TechniqueStore, every_query_real
from kvbench.errors import ConfigError
from kvbench.routers.expert import ExpertRouter, PositionExperts, choice_at, pad_choice


def top_p_choice(
    score: torch.Tensor,
    top_p: float,
    temperature: float,
    k_min: int,
    k_max: int,
    finite: bool = False,
    pad: bool = False,
) -> torch.Tensor:
    """``(..., E)`` bool: the smallest prefix (by score) whose softmax(score/τ) mass is ≥ ``top_p``.

    The count is clamped to ``[k_min, k_max]`` and to the non-empty (finite) experts; ``finite``:
    known on the host that every score is (every expert holds a token), so none is looked at, and
    the first ``k`` of the order are scattered into an empty choice (no inverse permutation).
    ``pad``: as :func:`~kvbench.routers.expert.no_choice`'s.
    """
    every = None if finite else torch.isfinite(score)
    # A row without a finite score chooses nothing (k <= n = 0), whatever its probabilities.
    n = None if every is None else every.sum(-1, keepdim=True)
    prob = torch.softmax(score if temperature == 1 else score / temperature, -1)  # x / 1 is x
    sorted_p, order = prob.sort(dim=-1, descending=True, stable=True)
    k: torch.Tensor | int
    if top_p < 1:
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the better experts
        k = (before < top_p).sum(-1, keepdim=True).clamp(k_min, k_max)
    else:
        k = min(score.shape[-1], k_max) if n is None else n.clamp(k_min, k_max)
    if every is None:  # the first k experts of the order
        if isinstance(k, int):
            return choice_at(score, order[..., :k], None, pad)
        return choice_at(score, order, devices.arange(score.shape[-1], k) < k, pad)
    k = torch.minimum(cast(torch.Tensor, k), cast(torch.Tensor, n))
    rank = order.argsort(-1)  # each expert's place in ``order`` (the inverse permutation)
    chosen = (rank < k) & every
    return pad_choice(chosen) if pad else chosen


def mean_per_query(chosen: list[torch.Tensor]) -> list[torch.Tensor]:
    """Experts read per query of each ``chosen`` ``(B, H, q, E)``, averaged over its queries and
    head-rows: ``chosen.sum(-1).float().mean()`` of each, those of one shape at once (whole counts,
    so each row sums exactly and takes the same division; at most 2**24 counts a batch, so the
    batch's divisor is exact too)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(chosen)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, c in enumerate(chosen):
        groups.setdefault((c.shape, c.device), []).append(i)
    for (shape, _), idx in groups.items():
        step = max(1, (1 << 24) // max(shape[:-1].numel(), 1))
        for at in range(0, len(idx), step):
            part = idx[at : at + step]
            means = torch.stack([chosen[i] for i in part]).sum(-1).float().flatten(1).mean(-1)
            for i, m in zip(part, means):
                out[i] = m
    return out


@dataclass
class AdaptiveRouter(PositionExperts, ExpertRouter):
    """Position blocks; each query reads a top-p set of them (between ``k_min`` and ``k_max``)."""

    name: str = "adaptive"
    version = 2  # 2: a block's mean key as its keys weighted by 1 / its size (issue 29, CHANGELOG.md)
    num_experts: int = 8
    top_p: float = 0.9
    temperature: float = 1.0
    k_min: int = 1
    k_max: int = 4
    # per call: the experts its queries read (B, H, q, E) where all are real, else their mean (0-d)
    experts_read: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)

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

    def most_read(self) -> int:
        return self.k_max

    def choose(
        self, layer: int, store: TechniqueStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        scaled = score * store.head_dim**-0.5
        full = self.none_empty(count)
        padded = top_p_choice(scaled, self.top_p, self.temperature, self.k_min, self.k_max, full, pad=True)
        chosen = padded[..., : self.num_experts]
        if every_query_real(store, qpos):  # every query real
            self.experts_read.append(chosen)  # averaged when read (:func:`mean_per_query`)
        else:
            real = (qpos >= 0)[:, None, :].expand(chosen.shape[:3])
            if bool(real.any()):
                self.experts_read.append(chosen.sum(-1)[real].float().mean())
        return padded

    def metrics(self) -> dict[str, float | list[float] | None]:
        out = super().metrics()
        if out:
            calls = self.experts_read
            whole = [i for i, x in enumerate(calls) if x.dim()]
            means = dict(zip(whole, mean_per_query([calls[i] for i in whole])))
            reads = read_all([means.get(i, x) for i, x in enumerate(calls)])  # one read a device
            out["mean_experts_read"] = sum(reads) / len(reads) if reads else None
        return out
