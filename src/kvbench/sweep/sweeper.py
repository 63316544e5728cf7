"""kvbench's Hydra sweeper (``hydra/sweeper=matrix``, the default for ``python -m kvbench -m``).

Without ``order``, ``pairs``, ``triples``, ``floor`` or ``variants`` it sweeps the cartesian
product of the command line, as Hydra's basic sweeper does. With them it expands the technique matrix
(:mod:`kvbench.sweep.matrix`). Either way, before anything launches it composes and identifies
every cell, drops illegal stacks with the reason, merges duplicates, prints how many cells are
already done, and orders the rest so that each model loads once per worker. A failed cell does
not stop the sweep; at the end it prints a summary and exits 1 if any cell failed.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig
from tqdm.auto import tqdm

from kvbench import logger
from kvbench.errors import ConfigError, DatasetLoadError
from kvbench.paths import CONF_DIR
from kvbench.report.__main__ import write_report
from kvbench.results import read_record
from kvbench.sweep.plan import PlannedCell, SweepPlan, build, write_manifests


def _say(message: str) -> None:
    print(f"kvbench sweep: {message}", file=sys.stderr, flush=True)


def outcome_of(job_return: Any, cell: PlannedCell) -> dict[str, Any]:
    """The task's summary of a cell, or a failure when the job itself raised or never returned.

    A job that died after some of its cells finished still leaves their records: those count.
    """
    try:
        value = job_return.return_value
    except BaseException as err:  # the task raised outside the cell's isolation, or its job died
        record = read_record(cell.path)
        if record is not None and record.get("status") in ("done", "failed"):
            return {
                "cell_id": cell.cell_id,
                "status": record["status"],
                "error": record.get("error"),
                "ran": True,
            }
        reason = (
            " ".join(str(err).split()) if isinstance(err, RuntimeError) else f"{type(err).__name__}: {err}"
        )
        return {"cell_id": cell.cell_id, "status": "failed", "error": reason[:500], "ran": True}
    if isinstance(value, dict) and "status" in value:
        return value
    return {"cell_id": cell.cell_id, "status": "failed", "error": f"no result ({value!r})", "ran": True}


class MatrixSweeper(Sweeper):
    """Expands a technique matrix (or a product), plans it, launches what is not done, reports."""

    def __init__(self, **conf: Any) -> None:
        self.conf = conf
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def _compose(self, overrides: list[str]) -> DictConfig:
        assert self.hydra_context is not None and self.config is not None
        return self.hydra_context.config_loader.load_sweep_config(self.config, overrides)

    def plan(self, arguments: list[str]) -> SweepPlan:
        assert self.config is not None
        bar = tqdm(total=0, desc="planning cells", unit="cell", leave=False, disable=None)

        def tick(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        try:
            return build(arguments, self.config.hydra.sweeper, self._compose, CONF_DIR, progress=tick)
        finally:
            bar.close()

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None
        try:
            plan = self.plan(arguments)
        except (ConfigError, DatasetLoadError) as err:
            print(f"kvbench: error: {err}", file=sys.stderr)
            sys.exit(2)
        base = self.config
        retry = bool(base.get("retry_failed"))
        force = bool(base.get("force"))
        # A cell's own overrides may set force/retry_failed too; the command line's decide here.
        pending = plan.to_run(retry, force)
        self._announce(plan, pending)
        if self.conf.get("dry_run"):
            for cell in plan.cells:
                rows = "; ".join(f"{r['section']}: {r['label']}" for r in cell.rows)
                print(f"{cell.cell_id}  {cell.status:<11}  {cell.model} · {cell.dataset}  {rows}")
            _say("dry run: nothing launched, nothing written")
            return []
        if plan.is_matrix:  # a product sweep keeps the report's usual shape
            write_manifests(plan, sys.argv[1:])
        outcomes = self._launch(pending) if pending else []
        return self._summarize(plan, pending, outcomes)

    def _announce(self, plan: SweepPlan, pending: list[PlannedCell]) -> None:
        counts = plan.counts()
        extra = []
        if plan.dropped:
            extra.append(f"{len(plan.dropped)} illegal dropped")
        if plan.merged:
            extra.append(f"{plan.merged} duplicates merged")
        _say(
            f"{len(plan.cells)} cells"
            + (f" ({', '.join(extra)})" if extra else "")
            + f": {counts['done']} done, {counts['failed']} failed earlier, "
            f"{counts['interrupted']} interrupted, {len(pending)} to run"
        )
        for drop in plan.dropped:
            _say(f"  dropped {drop.section} {drop.label}: {drop.reason}")
        models = list(dict.fromkeys(c.model for c in pending))
        if len(models) > 1:
            _say(f"  ordered by model so that each loads once per worker: {', '.join(models)}")

    def _launch(self, pending: list[PlannedCell]) -> list[dict[str, Any]]:
        """Runs the cells; in-process launchers one at a time (a progress bar), others as one batch."""
        overrides = [c.overrides for c in pending]
        labels = [c.rows[0]["label"] or c.cell_id for c in pending]
        if hasattr(self.launcher, "set_cells"):  # kvbench's grouped submitit launcher: its own bar
            self.launcher.set_cells(labels, [c.model_key for c in pending])
        if type(self.launcher).__name__ != "BasicLauncher":
            returns = self.launcher.launch(overrides, initial_job_idx=0)
            return [outcome_of(r, c) for r, c in zip(returns, pending)]
        outcomes = []
        # One launch per cell (for the bar): Hydra's per-launch log lines would repeat each cell.
        logging.getLogger("hydra._internal.core_plugins.basic_launcher").setLevel(logging.WARNING)
        bar = tqdm(total=len(pending), desc="sweep", unit="cell", disable=None, dynamic_ncols=True)
        for idx, (cell, label) in enumerate(zip(pending, labels)):
            bar.set_postfix_str(label[:60])
            (job_return,) = self.launcher.launch([cell.overrides], initial_job_idx=idx)
            outcomes.append(outcome_of(job_return, cell))
            bar.update(1)
        bar.close()
        return outcomes

    def _summarize(
        self, plan: SweepPlan, pending: list[PlannedCell], outcomes: Sequence[dict[str, Any]]
    ) -> Any:
        ran = {c.cell_id for c in pending}
        by_id = {o.get("cell_id"): o for o in outcomes}
        done = failed = skipped = 0
        failures = []
        for cell in plan.cells:
            if cell.cell_id in ran:
                outcome = by_id.get(cell.cell_id) or {"status": "failed", "error": "no result returned"}
                if outcome.get("status") == "done":
                    done += 1
                    continue
                failed += 1
                failures.append((cell, str(outcome.get("error")), "now"))
            elif cell.status == "failed":
                failed += 1
                failures.append((cell, str(cell.error), "earlier; retry_failed=true retries it"))
            else:
                skipped += 1
        _say(f"summary: {done} done, {skipped} skipped (already complete), {failed} failed")
        for cell, reason, when in failures:
            _say(f"  failed ({when}) {cell.rows[0]['label'] or cell.cell_id} [{cell.cell_id}]: {reason}")
        for folder in sorted({c.path.parent for c in plan.cells}):
            self._report(folder)
            self._log_sweep(folder, [c for c in plan.cells if c.path.parent == folder])
        if failed:
            sys.exit(1)
        return outcomes

    def _log_sweep(self, folder: Path, cells: list[PlannedCell]) -> None:
        """The sweep's summary run on W&B (``logger=wandb``): the matrix as one table, the report."""
        assert self.config is not None
        if not logger.enabled(self.config):
            return
        rows = []
        for cell in cells:
            record = read_record(cell.path) or {}
            metrics = record.get("metrics") or {}
            for row in cell.rows:
                rows.append(
                    {
                        **row,
                        "cell_id": cell.cell_id,
                        "model": cell.model,
                        "dataset": cell.dataset,
                        "status": record.get("status", "not run"),
                        "score": (metrics.get("score") or {}).get("value"),
                        "accuracy_drop": (metrics.get("accuracy_drop") or {}).get("value"),
                        "compression": metrics.get("compression_mean"),
                        "kv_mem_mb_peak": metrics.get("kv_mem_mb_peak"),
                        "error": record.get("error"),
                    }
                )
        logger.log_sweep(self.config, folder, rows)

    @staticmethod
    def _report(folder: Path) -> None:
        started = time.perf_counter()
        path = write_report(folder)
        if path is not None:
            _say(f"report: {path} ({time.perf_counter() - started:.1f} s)")
