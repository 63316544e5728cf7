"""Which path the cache's operations run: the config's ``kernels``, resolved per cell; under
``auto`` on CUDA, per call, by the dispatch table the kernel benchmark measured on that GPU
(``dispatch_table.json``, docs/kernels.md)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvbench.errors import ConfigError

PATHS = ("auto", "torch", "triton")

# The current version of each kernel module (the names :func:`kernels` takes). A row of the table
# measured at another version timed code that is gone, so ``auto`` does not count it: bump a
# module's version when its kernel changes, and refill the table.
# 2: attention, kivi_decode and latent_decode write their splits into a workspace that one merge
# kernel reads, with splits from the rows and the length (issue 30)
# 3: attention reads pages of any fraction of slots (att.Pages' ``parts``): the position routers
# name their blocks by index; merged units are read in place with their bias (no mask, no decoded
# view): both sum in another order than before
# 3: latent_decode reads quantized latents (lora_plus_plus), codes dequantized in registers (issue 30)
VERSIONS = {
    "kivi": 1,
    "kivi_decode": 2,
    "latent_decode": 3,
    "pruned_decode": 1,
    "scoring": 1,
    "svd_decode": 1,
    "attention": 4,
    "compaction": 1,
}

TABLE = Path(__file__).with_name("dispatch_table.json")
_DECIDED_MAX = 1 << 16  # memoized decisions kept before the memo starts afresh (contexts grow per step)


# The fused decodes: their softmax states are the attention kernels' (kvbench.kernels.attention),
# which only that module's merge reads.
FUSED = ("kivi_decode", "latent_decode", "pruned_decode", "svd_decode")


@dataclass
class _Cell:
    """The current cell's path (``torch``, ``triton`` or ``auto``), its CUDA device's name (what
    ``auto`` looks up in the table), the (module, path) pairs its operations took, and, inside
    :func:`step`, whether the decode step being gathered took the attention kernel."""

    path: str
    device: str | None = None
    taken: set[tuple[str, str]] = field(default_factory=set)
    step: bool | None = None


_OUTSIDE = _Cell("torch")  # outside any :func:`using`
_CELL: ContextVar[_Cell] = ContextVar("kvbench_kernels")
_DECIDED: dict[tuple[str, str | None, int | None, int | None], bool] = {}


def interpreted() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``, read when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check(value: object, device: str = "auto", here: bool = True) -> None:
    """Refuse an unknown path, and ``triton`` where its kernels cannot run (``here``: the cell runs
    on this machine, not on a SLURM node), in one line."""
    if value not in PATHS:
        raise ConfigError(f"kernels={value!r}: allowed {', '.join(PATHS)}")
    if value != "triton" or not here:
        return
    try:
        import triton  # noqa: F401  (an optional dependency off Linux)
    except ImportError as e:
        raise ConfigError("kernels=triton: needs the triton package (pip install triton)") from e
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not cuda and not interpreted():
        raise ConfigError(
            f"kernels=triton with device={device}: Triton needs CUDA here, or TRITON_INTERPRET=1 "
            "in the environment to interpret its kernels on the CPU (slow; for tests)"
        )


def resolve(value: str, device: torch.device) -> str:
    """The path a cell on ``device`` runs: ``auto`` stays ``auto`` on CUDA (the table decides per
    call, :func:`kernels`) and is torch elsewhere."""
    if value == "auto" and device.type != "cuda":
        return "torch"
    return value


@functools.cache
def table() -> dict[str, Any]:
    """The shipped dispatch table, parsed once: ``modules`` (each kernel module's benchmark rows)
    and ``devices`` (per GPU name: provenance, measured ``versions`` and ``ratios``)."""
    return json.loads(TABLE.read_text())


def table_stamp() -> str:
    """What a cell's identity says of ``auto`` on CUDA: the commits the table was measured at
    (joined by ``+``), so cells run after the table is refilled at a new commit are new cells."""
    commits = sorted({str(entry.get("commit", "unknown")) for entry in table().get("devices", {}).values()})
    return "+".join(commits) or "empty"


def versions_stamp() -> str:
    """The kernel modules' current versions, as a cell's identity says them (``attention2.kivi1...``):
    a kernel that changes moves the cells that ran it, within float tolerance, so they are new cells."""
    return ".".join(f"{name}{version}" for name, version in sorted(VERSIONS.items()))


def brackets(points: list[int], x: int | None) -> list[int]:
    """The measured ``points`` (sorted) that speak for ``x``: the nearest at or below it and at or
    above it (the smallest below them all, the largest above them all); every point when ``x`` is
    None."""
    if x is None:
        return points
    lo = [p for p in points if p <= x]
    hi = [p for p in points if p >= x]
    return sorted({lo[-1] if lo else points[0], hi[0] if hi else points[-1]})


def choose(
    table: dict[str, Any],
    device: str | None,
    name: str,
    batch: int | None = None,
    slots: int | None = None,
    versions: dict[str, int] | None = None,
) -> bool:
    """Whether ``auto`` takes module ``name``'s Triton kernel on the GPU named ``device`` for a call
    at ``batch`` sequences and ``slots`` stored tokens a head-row (None: any): only where ``table``
    has the device, measured the module at its current version (``versions``, default
    :data:`VERSIONS`), and every row of the module was faster than torch (ratio above 1) at every
    measured batch and context bracketing the call (:func:`brackets`). Torch everywhere else."""
    entry = table.get("devices", {}).get(device)
    rows = table.get("modules", {}).get(name)
    current = (VERSIONS if versions is None else versions).get(name)
    if not entry or not rows or entry.get("versions", {}).get(name) != current:
        return False
    for row in rows:
        by_batch = {int(b): ratios for b, ratios in entry.get("ratios", {}).get(row, {}).items()}
        if not by_batch:
            return False
        for b in brackets(sorted(by_batch), batch):
            by_slots = {int(t): float(r) for t, r in by_batch[b].items()}
            if not by_slots or any(by_slots[t] <= 1 for t in brackets(sorted(by_slots), slots)):
                return False
    return True


def active() -> str:
    """The path the current cell runs (``torch`` outside any :func:`using`; ``auto``: the table
    decides per call, so ask :func:`kernels`)."""
    return _CELL.get(_OUTSIDE).path


@contextlib.contextmanager
def using(path: str, device: str | None = None) -> Iterator[None]:
    """Run the cache's operations on ``path`` (``torch``, ``triton`` or ``auto``) inside the block;
    ``device``: the CUDA device's name ``auto`` looks up (default: the current device's)."""
    assert path in PATHS, path
    if path == "auto" and device is None and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    token = _CELL.set(_Cell(path, device))
    try:
        yield
    finally:
        _CELL.reset(token)


def kernels(name: str, batch: int | None = None, slots: int | None = None) -> ModuleType | None:
    """``kvbench.kernels.<name>`` on the Triton path, None on the torch path (the caller then runs
    the kernel's torch reference); under ``auto``, the table's choice for a call at ``batch``
    sequences and ``slots`` stored tokens a head-row (:func:`choose`, memoized). Each answer is
    noted for :func:`taken`. Imported on first use: :func:`check` has refused ``triton`` where the
    package is missing, so the torch path never needs it."""
    cell = _CELL.get(_OUTSIDE)
    if cell.path != "auto":
        triton = cell.path == "triton"
    elif cell.step is not None and (name == "attention" or (name in FUSED and not cell.step)):
        triton = cell.step  # inside a step's gather: only states the step's merge reads (see step)
    else:
        key = (name, cell.device, batch, slots)
        decided = _DECIDED.get(key)
        if decided is None:
            if len(_DECIDED) >= _DECIDED_MAX:
                _DECIDED.clear()
            decided = _DECIDED[key] = choose(table(), cell.device, name, batch, slots)
        triton = decided
    cell.taken.add((name, "triton" if triton else "torch"))
    return importlib.import_module(f"kvbench.kernels.{name}") if triton else None


@contextlib.contextmanager
def step(attention: ModuleType | None) -> Iterator[None]:
    """A decode step's segments giving their softmax states (:func:`kvbench.cache.partials.gather`),
    after the step asked for the attention kernel and got ``attention``. Under ``auto`` the table
    answers each segment for its own size, so inside the block ``attention`` is answered as the step
    was, and a fused decode (:data:`FUSED`) is taken only where the step took the attention kernel:
    every state is then of the kind the step's merge reads."""
    cell = _CELL.get(_OUTSIDE)
    before, cell.step = cell.step, attention is not None
    try:
        yield
    finally:
        cell.step = before


def taken() -> dict[str, str]:
    """Which path each kernel module asked for inside the current :func:`using` took, by name:
    ``torch``, ``triton``, or ``torch+triton`` (``auto`` took Triton at some sizes only)."""
    paths: dict[str, list[str]] = {}
    for name, path in sorted(_CELL.get(_OUTSIDE).taken):
        paths.setdefault(name, []).append(path)
    return {name: "+".join(p) for name, p in paths.items()}


def dumps(value: Any, indent: str = "") -> str:
    """``value`` as the table's JSON: nested objects indented, objects of plain values on one line."""
    if not isinstance(value, dict) or all(not isinstance(v, dict | list) for v in value.values()):
        return json.dumps(value)
    inner = indent + "  "
    items = [f"{inner}{json.dumps(str(k))}: {dumps(v, inner)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + indent + "}"
