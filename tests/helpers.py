"""Small helpers for tests: build stacks and run chunks through the engine."""

from __future__ import annotations

import torch

from kvbench.eval import loop
from kvbench.roles import BindContext, Budget
from kvbench.stack import Stack


def make_stack(lm, router=None, compressor=None, scheduler=None, **budget) -> Stack:
    stack = Stack(router=router, compressor=compressor, scheduler=scheduler, budget=Budget(**budget))
    stack.bind(BindContext.for_model(lm, stack.budget))
    return stack


def run_chunks(lm, stack, ids, sizes, shadow=False):
    """Feed ``ids`` in chunks of ``sizes`` with the stack applied after each; returns (logits, cache)."""
    cache = loop.new_cache(lm, stack, shadow=shadow)
    outs, at = [], 0
    for n in sizes:
        outs.append(loop.step(lm, cache, ids[at : at + n]))
        at += n
    return torch.cat(outs), cache


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()
