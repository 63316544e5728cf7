"""Which path the cache's operations run: the config's ``kernels``, resolved per cell."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from types import ModuleType

import torch

from kvbench.errors import ConfigError

PATHS = ("auto", "torch", "triton")

_ACTIVE: ContextVar[str] = ContextVar("kvbench_kernels", default="torch")


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
    """The path a cell on ``device`` runs: ``auto`` is Triton on CUDA and torch elsewhere."""
    if value == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return value


def active() -> str:
    """The path the current cell runs (``torch`` outside any :func:`using`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def using(path: str) -> Iterator[None]:
    """Run the cache's operations on ``path`` (``torch`` or ``triton``) inside the block."""
    assert path in ("torch", "triton"), path
    token = _ACTIVE.set(path)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def kernels(name: str) -> ModuleType | None:
    """``kvbench.kernels.<name>`` on the Triton path, None on the torch path (the caller then runs
    the kernel's torch reference). Imported on first use: :func:`check` has refused ``triton``
    where the package is missing, so the torch path never needs it."""
    if active() != "triton":
        return None
    return importlib.import_module(f"kvbench.kernels.{name}")
