"""Timing and memory measurement shared by the protocols, over every device the model uses."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from kvbench.cache import held

Devices = torch.device | Iterable[torch.device]


def _each(devices: Devices) -> list[torch.device]:
    return [devices] if isinstance(devices, torch.device) else list(devices)


def sync(devices: Devices) -> None:
    """Wait for the queued work of every CUDA device in ``devices`` (a device or several)."""
    for device in _each(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


@contextmanager
def timed(devices: Devices, out: list[float]):
    """Append the wall time of the block to ``out``, synchronizing every device on both ends (a
    model across GPUs finishes a step when its last layer's device does)."""
    sync(devices)
    start = time.perf_counter()
    yield
    sync(devices)
    out.append(time.perf_counter() - start)


def reset_peak(devices: Devices) -> None:
    """Reset the peak-memory counters: each CUDA device's allocator, this process's peak RSS on
    Linux when a device is the CPU, and the caches' per-device peaks (:data:`held.PEAKS`).

    Garbage is collected first, so that memory held only by dead reference cycles (a previous
    cell's objects, a traceback's frames) is not counted in the next peak."""
    gc.collect()
    held.reset_peaks()
    for device in _each(devices):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        elif device.type == "cpu":
            try:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
            except OSError:
                pass


def _peak_rss_mb() -> float | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def memory(devices: Devices, weights: dict[str, int] | None = None) -> dict[str, dict[str, float | None]]:
    """Per device (``"cuda:0"``, ``"cpu"``), peaks since the last :func:`reset_peak`, in MB.

    A CUDA device gives ``peak_allocated_mb`` and ``peak_reserved_mb`` (the caching allocator's
    tensors, and what it held from the driver); the CPU the process's peak RSS ``peak_rss_mb``
    (weights and everything else the process holds). ``weights`` (bytes per device) adds
    ``weights_mb``: the model's parameters and buffers there, inside every peak. The caches
    measured since the reset add ``kv_resident_peak_mb`` (every tensor a cache held there: rows at
    capacity, views, copies, the KV-hit shadow on the host) and ``kv_stored_peak_mb`` (the format's
    bytes), each the largest seen, on the devices they used (the host's shadow too).
    """
    out: dict[str, dict[str, float | None]] = {}
    for device in _each(devices):
        name = str(device)
        if device.type == "cuda":
            out[name] = {
                "peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
            }
        elif device.type == "cpu":
            out[name] = {"peak_rss_mb": _peak_rss_mb()}
        else:
            continue
        if weights is not None and name in weights:
            out[name]["weights_mb"] = weights[name] / 2**20
    for kind, peaks in held.PEAKS.items():
        for name, n in peaks.items():
            out.setdefault(name, {})[f"kv_{kind}_peak_mb"] = n / 2**20
    return out


def peak_mb(devices: Devices) -> float | None:
    """Peak memory since the last reset, in MB: CUDA allocated memory summed over the devices (each
    device's own peak), else this process's peak RSS (None if it cannot be measured here)."""
    cuda = [d for d in _each(devices) if d.type == "cuda"]
    if cuda:
        return sum(torch.cuda.max_memory_allocated(d) for d in cuda) / 2**20
    return _peak_rss_mb()
