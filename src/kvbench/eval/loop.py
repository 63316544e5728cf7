"""kvbench's own forward loop over a compressed cache: prefill, compress, score or decode.

transformers' ``generate()`` is not used: it would crop, reorder or expand the cache in ways a
compressed cache refuses, and it cannot apply the stack between steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbench import limits
from kvbench.cache.engine import KVCache
from kvbench.eval import measure
from kvbench.models import LoadedModel
from kvbench.stack import Stack


def new_cache(lm: LoadedModel, stack: Stack, shadow: bool = False, batch: int = 1) -> KVCache:
    return KVCache(
        stack, lm.num_layers, lm.kv_heads, lm.head_dim, batch, lm.dtype, lm.layer_devices, shadow=shadow
    )


@torch.inference_mode()
def forward(lm: LoadedModel, cache: KVCache, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Feed ``ids`` (one sequence) at the cache's true positions; returns logits ``(n, V)`` fp32."""
    x = torch.as_tensor(ids, device=lm.device).view(1, -1)
    start = cache.get_seq_length()
    pos = torch.arange(start, start + x.shape[1], device=lm.device).view(1, -1)
    out = lm.model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits[0].float()


@torch.inference_mode()
def forward_batch(lm: LoadedModel, cache: KVCache, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Feed a padded batch ``ids`` ``(B, q)``; ``real`` ``(B, q)`` marks non-padding tokens.

    Each sequence continues at its own true position; padding is neither stored nor counted.
    Returns logits ``(B, q, V)`` fp32 (rows of padding are meaningless).
    """
    ids, real = ids.to(lm.device), real.to(lm.device)
    seen = cache.stores[0].seen.to(lm.device)
    pos = (seen[:, None] + real.long().cumsum(-1) - 1).clamp(min=0)
    cache.real = real
    try:
        out = lm.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
    finally:
        cache.real = None
    return out.logits.float()


def step(lm: LoadedModel, cache: KVCache, ids, times: list[float] | None = None) -> torch.Tensor:
    """One forward chunk followed by the stack (compressor, scheduler, router writes); optionally timed.

    The cell's deadline (``timeout_s``) is checked before the chunk, outside any timed region.
    """
    limits.check()
    if times is None:
        logits = forward(lm, cache, ids)
        cache.after_forward()
        return logits
    with measure.timed(lm.device, times):
        logits = forward(lm, cache, ids)
        cache.after_forward()
    return logits


def step_batch(
    lm: LoadedModel, cache: KVCache, ids: torch.Tensor, real: torch.Tensor, times: list[float]
) -> torch.Tensor:
    """:func:`step` for a padded batch (see :func:`forward_batch`); always timed into ``times``."""
    limits.check()
    with measure.timed(lm.device, times):
        logits = forward_batch(lm, cache, ids, real)
        cache.after_forward()
    return logits


def greedy(
    lm: LoadedModel,
    cache: KVCache,
    first_logits: torch.Tensor,
    max_new: int,
    times: list[float],
    done: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Greedy decoding from ``first_logits``; each step timed into ``times``; stops at EOS, after
    ``max_new`` tokens, or once ``done(tokens)``."""
    tokens = [int(first_logits.argmax())]
    while len(tokens) < max_new and tokens[-1] != lm.codec.eos_id and not (done and done(tokens)):
        logits = step(lm, cache, [tokens[-1]], times)
        tokens.append(int(logits[-1].argmax()))
    return tokens
