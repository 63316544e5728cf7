"""kvbench's own forward loop over a compressed cache: prefill, compress, score or decode.

transformers' ``generate()`` is not used: it would crop, reorder or expand the cache in ways a
compressed cache refuses, and it cannot apply the stack between steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

import torch

from kvbench import limits
from kvbench.cache import timing
from kvbench.cache.engine import KVCache
from kvbench.eval import measure
from kvbench.kernels import dispatch
from kvbench.models import LoadedModel
from kvbench.stack import Stack


def new_cache(
    lm: LoadedModel, stack: Stack, shadow: bool | Collection[int] = False, batch: int = 1
) -> KVCache:
    """An empty cache for ``stack``; ``shadow``: the layers whose exact keys the KV-hit probe keeps
    (True: every layer)."""
    return KVCache(
        stack, lm.num_layers, lm.kv_heads, lm.head_dim, batch, lm.dtype, lm.layer_devices, shadow=shadow
    )


_WARM: weakref.WeakSet = weakref.WeakSet()  # models warmed up in this process


def warm_up(lm: LoadedModel) -> None:
    """A short untimed prefill and decode step through a throwaway full cache, once per model per
    process: the first timed pass of a job then measures the model, not the allocator's first
    requests and the kernels' first launches."""
    if lm.model in _WARM:
        return
    stack = Stack()
    stack.bind(lm.num_layers)
    cache = new_cache(lm, stack)
    forward(lm, cache, list(range(16)), keep=1)
    cache.after_forward()
    forward(lm, cache, [0], keep=1)
    measure.sync(lm.devices)
    _WARM.add(lm.model)


def kernels_may_run(lm: LoadedModel) -> bool:
    """Whether the current cell may call a Triton kernel: its path is not ``torch`` and a device
    holding the model is a GPU (on a CPU ``auto`` is torch's path)."""
    return dispatch.active() != "torch" and any(d.type == "cuda" for d in lm.devices)


def warm_up_kernels(
    lm: LoadedModel, make_stack: Callable[[], Stack], tokens: int = 512, steps: int = 6
) -> bool:
    """Where a Triton kernel may run (:func:`kernels_may_run`): an untimed prefill of ``tokens`` and
    ``steps`` decode steps through ``make_stack()``, a throwaway stack built and bound as the cell's,
    so that the cell's timed passes do not include the kernels' first calls.

    The first call of a Triton kernel in a process compiles it, or loads it from Triton's disk
    cache; on an H200 that put 21.6 s into a prefill and 170 ms into each decode step of the first
    cell that called KIVI's kernels (docs/kernels.md, 2026-11-27). Several steps, since a kernel
    compiles again for new alignments of its integer arguments; batch 1 only. It runs in a
    dispatch cell of its own (the kernels it takes are not the cell's record) and restores the
    random number generators, so the cell computes what it computes without it. Returns whether
    it ran."""
    if not kernels_may_run(lm):
        return False
    vocab = int(lm.model.config.vocab_size)
    ids = [(7 * i + 1) % vocab for i in range(tokens + steps)]
    cuda = sorted({d.index or 0 for d in lm.devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda), dispatch.using(dispatch.active()):
        cache = new_cache(lm, make_stack())
        step(lm, cache, ids[:tokens], keep=1)
        for i in range(tokens, tokens + steps):
            step(lm, cache, ids[i : i + 1], keep=1)
        measure.sync(lm.devices)
        del cache
    return True


def _logits(lm: LoadedModel, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, keep: int | None):
    """The model's logits ``(B, k, V)`` for the last ``k = keep`` of the chunk's columns (None: all).

    transformers reads an int ``logits_to_keep`` as the last rows (0 meaning every row) and a
    tensor as row indices, so no row at all is an empty index: the lm head then never runs over a
    prefill whose logits nobody reads. A model without ``logits_to_keep`` computes every row.
    """
    n = ids.shape[1]
    rows: dict[str, object] = {}
    if keep is not None and keep < n and lm.keeps_rows:
        rows["logits_to_keep"] = keep if keep > 0 else torch.zeros(0, dtype=torch.long)
    out = lm.model(input_ids=ids, position_ids=pos, use_cache=True, **{lm.cache_arg: cache}, **rows)
    logits = out.logits
    if keep is not None and logits.shape[1] > keep:
        logits = logits[:, logits.shape[1] - keep :]
    return logits.float()


@torch.inference_mode()
def forward(
    lm: LoadedModel, cache: KVCache, ids: list[int] | torch.Tensor, keep: int | None = None
) -> torch.Tensor:
    """Feed ``ids`` (one sequence) at the cache's true positions; returns logits ``(k, V)`` fp32 of
    the last ``k = keep`` positions (None: all; 0: none), the only rows the lm head computes."""
    x = torch.as_tensor(ids, device=lm.device).view(1, -1)
    pos = cache.stores[0].next_positions(x.shape[1], lm.device)  # the layers append at these, made once
    return _logits(lm, x, pos, cache, keep)[0]


@torch.inference_mode()
def forward_batch(
    lm: LoadedModel, cache: KVCache, ids: torch.Tensor, real: torch.Tensor, keep: int | None = None
) -> torch.Tensor:
    """Feed a padded batch ``ids`` ``(B, q)``; ``real`` ``(B, q)`` marks non-padding tokens.

    Each sequence continues at its own true position; padding is neither stored nor counted.
    Returns logits ``(B, k, V)`` fp32 of the last ``k = keep`` columns (None: all; rows of padding
    are meaningless).
    """
    ids, real = ids.to(lm.device), real.to(lm.device)
    seen = cache.stores[0].seen.to(lm.device)
    pos = (seen[:, None] + real.long().cumsum(-1) - 1).clamp(min=0)
    cache.real = real
    try:
        return _logits(lm, ids, pos, cache, keep)
    finally:
        cache.real = None


@contextmanager
def _timed(lm: LoadedModel, cache: KVCache, times: list[float], decode: bool) -> Iterator[None]:
    """The step's timed region, appended to ``times``; a ``decode`` step that the cell's attention
    timer samples (:func:`timing.sampled`) carries the timer on ``cache`` while it runs."""
    cache.timer = timing.sampled(len(cache.stores)) if decode else None
    try:
        with measure.timed(lm.devices, times):
            yield
    finally:
        cache.timer = None


def step(
    lm: LoadedModel,
    cache: KVCache,
    ids,
    times: list[float] | None = None,
    keep: int | None = None,
    decode: bool = False,
) -> torch.Tensor:
    """One forward chunk followed by the stack (compressor, scheduler, router writes); optionally timed.

    ``keep``: the logits of the last ``keep`` positions only (None: every position; 0: none).
    ``decode``: a timed decode step, which the cell's attention timer may sample
    (:mod:`kvbench.cache.timing`). The cell's deadline (``timeout_s``) is checked before the chunk,
    and the techniques' figures kept for later settled where enough wait
    (:meth:`~kvbench.stack.Stack.settle`), outside any timed region.
    """
    limits.check()
    cache.stack.settle()
    if times is None:
        logits = forward(lm, cache, ids, keep)
        cache.after_forward()
        return logits
    with _timed(lm, cache, times, decode):
        logits = forward(lm, cache, ids, keep)
        cache.after_forward()
    return logits


def step_batch(
    lm: LoadedModel,
    cache: KVCache,
    ids: torch.Tensor,
    real: torch.Tensor,
    times: list[float],
    keep: int | None = None,
    decode: bool = False,
) -> torch.Tensor:
    """:func:`step` for a padded batch (see :func:`forward_batch`); always timed into ``times``."""
    limits.check()
    cache.stack.settle()
    with _timed(lm, cache, times, decode):
        logits = forward_batch(lm, cache, ids, real, keep)
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
    """Greedy decoding from ``first_logits``; each step timed into ``times`` (and sampled by the
    cell's attention timer); stops at EOS, after ``max_new`` tokens, or once ``done(tokens)``."""
    tokens = [int(first_logits.argmax())]
    while len(tokens) < max_new and tokens[-1] != lm.codec.eos_id and not (done and done(tokens)):
        logits = step(lm, cache, [tokens[-1]], times, decode=True)
        tokens.append(int(logits[-1].argmax()))
    return tokens
