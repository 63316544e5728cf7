"""Decode attention time per layer per step, on sampled decode steps (issue 29).

TPOT times a whole decode step; at long context on a large model the weights' reads dominate it, so
it hides what a technique changed. :class:`AttnTimer` times only the technique's part of a step: in
each layer, the engine's attention (:meth:`KVCache.attend <kvbench.cache.engine.KVCache.attend>`)
and the stack's work after the forward (:meth:`~kvbench.cache.engine.KVCache.after_forward`, per
layer). The result, ``decode_attn_ms``, is their mean per layer per sampled step, in milliseconds.

A cell's protocol runs inside :func:`cell`; each decode step asks :func:`sampled` for the timer,
which samples every :data:`EVERY`-th decode step of the cell, counted across its examples (so the
sampled positions rotate through a generation instead of always taking its first step). A batched
step is one step. Outside :func:`cell`, or on a step not sampled, the cache holds no timer and the
engine only tests ``cache.timer is None``: no operation and no synchronisation is added.

On a CUDA device each region is a pair of CUDA events recorded on the device's current stream; their
elapsed times are read at the end of the cell (or, past :data:`PENDING` events, before the next
sampled step: between steps, never inside one), so a step is never synchronised by its timing. On
the CPU a region is ``time.perf_counter`` around the work, which the CPU runs synchronously. On any
other device the time is not measured (``decode_attn_ms`` null).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

EVERY = 3  # sample one decode step in this many
PENDING = 8192  # CUDA events held unread before they are read between two steps

_CELL: contextvars.ContextVar[AttnTimer | None] = contextvars.ContextVar("kvbench_attn_timer", default=None)


def _cuda_event(device: torch.device) -> Any:
    """A timing CUDA event recorded now on ``device``'s current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


class AttnTimer:
    """Sums the decode attention time of sampled steps.

    Args:
        every: sample one decode step in ``every``.
        clock: the CPU's clock, in seconds.
        event: records an event on a CUDA device; the event has ``synchronize()`` and
            ``elapsed_time(end)`` in milliseconds, as ``torch.cuda.Event``.
    """

    def __init__(
        self,
        every: int = EVERY,
        clock: Callable[[], float] = time.perf_counter,
        event: Callable[[torch.device], Any] = _cuda_event,
    ):
        if every < 1:
            raise ValueError(f"every={every}: must be >= 1")
        self.every, self.clock, self.event = every, clock, event
        self.steps = 0  # decode steps seen
        self.sampled = 0  # decode steps timed
        self.layer_steps = 0  # layers x sampled steps: the mean's denominator
        self.ms = 0.0  # the regions read so far
        self.pending: list[tuple[Any, Any]] = []  # (start, end) CUDA events not read yet
        self.unmeasured = False  # a region ran on a device this timer cannot time

    def sample(self, layers: int) -> bool:
        """Count a decode step of ``layers`` layers; True when it is one to time."""
        self.steps += 1
        if (self.steps - 1) % self.every:
            return False
        if len(self.pending) * 2 >= PENDING:
            self._read()  # the steps before have finished: their timed regions waited for them
        self.sampled += 1
        self.layer_steps += layers
        return True

    def start(self, device: torch.device) -> Any:
        """Open a region of work on ``device``; pass what it returns to :meth:`stop`."""
        if device.type == "cuda":
            return self.event(device)
        return self.clock() if device.type == "cpu" else None

    def stop(self, device: torch.device, mark: Any) -> None:
        """Close the region ``mark`` (from :meth:`start` on the same device)."""
        if device.type == "cuda":
            self.pending.append((mark, self.event(device)))
        elif device.type == "cpu":
            self.ms += (self.clock() - mark) * 1000.0
        else:
            self.unmeasured = True

    def _read(self) -> None:
        for start, end in self.pending:
            end.synchronize()
            self.ms += start.elapsed_time(end)
        self.pending.clear()

    def metrics(self) -> dict[str, float | int | None]:
        """``decode_attn_ms``: mean milliseconds per layer per sampled decode step (None with no
        sampled step, or one on a device not timed); ``decode_attn_steps``: the sampled steps.
        Reads the CUDA events still pending (waiting for them)."""
        self._read()
        measured = self.layer_steps and not self.unmeasured
        return {
            "decode_attn_ms": self.ms / self.layer_steps if measured else None,
            "decode_attn_steps": self.sampled,
        }


@contextmanager
def cell(every: int = EVERY, **kwargs: Any) -> Iterator[AttnTimer]:
    """Time the decode steps run inside the block (see :func:`sampled`); yields the timer."""
    timer = AttnTimer(every, **kwargs)
    token = _CELL.set(timer)
    try:
        yield timer
    finally:
        _CELL.reset(token)


def sampled(layers: int) -> AttnTimer | None:
    """The cell's timer if this decode step (of ``layers`` layers) is one it times, else None."""
    timer = _CELL.get()
    return timer if timer is not None and timer.sample(layers) else None
