"""Per-layer effective rank of causal attention on calibration text: the weights of ``rankkv``.

RankKV splits a KV budget across layers in proportion to how many directions a layer's attention
really uses. The measure is Roy & Vetterli's effective rank (EUSIPCO 2007): with singular values
``s`` of a matrix and ``p = s / sum(s)``, ``erank = exp(-sum(p * log p))``. It is 1 for a rank-one
matrix and ``n`` for an ``n x n`` identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbench.cache.capture import Capture, run


def effective_rank(matrix: torch.Tensor) -> torch.Tensor:
    """Roy & Vetterli effective rank of ``matrix`` ``(..., m, n)``: ``(...)`` float64, in [1, min(m, n)].

    Singular values are computed in float64, one matrix at a time (batched SVD is much slower on CPU).
    """
    flat = matrix.detach().double().reshape(-1, *matrix.shape[-2:])
    ranks = torch.stack([_erank(torch.linalg.svdvals(m)) for m in flat])
    return ranks.reshape(matrix.shape[:-2])


def _erank(s: torch.Tensor) -> torch.Tensor:
    p = s / s.sum()
    return torch.exp(-torch.special.xlogy(p, p).sum())


def effective_ranks(lm, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Effective rank of each layer's causal attention probabilities on ``ids``.

    Args:
        lm: a :class:`kvbench.models.LoadedModel`.
        ids: calibration token ids ``(T,)``.

    Returns:
        ``(L,)`` float64: per layer, the effective rank of the ``(T, T)`` attention probability matrix
        of each query head, averaged over heads; each value is in [1, T].
    """
    per_layer: dict[int, torch.Tensor] = {}

    def on_probs(layer: int, probs: torch.Tensor) -> None:
        per_layer[layer] = effective_rank(probs).mean()

    with torch.no_grad():
        run(lm, ids, Capture(on_probs=on_probs))
    return torch.stack([per_layer[i] for i in range(lm.num_layers)]).cpu()
