"""Launchers: the same cell run in-process, in grouped local processes or on SLURM is the same record.

The `slurm` tests need a running cluster (``scripts/slurm-local.sh up``, which `.ci/run` does when
it can); they are skipped, saying so, when ``sinfo`` shows no idle node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers import run_kvbench as kvbench
from tests.test_cli import ROOT, TINY

from kvbench.results import json_leaves

CELLS = [*TINY, "threads=1", "scheduler=none,h2o,streaming_llm"]
# Wall-clock and host-dependent figures; every other metric must agree across launchers.
_TIMED = re.compile(
    r"(ttft|tpot|_s$|_s\.|_ms$|seconds|throughput|tokens_per_s|peak_memory|peak_rss|peak_allocated|peak_reserved)"
)


def _records(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


def assert_same_measurements(a: dict[str, dict], b: dict[str, dict]) -> None:
    assert a.keys() == b.keys() and a
    for cell_id in a:
        ra, rb = a[cell_id], b[cell_id]
        assert ra["identity"] == rb["identity"] and ra["status"] == rb["status"] == "done"
        la = dict(json_leaves(ra["metrics"], "metrics"))
        lb = dict(json_leaves(rb["metrics"], "metrics"))
        assert la.keys() == lb.keys()
        for key, va in la.items():
            if _TIMED.search(key):
                continue
            vb = lb[key]
            if isinstance(va, float) or isinstance(vb, float):
                assert va == pytest.approx(vb, abs=1e-6, rel=1e-6), key
            else:
                assert va == vb, key


def test_grouped_local_processes_match_the_in_process_run(tmp_path):
    local = kvbench("-m", *CELLS, "name=same", tmp=tmp_path / "a")
    assert local.returncode == 0, local.stderr[-2000:]
    grouped = kvbench(
        "-m", *CELLS, "name=same", "launcher=submitit_local", "launcher.cells_per_job=2", tmp=tmp_path / "b"
    )
    assert grouped.returncode == 0, grouped.stderr[-2000:] + grouped.stdout[-2000:]
    assert "3 cells in 2 local jobs (at most 2 cells of one model per job)" in grouped.stdout
    assert_same_measurements(
        _records(tmp_path / "a" / "results" / "same"), _records(tmp_path / "b" / "results" / "same")
    )


def _cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return out.returncode == 0 and "idle" in out.stdout.split()


slurm = pytest.mark.skipif(
    not _cluster_up(), reason="no SLURM cluster (scripts/slurm-local.sh up starts one)"
)
SLURM = [
    "launcher=slurm",
    "launcher.gpus=null",
    "launcher.mem_gb=null",
    "launcher.cpus=1",
    "launcher.time_min=10",
]


@pytest.mark.slurm
@slurm
def test_slurm_sweep_matches_the_local_run(tmp_path):
    local = kvbench("-m", *CELLS, "name=same", tmp=tmp_path / "a")
    assert local.returncode == 0, local.stderr[-2000:]
    remote = kvbench("-m", *CELLS, "name=same", *SLURM, "launcher.cells_per_job=2", tmp=tmp_path / "b")
    assert remote.returncode == 0, remote.stderr[-2000:] + remote.stdout[-2000:]
    assert "3 cells in 2 slurm jobs (at most 2 cells of one model per job)" in remote.stdout
    a, b = _records(tmp_path / "a" / "results" / "same"), _records(tmp_path / "b" / "results" / "same")
    assert_same_measurements(a, b)
    assert all(r["device"]["threads"] == 1 for r in b.values())


@pytest.mark.slurm
@slurm
def test_cancelled_slurm_job_resumes_with_only_its_missing_cells(tmp_path):
    # eight cells of about 2 s each in one job: SLURM waits KillWait (5 s) between SIGTERM and SIGKILL
    bigger = [
        "model.config.num_hidden_layers=12",
        "model.config.hidden_size=384",
        "model.config.intermediate_size=1536",
    ]
    schedulers = "scheduler=none,h2o,streaming_llm,lru,lru_plus,adakv,quest,flexgen"
    args = ["-m", *TINY, *bigger, "threads=1", "dataset.windows=8", schedulers, "name=cancel"]
    folder = tmp_path / "results" / "cancel"
    env = {
        **os.environ,
        "KVBENCH_CACHE": str(tmp_path / "cache"),
        "KVBENCH_HYDRA_DIR": str(tmp_path / "hydra"),
    }
    cmd = [sys.executable, "-m", "kvbench", *args, *SLURM, "launcher.cells_per_job=8"]
    sweep = subprocess.Popen(
        [*cmd, f"results_dir={tmp_path / 'results'}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not list(folder.glob(".*.starts")):  # a cell is running
        time.sleep(0.05)
    subprocess.run(["scancel", "--name", "kvbench"], check=True)
    stdout, stderr = sweep.communicate(timeout=180)
    assert sweep.returncode == 1, stderr[-2000:]
    assert "ended without a result" in stderr
    first = _records(folder)
    # the cell running when SIGKILL came (KillWait after the SIGTERM) left its start marker
    interrupted = len(list(folder.glob(".*.starts")))
    assert interrupted <= 1
    assert len(first) < 8 and all(r["status"] == "done" for r in first.values())
    assert "failed (now)" in stderr and "killed: job" in stderr

    again = kvbench(*args, *SLURM, tmp=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"{interrupted} interrupted, {8 - len(first)} to run" in again.stderr
    after = _records(folder)
    assert len(after) == 8 and all(after[k]["created"] == first[k]["created"] for k in first)
