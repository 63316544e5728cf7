"""Grouped submitit launchers: one SLURM (or local) job runs several cells of one model.

hydra-submitit-launcher submits one array task per cell, so every cell reloads its model. These
launchers extend it: the sweeper hands them cells ordered by model, they cut each model's run of
cells into groups of at most ``cells_per_job``, and each array task loops over its group in one
process (the model loads once), still writing one record per cell. A job that dies (cancelled,
killed, out of its time) returns failures for the cells it had not finished; their records are
missing, so running the same command again recomputes exactly those.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf
from tqdm.auto import tqdm

# Keys of the launcher's node that are kvbench's, not submitit's.
_OWN_KEYS = ("cells_per_job",)


def groups_of(keys: list[str], size: int) -> list[list[int]]:
    """Indices cut into runs of one key (a model), each run into groups of at most ``size``."""
    out: list[list[int]] = []
    for i, key in enumerate(keys):
        if out and keys[out[-1][-1]] == key and len(out[-1]) < size:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class GroupedSubmititLauncher(BaseSubmititLauncher):
    """A submitit launcher whose array tasks each run a group of cells."""

    def __init__(self, cells_per_job: int = 8, **params: Any) -> None:
        super().__init__(**params)
        if int(cells_per_job) < 1:
            raise ValueError(f"launcher.cells_per_job={cells_per_job}: must be >= 1")
        self.cells_per_job = int(cells_per_job)
        self.labels: list[str] = []
        self.models: list[str] = []

    def set_cells(self, labels: list[str], models: list[str] | None = None) -> None:
        """What the sweeper knows of the cells it is about to launch: labels and model keys."""
        self.labels = list(labels)
        self.models = list(models or [])

    def __call__(self, group: list[tuple[Any, ...]]) -> list[JobReturn]:  # type: ignore[override]
        """Runs in the job: each cell of the group in turn, in this one process."""
        return [BaseSubmititLauncher.__call__(self, *params) for params in group]

    def _executor(self) -> Any:
        import submitit

        params = dict(self.params)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{(k if k in shared else f"{self._EXECUTOR}_{k}"): v for k, v in params.items() if v is not None}
        )
        return executor

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        params = [
            (
                list(ov),
                "hydra.sweep.dir",
                initial_job_idx + i,
                f"job_id_for_{initial_job_idx + i}",
                Singleton.get_state(),
            )
            for i, ov in enumerate(job_overrides)
        ]
        keys = self.models if len(self.models) == len(params) else [""] * len(params)
        groups = groups_of(keys, self.cells_per_job)
        executor = self._executor()
        jobs = executor.map_array(self, [[params[i] for i in g] for g in groups])
        print(
            f"kvbench sweep: {len(params)} cells in {len(jobs)} {self._EXECUTOR} jobs "
            f"(at most {self.cells_per_job} cells of one model per job): "
            + ", ".join(str(j.job_id) for j in jobs),
            flush=True,
        )
        for job, group in zip(jobs, groups):
            for i in group:
                print(
                    f"  job {job.job_id}: #{params[i][2]} {' '.join(filter_overrides(params[i][0]))}",
                    flush=True,
                )
        return self._collect(jobs, groups, params)

    def _collect(
        self, jobs: list[Any], groups: list[list[int]], params: list[tuple[Any, ...]]
    ) -> list[JobReturn]:
        out: list[JobReturn | None] = [None] * len(params)
        bar = tqdm(total=len(params), desc=f"sweep ({self._EXECUTOR})", unit="cell", disable=None)
        pending = set(range(len(jobs)))
        while pending:
            for j in sorted(pending):
                if not jobs[j].done():
                    continue
                pending.discard(j)
                for i, ret in zip(groups[j], self._results(jobs[j], groups[j], params)):
                    out[i] = ret
                bar.update(len(groups[j]))
                if self.labels:
                    bar.set_postfix_str(self.labels[groups[j][-1]][:60])
            if pending:
                time.sleep(float(os.environ.get("KVBENCH_POLL_S", "1")))
        bar.close()
        return [r for r in out if r is not None]

    @staticmethod
    def _results(job: Any, group: list[int], params: list[tuple[Any, ...]]) -> list[JobReturn]:
        try:
            returns = job.results()[0]
            if len(returns) == len(group):
                return list(returns)
            raise RuntimeError(f"returned {len(returns)} results for {len(group)} cells")
        except Exception as err:  # cancelled, killed, timed out, or the job raised
            state = getattr(job, "state", "UNKNOWN")
            first = " ".join(str(err).split())[:300]
            failure = RuntimeError(f"killed: job {job.job_id} ended without a result ({state}): {first}")
            return [_failed_return(params[i][0], failure) for i in group]


def _failed_return(overrides: list[str], err: Exception) -> JobReturn:
    ret = JobReturn(overrides=overrides, status=JobStatus.FAILED)
    ret._return_value = err
    return ret
