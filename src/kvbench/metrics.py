"""Pure metric functions, hand-checked in tests."""

from __future__ import annotations

import math

import numpy as np
import torch


def kl_and_top1(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL(P_ref || P) and top-1 agreement.

    Args:
        ref_logprobs, logprobs: ``(n, V)`` log-probabilities.

    Returns:
        ``kl`` ``(n,)`` in nats and ``agree`` ``(n,)`` bool.
    """
    ref = ref_logprobs.float()
    kl = (ref.exp() * (ref - logprobs.float())).sum(-1)
    return kl, ref.argmax(-1) == logprobs.argmax(-1)


def bootstrap_ci(values: np.ndarray, stat, n_boot: int = 1000, seed: int = 0, alpha: float = 0.05):
    """Percentile bootstrap interval of ``stat`` over resampled rows of ``values`` (paired rows)."""
    rng = np.random.default_rng(seed)
    n = len(values)
    stats = np.array([stat(values[rng.integers(0, n, n)]) for _ in range(n_boot)])
    lo, hi = np.quantile(stats, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def accuracy_drop(base: list[float], stack: list[float]) -> dict:
    """Points of accuracy lost (baseline - stack, in percentage points), paired bootstrap interval.

    Null when the baseline accuracy is 0 (nothing to lose).
    """
    pairs = np.stack([np.asarray(base, float), np.asarray(stack, float)], axis=1)
    if pairs[:, 0].mean() == 0:
        return {"name": "accuracy_points", "value": None, "ci_low": None, "ci_high": None}
    stat = lambda p: 100.0 * (p[:, 0].mean() - p[:, 1].mean())
    lo, hi = bootstrap_ci(pairs, stat)
    return {"name": "accuracy_points", "value": stat(pairs), "ci_low": lo, "ci_high": hi}


def perplexity_drop(base_nll: list[float], stack_nll: list[float]) -> tuple[dict, dict]:
    """ΔPPL % and ΔNLL (nats/token) over paired units (e.g. scoring chunks' mean NLL), with intervals."""
    pairs = np.stack([np.asarray(base_nll, float), np.asarray(stack_nll, float)], axis=1)
    d_nll = lambda p: p[:, 1].mean() - p[:, 0].mean()
    d_ppl = lambda p: 100.0 * (math.exp(d_nll(p)) - 1.0)
    lo, hi = bootstrap_ci(pairs, d_ppl)
    nlo, nhi = bootstrap_ci(pairs, d_nll)
    return (
        {"name": "delta_ppl_pct", "value": d_ppl(pairs), "ci_low": lo, "ci_high": hi},
        {"value": d_nll(pairs), "ci_low": nlo, "ci_high": nhi},
    )


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def task_mean_drop(
    by_task: dict[str, tuple[list[float], list[float]]], n_boot: int = 1000, seed: int = 0
) -> dict:
    """Points lost on a mean of task means (100 x (baseline - stack)), each task's examples paired.

    The interval resamples examples within each task (a stratified paired bootstrap), so every
    task keeps its weight. Null when the baseline scores 0 everywhere.
    """
    pairs = [np.stack([np.asarray(b, float), np.asarray(s, float)], axis=1) for b, s in by_task.values()]
    stat = lambda ps: 100.0 * float(np.mean([p[:, 0].mean() - p[:, 1].mean() for p in ps]))
    if all(p[:, 0].mean() == 0 for p in pairs):
        return {"name": "score_points", "value": None, "ci_low": None, "ci_high": None}
    rng = np.random.default_rng(seed)
    stats = [stat([p[rng.integers(0, len(p), len(p))] for p in pairs]) for _ in range(n_boot)]
    lo, hi = np.quantile(stats, [0.025, 0.975])
    return {"name": "score_points", "value": stat(pairs), "ci_low": float(lo), "ci_high": float(hi)}
