"""Timing and memory measurement shared by the protocols."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device, out: list[float]):
    """Append the wall time of the block to ``out``, synchronizing the device on both ends."""
    sync(device)
    start = time.perf_counter()
    yield
    sync(device)
    out.append(time.perf_counter() - start)


def reset_peak(device: torch.device) -> None:
    """Reset the peak-memory counter: CUDA allocator, or this process's peak RSS on Linux."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def peak_mb(device: torch.device) -> float | None:
    """Peak memory since the last reset, in MB (None if it cannot be measured here)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
