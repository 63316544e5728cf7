"""What a forward allocates, recorded on the CPU through torch's dispatch hooks: tests of memory
properties that matter on a GPU (no ``q x vocabulary`` logits beyond the scored rows) need no GPU."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Allocations(TorchDispatchMode):
    """Every tensor an operator returns in fresh storage (views and in-place results aside):
    ``shapes`` ``[(shape, dtype, bytes)]`` in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.shapes.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return out

    def largest(self) -> int:
        """Bytes of the largest allocation."""
        return max((n for _, _, n in self.shapes), default=0)

    def rows_of(self, width: int) -> int:
        """The most rows any allocation of ``(..., width)`` elements held (its elements / width)."""
        return max(
            (int(torch.Size(s).numel()) // width for s, _, _ in self.shapes if s and s[-1] == width),
            default=0,
        )
