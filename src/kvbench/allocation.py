"""Layer budget allocations: how a token budget is split across layers (docs/methods.md).

Each returns one weight per layer with mean 1; a layer keeps ``weight * budget`` of its tokens
(capped at everything it has), so the stack-wide budget is unchanged where no layer saturates.

- ``uniform``: every layer the same.
- ``pyramid``: PyramidKV (arXiv:2406.02069), an arithmetic decrease from the bottom layer to the
  top, the top layer keeping ``1 / beta`` of the mean.
- ``rankkv``: proportional to the effective rank of each layer's attention on calibration text
  (RankKV); a calibration artifact.
- ``inverse``: proportional to 1 / effective rank (RankKV's ablation).
- ``random``: random positive weights from ``seed`` (RankKV's ablation).
"""

from __future__ import annotations

import torch

from kvbench.calibration.artifacts import rankkv_artifact
from kvbench.errors import ConfigError

ALLOCATIONS = ("uniform", "pyramid", "rankkv", "random", "inverse")


def check(key: str, value: str) -> None:
    if value not in ALLOCATIONS:
        raise ConfigError(f"{key}={value!r}: allowed {', '.join(ALLOCATIONS)}")


def layer_weights(kind: str, ctx, beta: float = 20.0, seed: int = 0) -> torch.Tensor:
    """``(L,)`` float64 weights with mean 1 for allocation ``kind``."""
    n = ctx.num_layers
    if kind == "uniform":
        w = torch.ones(n, dtype=torch.float64)
    elif kind == "pyramid":
        top = 1.0 / beta
        w = (
            torch.linspace(2.0 - top, top, n, dtype=torch.float64)
            if n > 1
            else torch.ones(1, dtype=torch.float64)
        )
    elif kind == "random":
        g = torch.Generator().manual_seed(seed)
        w = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    elif kind in ("rankkv", "inverse"):
        ranks = effective_ranks(ctx)
        w = ranks if kind == "rankkv" else 1.0 / ranks
    else:
        check("allocation", kind)
    return w / w.mean()


def effective_ranks(ctx) -> torch.Tensor:
    """Per-layer effective rank of attention on calibration text, cached on disk and recorded."""
    if ctx.model is None:
        raise ConfigError(
            "allocation=rankkv needs the model's attention on calibration text (bind with a model)"
        )
    tensors, record = rankkv_artifact(ctx.model)
    if record not in ctx.calibrations:
        ctx.calibrations.append(record)
    return tensors["ranks"].double()
