"""Experiment tracking. ``logger=none`` writes nothing; ``logger=wandb`` logs one W&B run per cell,
offline when no API key is configured (sync later with ``wandb sync``)."""

from __future__ import annotations

import os
import sys
from typing import Any

from omegaconf import DictConfig


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}/{k}" if prefix else k, v, out)
    elif isinstance(value, int | float | str | bool) or value is None:
        out[prefix] = value


def log(cfg: DictConfig, record: dict[str, Any]) -> None:
    if cfg.logger is None or cfg.logger.name != "wandb" or not record:
        return
    import wandb

    mode = cfg.logger.mode
    if mode != "disabled" and not os.environ.get("WANDB_API_KEY") and mode != "offline":
        print(
            "kvbench: no WANDB_API_KEY; logging offline (upload later with `wandb sync <run dir>`)",
            file=sys.stderr,
        )
        mode = "offline"
    stack = record["stack"]
    run = wandb.init(
        project=cfg.logger.project,
        entity=cfg.logger.entity,
        mode=mode,
        group=record["experiment"],
        job_type={0: "baseline", 1: "single", 2: "double", 3: "triple"}[stack["order"]],
        name=" + ".join(
            f"{r}/{stack[r]}" for r in ("router", "compressor", "scheduler") if stack[r] != "none"
        )
        or "full cache",
        id=record["cell_id"],
        resume="allow",
        config={**record["config"], "cell_id": record["cell_id"]},
        reinit="finish_previous",
    )
    summary: dict[str, Any] = {}
    _flat("", record["metrics"], summary)
    run.summary.update({k: v for k, v in summary.items() if v is not None})
    run.summary["status"] = record["status"]
    run.finish()
