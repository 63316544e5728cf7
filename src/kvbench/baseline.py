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
from kvbench.eval import needle, perplexity
from kvbench.stack import Stack

_MEMO: dict[str, Any] = {}


def baseline_identity(ident: dict[str, Any]) -> dict[str, Any]:
    base = copy.deepcopy(ident)
    base["stack"] = {"router": None, "compressor": None, "scheduler": None}
    return base


def _disk_path(key: str) -> Path:
    return models.cache_root() / "baselines" / f"{key}.pt"


def get(cfg: DictConfig, lm, text: str, ident: dict[str, Any]):
    """Per-window (perplexity) or per-case (needle) baseline results for this cell's model x dataset."""
    key = results.cell_hash(baseline_identity(ident))
    if key in _MEMO:
        return _MEMO[key]
    path = _disk_path(key)
    if path.exists():
        _MEMO[key] = torch.load(path, weights_only=False)
        return _MEMO[key]
    stack = Stack()
    stack.bind(lm.num_layers)
    if cfg.dataset.task == "perplexity":
        _, value = perplexity.evaluate(lm, stack, lm.codec.encode(text), cfg.dataset, None, keep_logprobs=True)
    else:
        _, value = needle.evaluate(lm, stack, text, cfg.dataset, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(value, tmp)
    os.replace(tmp, path)
    _MEMO[key] = value
    return value
