"""Experiment tracking. ``logger=none`` writes nothing; ``logger=wandb`` logs one W&B run per cell.

A cell's run has ``group`` = the experiment, ``job_type`` = baseline/single/double/triple, the
stack as its name and the cell id as its run id (``resume="allow"``: a resumed sweep continues the
same runs instead of creating duplicates). It holds the resolved config and its sha256, every
metric in the summary, the per-layer byte table and the per-example results as ``wandb.Table``s,
and a needle heatmap for needle cells. A sweep ends with one summary run holding the whole matrix
as a table and the report (markdown and plots) as an artifact.

Without an API key the runs are offline, and kvbench says how to upload them (``wandb sync``).
The key is read by wandb from its environment or netrc only; it is never put in a config, a
record or a log line.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kvbench.report import plots
from kvbench.report.tables import qualified_stack

JOB_TYPES = {0: "baseline", 1: "single", 2: "double", 3: "triple"}


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}/{k}" if prefix else k, v, out)
    elif isinstance(value, int | float | str | bool) or value is None:
        out[prefix] = value


def enabled(cfg: DictConfig) -> bool:
    return cfg.get("logger") is not None and cfg.logger.name == "wandb"


def _mode(cfg: DictConfig) -> str:
    mode = str(cfg.logger.mode)
    if mode == "online" and not os.environ.get("WANDB_API_KEY") and not _netrc_has_key():
        print("kvbench: no W&B API key found: logging offline", file=sys.stderr)
        return "offline"
    return mode


def _netrc_has_key() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text(encoding="utf-8")
    except OSError:
        return False


def _init(cfg: DictConfig, **kwargs: Any) -> Any:
    import wandb

    folder = Path(str(cfg.logger.dir)).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=cfg.logger.project,
        entity=cfg.logger.entity,
        mode=_mode(cfg),  # type: ignore[arg-type]
        dir=str(folder),
        resume="allow",
        reinit="finish_previous",
        settings=wandb.Settings(silent=True, console="off"),
        **kwargs,
    )


def _finish(run: Any) -> None:
    offline = run.settings.mode == "offline"
    where = Path(run.dir).parent
    run.finish()
    if offline:
        print(f"kvbench: W&B run {run.id} is offline; upload it with `wandb sync {where}`", file=sys.stderr)


def _table(rows: list[dict[str, Any]]) -> Any:
    """A ``wandb.Table`` of dicts; nested values (lists of chunk NLLs) as JSON text."""
    import wandb

    names = list(dict.fromkeys(str(k) for row in rows for k in row))
    data = [
        [
            v if isinstance(v := row.get(c), int | float | str | bool) or v is None else json.dumps(v)
            for c in names
        ]
        for row in rows
    ]
    columns: list[str | int] = list(names)
    return wandb.Table(columns=columns, data=data)


def config_sha256(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def log(cfg: DictConfig, record: dict[str, Any]) -> None:
    """Logs one cell's record as its W&B run (id = the cell id); nothing unless ``logger=wandb``."""
    if not enabled(cfg) or not record:
        return
    import wandb

    stack = record["stack"]
    run = _init(
        cfg,
        group=record["experiment"],
        job_type=JOB_TYPES.get(int(stack.get("order") or 0), "stack"),
        name=qualified_stack(record, empty="full cache"),
        id=record["cell_id"],
        config={
            **record["config"],
            "cell_id": record["cell_id"],
            "config_sha256": config_sha256(record["config"]),
            "command": record.get("command"),
        },
    )
    summary: dict[str, Any] = {}
    _flat("", record.get("metrics") or {}, summary)
    run.summary.update({k: v for k, v in summary.items() if v is not None})
    run.summary.update(
        {"status": record["status"], "error": record.get("error"), "cell_id": record["cell_id"]}
    )
    payload: dict[str, Any] = {}
    if record.get("per_layer_bytes"):
        payload["per_layer_bytes"] = _table(
            [{"layer": i, "bytes": b} for i, b in enumerate(record["per_layer_bytes"])]
        )
    if record.get("examples"):
        payload["examples"] = _table(record["examples"])
    figure = plots.needle_heatmap(record)
    if figure is not None:
        payload["needle_heatmap"] = wandb.Image(figure)
        plots.plt.close(figure)
    if payload:
        run.log(payload)
    _finish(run)


def log_sweep(cfg: DictConfig, folder: Path, rows: list[dict[str, Any]]) -> None:
    """Logs a sweep's summary run: the matrix as one table, ``REPORT.md`` and plots as an artifact.

    Args:
        cfg: The sweep's config (its ``logger`` node decides).
        folder: The experiment's results folder (its report is already written).
        rows: One dict per matrix row: section, label, cell id, status and the headline metrics.
    """
    if not enabled(cfg):
        return
    import wandb

    experiment = folder.name
    ids = sorted({str(r.get("cell_id")) for r in rows})
    sweep_id = "sweep-" + hashlib.sha256((experiment + ",".join(ids)).encode()).hexdigest()[:12]
    run = _init(cfg, group=experiment, job_type="summary", name=f"{experiment} (sweep summary)", id=sweep_id)
    run.log({"matrix": _table(rows)})
    report = folder / "REPORT.md"
    if report.exists():
        artifact = wandb.Artifact(f"{experiment}-report", type="report")
        artifact.add_file(str(report))
        for png in sorted(folder.glob("*.png")):
            artifact.add_file(str(png))
        run.log_artifact(artifact)
    run.summary.update({"cells": len(ids), "failed": sum(r.get("status") != "done" for r in rows)})
    _finish(run)
