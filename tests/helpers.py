"""Small helpers for tests: build stacks and run chunks through the engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from kvbench.eval import loop
from kvbench.roles import BindContext, Budget
from kvbench.stack import Stack


def budget_of(
    budget: float = 1.0, budget_tokens: int | None = None, sinks: int = 4, window: int = 32
) -> Budget:
    """A budget for tests, keeping every token unless told (kvbench's own defaults live in the config)."""
    return Budget(fraction=budget, budget_tokens=budget_tokens, sinks=sinks, window=window)


def make_stack(lm, router=None, compressor=None, scheduler=None, **budget) -> Stack:
    stack = Stack(router=router, compressor=compressor, scheduler=scheduler, budget=budget_of(**budget))
    stack.bind(BindContext.for_model(lm))
    return stack


def run_chunks(lm, stack, ids, sizes, shadow=False, protect=None):
    """Feed ``ids`` in chunks of ``sizes`` with the stack applied after each; returns (logits, cache).

    ``protect``: positions from this one on are protected in every layer before each chunk."""
    cache = loop.new_cache(lm, stack, shadow=shadow)
    outs, at = [], 0
    for n in sizes:
        if protect is not None:
            for store in cache.stores:
                store.set_protect_from(protect)
        outs.append(loop.step(lm, cache, ids[at : at + n]))
        at += n
    return torch.cat(outs), cache


def moved_in_groups(lm, stack_of, sinks: int, window: int) -> None:
    """After every forward (a prefill, chunks, one-token steps; one sequence and a left-padded
    batch of two, whose second sequence starts 3 tokens later), each head-row's compressed tokens
    are whole groups of ``group`` of its oldest unprotected ones, for ``stack_of(group)`` with the
    groups 1 and 6 (``sinks`` and ``window`` its budget's)."""
    h, sizes = lm.kv_heads, [30, 7, 1, 1, 1, 1, 1, 1, 9, 1]
    ids = tokens(sum(sizes))
    protected = budget_of(sinks=sinks, window=window).protected_host
    for group in (1, 6):
        for batch in (1, 2):
            cache = loop.new_cache(lm, stack_of(group), batch=batch)
            at = 0
            for size in sizes:
                chunk = ids[at : at + size]
                if batch == 1:
                    loop.step(lm, cache, chunk)
                else:
                    real = torch.ones(2, size, dtype=torch.bool)
                    real[1, : 3 if at == 0 else 0] = False
                    loop.forward_batch(lm, cache, torch.tensor([chunk, chunk]), real)
                    cache.after_forward()
                at += size
                for store in cache.stores:
                    for seq, seen in enumerate(store.seen_host):
                        movable = seen - protected(seen)
                        for row in range(seq * h, (seq + 1) * h):
                            moved = sum(int(s.rows.lens[row]) for s in store.compressed)
                            assert moved == movable // group * group, (group, batch, at, row)


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def padded_batch_vs_solo(lm, make, a=None, b=None, prefills=(40, 25), chunks=(4, 4, 1, 1), atol=1e-4):
    """Run sequences ``a`` and ``b`` one by one and as one left-padded batch of two, on fresh stacks
    from ``make()``; assert the batch gives each its one-by-one last-token logits and keeps, per
    layer, exactly the head-rows each kept alone. Returns (stack, batched cache, solo caches)."""
    a = tokens(60, 1) if a is None else a
    b = tokens(37, 2) if b is None else b
    solo = []
    for seq, pre in zip((a, b), prefills):
        cache = loop.new_cache(lm, make())
        outs, at = [loop.step(lm, cache, seq[:pre])[-1]], pre
        for n in chunks:
            outs.append(loop.step(lm, cache, seq[at : at + n])[-1])
            at += n
        solo.append((torch.stack(outs), cache))
    stack = make()
    cache = loop.new_cache(lm, stack, batch=2)
    width = max(prefills)
    ids = torch.zeros(2, width, dtype=torch.long)
    real = torch.zeros(2, width, dtype=torch.bool)
    for row, (seq, pre) in enumerate(zip((a, b), prefills)):
        ids[row, width - pre :], real[row, width - pre :] = torch.tensor(seq[:pre]), True
    outs = [loop.forward_batch(lm, cache, ids, real)[:, -1]]
    cache.after_forward()
    at = list(prefills)
    for n in chunks:
        chunk = torch.tensor([a[at[0] : at[0] + n], b[at[1] : at[1] + n]])
        outs.append(loop.forward_batch(lm, cache, chunk, torch.ones_like(chunk, dtype=torch.bool))[:, -1])
        cache.after_forward()
        at = [x + n for x in at]
    batched = torch.stack(outs, 1)
    for row in range(2):
        torch.testing.assert_close(batched[row], solo[row][0], atol=atol, rtol=atol)
    for layer, store in enumerate(cache.stores):
        alone = [s[1].stores[layer].row_tokens() for s in solo]
        assert torch.equal(store.row_tokens(), torch.cat(alone))
    return stack, cache, [s[1] for s in solo]


def run_kvbench(*args: str, tmp: Path, **env: str | None) -> subprocess.CompletedProcess:
    """``python -m kvbench ARGS`` from the checkout, with its cache, Hydra folder and results under
    ``tmp``; ``env`` adds variables (None removes one)."""
    base = {**os.environ, "KVBENCH_CACHE": str(tmp / "cache"), "KVBENCH_HYDRA_DIR": str(tmp / "hydra")}
    merged = {k: v for k, v in {**base, **env}.items() if v is not None}
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *args, f"results_dir={tmp / 'results'}"],
        capture_output=True,
        text=True,
        env=merged,
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
    )


def in_packed_rows(flat: torch.Tensor, rows: int, room: int = 7) -> torch.Tensor:
    """Flat head-major tokens ``(N, ...)`` of ``rows`` head-rows of ``N / rows`` tokens as a packed
    segment holds them: the ``(rows, N / rows, ...)`` rectangle of a buffer with ``room`` more slots
    per head-row, those slots filled with NaN or the largest value (a kernel must not read them)."""
    n = flat.shape[0] // rows
    fill = float("nan") if flat.is_floating_point() else torch.iinfo(flat.dtype).max
    buf = torch.full((rows, n + room, *flat.shape[1:]), fill, dtype=flat.dtype, device=flat.device)
    buf[:, :n] = flat.view(rows, n, *flat.shape[1:])
    return buf[:, :n]


def decode_with_ops(lm, stack, ids, steps: int = 3):
    """Prefill ``ids`` and take ``steps`` greedy decode steps: the logits of each (the prefill's
    last first) and the names of the aten operations the decode steps ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    cache = loop.new_cache(lm, stack)
    logits = [loop.step(lm, cache, ids, keep=1)[-1]]
    with Ops() as ops:
        for _ in range(steps):
            logits.append(loop.step(lm, cache, [int(logits[-1].argmax())])[-1])
    return torch.stack(logits), ops.names
