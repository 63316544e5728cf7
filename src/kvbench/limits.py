"""Per-cell limits a sweep enforces: a wall-clock timeout checked between forward chunks.

A chunk is never interrupted (a forward pass cannot be stopped safely mid-way); the deadline is
checked before each chunk and each needle case, so a cell overruns by at most one chunk.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class CellTimeout(RuntimeError):
    """A cell ran past its ``timeout_s``."""


class NonFiniteMetric(RuntimeError):
    """A cell measured a NaN or infinite value (e.g. perplexity): its numbers mean nothing."""


_deadline: tuple[float, float] | None = None  # (monotonic deadline, the limit in seconds)


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Within the block, :func:`check` raises :class:`CellTimeout` once ``seconds`` have passed."""
    global _deadline
    previous = _deadline
    _deadline = None if seconds is None else (time.monotonic() + float(seconds), float(seconds))
    try:
        yield
    finally:
        _deadline = previous


def check(where: str = "between chunks") -> None:
    """Raises :class:`CellTimeout` if the current cell's deadline has passed."""
    if _deadline is not None and time.monotonic() > _deadline[0]:
        raise CellTimeout(f"timeout: the cell ran past timeout_s={_deadline[1]:g} s (checked {where})")
