"""Calibrated low-rank bases of pre-RoPE keys and of values: the fitted part of ``lora``.

Palu (arXiv:2407.21118), data-aware variant: the rank-``r`` factorization of a head's projection
``W`` that best reconstructs its outputs ``X W`` on calibration activations ``X`` projects onto the
top-``r`` right-singular vectors of ``X W`` (uncentered). Keys are taken before RoPE (the rotation is
undone at each token's position), as the cache stores them rotated and ``lora`` re-rotates on read.
The right-singular vectors come from the ``D x D`` Gram matrix accumulated in float64, so memory
does not grow with the number of calibration tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbench.cache.capture import Capture, run
from kvbench.cache.rotary import Rotary
from kvbench.errors import ConfigError


def prerope_kv(lm, ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys and values of every layer on ``ids`` ``(T,)``.

    Returns:
        keys, values: ``(L, Hkv, T, D)`` float32 on CPU.
    """
    rotary = Rotary.from_model(lm.model)
    pos = torch.arange(len(ids))
    keys: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}

    def on_kv(layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        keys[layer] = rotary.unrotate(key[0].float(), pos.to(key.device)).cpu()
        values[layer] = value[0].float().cpu()

    with torch.no_grad():
        run(lm, ids, Capture(on_kv=on_kv))
    order = range(lm.num_layers)
    return torch.stack([keys[i] for i in order]), torch.stack([values[i] for i in order])


def kv_bases(
    lm, ids: Sequence[int] | torch.Tensor, key_rank: int, value_rank: int
) -> dict[str, torch.Tensor]:
    """Orthonormal bases of each layer's and KV head's pre-RoPE keys and values on ``ids`` ``(T,)``.

    Args:
        lm: a :class:`kvbench.models.LoadedModel` (rotate-half rotary: Llama, Mistral, Qwen2, GPT-NeoX...).
        ids: calibration token ids.
        key_rank, value_rank: columns kept, each in [1, head_dim].

    Returns:
        ``{"key": (L, Hkv, D, key_rank), "value": (L, Hkv, D, value_rank)}`` float32 on CPU: the top
        right-singular vectors (largest first) of the ``(T, D)`` pre-RoPE keys, and of the values.
    """
    for name, rank in (("key_rank", key_rank), ("value_rank", value_rank)):
        if not 1 <= rank <= lm.head_dim:
            raise ConfigError(f"{name}={rank}: must be in [1, {lm.head_dim}] (the head dimension)")
    rotary = Rotary.from_model(lm.model)
    pos = torch.arange(len(ids))
    grams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_kv(layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        k = rotary.unrotate(key.float(), pos.to(key.device)).double()
        v = value.double()
        grams[layer] = (
            torch.einsum("bhtd,bhte->hde", k, k).cpu(),
            torch.einsum("bhtd,bhte->hde", v, v).cpu(),
        )

    with torch.no_grad():
        run(lm, ids, Capture(on_kv=on_kv))
    order = range(lm.num_layers)
    return {
        "key": torch.stack([principal_basis(grams[i][0], key_rank) for i in order]),
        "value": torch.stack([principal_basis(grams[i][1], value_rank) for i in order]),
    }


def principal_basis(gram: torch.Tensor, rank: int) -> torch.Tensor:
    """Top-``rank`` eigenvectors of symmetric ``gram`` ``(H, D, D)`` (= right-singular vectors of ``X``
    for ``gram = X^T X``): ``(H, D, rank)`` float32, largest first, each column's largest entry positive.
    """
    _, vecs = torch.linalg.eigh(gram.double())
    top = vecs.flip(-1)[..., :rank]
    peak = top.gather(-2, top.abs().argmax(dim=-2, keepdim=True))
    return (top * torch.where(peak < 0, -1.0, 1.0)).float()
