"""The full-cache baseline of a model x dataset: computed once, reused by every cell that needs it.

Kept in this process and on disk (under the kvbench cache, keyed by the baseline cell's hash), so
separate processes (SLURM tasks) share it too.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from kvbench import models, results
from kvbench.eval import protocol
from kvbench.stack import Stack

_MEMO: dict[str, Any] = {}


def baseline_identity(ident: dict[str, Any]) -> dict[str, Any]:
    base = copy.deepcopy(ident)
    base["stack"] = {"router": None, "compressor": None, "scheduler": None}
    return base


def _disk_path(key: str) -> Path:
    return models.cache_root() / "baselines" / f"{key}.pt"


def lookup(ident: dict[str, Any]):
    """The stored baseline of this cell's model x dataset, or None."""
    key = results.cell_hash(baseline_identity(ident))
    if key not in _MEMO and _disk_path(key).exists():
        _MEMO[key] = torch.load(_disk_path(key), weights_only=False)
    return _MEMO.get(key)


def store(ident: dict[str, Any], value) -> None:
    key = results.cell_hash(baseline_identity(ident))
    path = _disk_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(value, tmp)
    os.replace(tmp, path)
    _MEMO[key] = value


def get(cfg: DictConfig, lm, data: Any, ident: dict[str, Any]):
    """The full-cache results this cell's protocol compares against (per window, case or example)."""
    value = lookup(ident)
    if value is None:
        stack = Stack()
        stack.bind(lm.num_layers)
        value = protocol.get(cfg.dataset.task).evaluate(lm, stack, data, cfg.dataset, None).baseline
        store(ident, value)
    return value
