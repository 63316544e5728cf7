"""Top-p expert routing (kvbench's own): position-block experts; each query reads the smallest set
of experts whose softmax(score/τ) mass reaches ``top_p``, clamped to ``k_min ≤ k ≤ k_max``.

The score of an expert is the attention logit of its mean key, summed over the query heads of
the KV head's group: Σ_g q_g · mean(K_e) / √D. A query whose mass is spread reads more experts,
a peaked one fewer; ``top_p = 1`` (with ``k_max = num_experts``) reads every expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.cache import devices
from kvbench.cache.reads import read_all
from kvbench.cache.surface import TechniqueStore, every_query_real
from kvbench.errors import ConfigError
from kvbench.routers.expert import ExpertRouter, Experts, PositionExperts, choice_at, pad_choice


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

    The count is clamped to ``[k_min, k_max]`` and to the non-empty (finite) experts. The expert at
    place ``i`` of the order is read while the mass before it, the running sum of the places
    before (version 3: a running sum of probabilities never decreases, so the places read are a
    prefix), is under ``top_p``. ``finite``: known on the host that every score is (every expert
    holds a token), so none is looked at, and the places from ``k_min`` to ``k_max`` are scattered
    into an empty choice (no count, no inverse permutation). ``pad``: as
    :func:`~kvbench.routers.expert.no_choice`'s.
    """
    every = None if finite else torch.isfinite(score)
    # A row without a finite score chooses nothing (k <= n = 0), whatever its probabilities.
    n = None if every is None else every.sum(-1, keepdim=True)
    prob = torch.softmax(score if temperature == 1 else score / temperature, -1)
    sorted_p, order = prob.sort(dim=-1, descending=True, stable=True)
    e = score.shape[-1]
    if every is None:  # the first places of the order, from the host's bounds
        hi = min(k_max, e)
        if top_p >= 1:
            return choice_at(score, order[..., :hi], None, pad)
        lo = min(k_min, hi)
        # place i (lo <= i < hi) is read iff the mass of places 0 .. i - 1 is under top_p; the
        # comparison is written after the ``lo`` places always read (no pad of its own)
        mass = sorted_p[..., : hi - 1].cumsum(-1)
        if lo > 1:
            mass = mass[..., lo - 1 :]
        read, compared = read_places(mass, lo)
        torch.lt(mass, top_p, out=compared)
        return choice_at(score, order[..., :hi], read, pad)
    assert n is not None  # some score may not be finite: counted
    k: torch.Tensor
    if top_p < 1:
        before = torch.constant_pad_nd(sorted_p[..., :-1].cumsum(-1), (1, 0), 0.0)  # mass before each place
        k = (before < top_p).sum(-1, keepdim=True).clamp(k_min, k_max)
    else:
        k = n.clamp(k_min, k_max)
    k = torch.minimum(k, n)
    rank = order.argsort(-1)  # each expert's place in ``order`` (the inverse permutation)
    chosen = (rank < k) & every
    return pad_choice(chosen) if pad else chosen


_PLACES: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def read_places(mass: torch.Tensor, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A held bool buffer ``(..., lo + n)`` for ``mass`` ``(..., n)``, its first ``lo`` columns
    True, and the view of its other columns, where :func:`top_p_choice` writes its comparison (a
    pad of the comparison's result would be one operation more a call). Made once per shape,
    device and ``lo``; each call's values are copied out by the choice's scatter before the next
    call writes them (on a GPU, in stream order)."""
    key = (mass.shape, devices.device_of(mass), lo)
    held = _PLACES.get(key)
    if held is None:
        if len(_PLACES) >= 64:  # chunks of many lengths: start over rather than grow
            _PLACES.clear()
        with torch.inference_mode(False):  # a plain tensor, written inside or outside a forward
            buffer = torch.ones(*mass.shape[:-1], lo + mass.shape[-1], dtype=torch.bool, device=mass.device)
            held = _PLACES[key] = buffer, buffer[..., lo:]
    return held


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
    # 2: a block's mean key as its keys weighted by 1 / its size; 3: the score scale folded into
    # those weights, the mass before a place as the running sum of the places before it (issue
    # 29, CHANGELOG.md)
    # 4: block sums in the keys' dtype (bfloat16/float16 only, CHANGELOG.md)
    version = 4
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

    def summarize(self, layer: int, store: TechniqueStore, experts: Experts) -> torch.Tensor:
        """Each block's mean key times ``1 / (√D · τ)``: the scores of these centroids are the
        logits ``q · mean(K_e) / √D`` over the temperature, which :meth:`choose` takes as they are
        (the scale folded into the step's mean weights, made once for its layers: no product a
        layer)."""
        return self.scaled_means(store, experts, store.head_dim**-0.5 / self.temperature)

    def choose(
        self, layer: int, store: TechniqueStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        full = self.none_empty(count)  # ``score``: scaled and over τ already (:meth:`summarize`)
        padded = top_p_choice(score, self.top_p, 1.0, self.k_min, self.k_max, full, pad=True)
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
