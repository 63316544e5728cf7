"""Resume and faults: kill -9 mid-cell then resume, out of memory, timeouts, NaN, killed twice."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from tests.helpers import run_kvbench as kvbench
from tests.test_cli import ROOT, TINY

from kvbench import cellstate, config, run
from kvbench.eval import perplexity

CONF = ROOT / "conf"
config.register()


def _records(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


def _cfg(tmp: Path, *extra: str):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=[*TINY, f"results_dir={tmp}", "name=faults", *extra])


def test_kill_9_mid_cell_then_resume_recomputes_only_the_missing_cells(tmp_path):
    args = ["-m", *TINY, "dataset.windows=6", "scheduler=none,h2o,streaming_llm,lru", "name=kill"]
    folder = tmp_path / "results" / "kill"
    env = {
        **os.environ,
        "KVBENCH_CACHE": str(tmp_path / "cache"),
        "KVBENCH_HYDRA_DIR": str(tmp_path / "hydra"),
    }
    cmd = [sys.executable, "-m", "kvbench", *args, f"results_dir={tmp_path / 'results'}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill while a second cell is in flight (started, no record)
        done = list(folder.glob("*.json")) if folder.is_dir() else []
        started = [p for p in folder.glob(".*.starts")] if folder.is_dir() else []
        if len(done) >= 1 and started:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _records(folder)
    assert 1 <= len(before) < 4 and all(r["status"] == "done" for r in before.values())  # none half-written
    markers = [p.name[1:].removesuffix(".starts") for p in folder.glob(".*.starts")]
    # Usually one cell was in flight (its marker, no record). A kill between a record and its
    # marker's removal leaves a stale marker; one between two cells leaves none.
    interrupted = len([m for m in markers if m not in before])
    assert len(markers) <= 1

    again = kvbench(*args, tmp=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    n = len(before)
    assert f"4 cells: {n} done, 0 failed earlier, {interrupted} interrupted, {4 - n} to run" in again.stderr
    assert f"summary: {4 - n} done, {n} skipped (already complete), 0 failed" in again.stderr
    after = _records(folder)
    assert len(after) == 4 and all(r["status"] == "done" for r in after.values())
    assert all(after[k]["created"] == before[k]["created"] for k in before)  # not recomputed
    assert not list(folder.glob(".*.starts"))
    assert "cell/s" not in again.stderr and "it/s" not in again.stderr  # no bars without a terminal


def _under_memory_limit(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m kvbench ARGS`` with its address space capped 3 GiB above what it holds at start."""
    script = f"""
import resource, sys
import torch, transformers
import kvbench.__main__ as cli
vm = int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmSize'))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 30), vm + (3 << 30)))
sys.argv = ['kvbench', *{list(args)!r}, 'results_dir={tmp / "results"}']
cli.main()
"""
    env = {**os.environ, "KVBENCH_CACHE": str(tmp / "cache"), "KVBENCH_HYDRA_DIR": str(tmp / "hydra")}
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_out_of_memory_fails_the_cell_and_the_sweep_goes_on(tmp_path):
    """A model too large for the limit (3 x 96 x 4M floats per layer) fails; its neighbour runs."""
    args = ["-m", *TINY, "model.config.intermediate_size=192,4000000", "name=oom"]
    out = _under_memory_limit(tmp_path, *args)
    assert out.returncode == 1, out.stderr[-2000:]
    records = list(_records(tmp_path / "results" / "oom").values())
    failed = [r for r in records if r["status"] == "failed"]
    assert len(records) == 2 and len(failed) == 1
    assert failed[0]["failure"] == "oom" and failed[0]["error"].startswith("out of memory: ")
    assert failed[0]["metrics"] == {}
    assert "summary: 1 done, 0 skipped (already complete), 1 failed" in out.stderr
    assert "failed (now)" in out.stderr and "out of memory" in out.stderr

    again = _under_memory_limit(tmp_path, *args)  # resume leaves the failed cell alone, still exits 1
    assert again.returncode == 1
    assert "2 cells: 1 done, 1 failed earlier, 0 interrupted, 0 to run" in again.stderr
    assert "failed (earlier; retry_failed=true retries it)" in again.stderr
    retry = _under_memory_limit(tmp_path, *args, "retry_failed=true")  # only the failed one runs
    assert "2 cells: 1 done, 1 failed earlier, 0 interrupted, 1 to run" in retry.stderr
    assert "summary: 0 done, 1 skipped (already complete), 1 failed" in retry.stderr


def test_timeout_is_checked_between_chunks(tmp_path):
    out = kvbench(*TINY, "name=slow", "timeout_s=0.001", tmp=tmp_path)
    assert out.returncode == 1
    (record,) = _records(tmp_path / "results" / "slow").values()
    assert record["status"] == "failed" and record["failure"] == "timeout"
    assert "ran past timeout_s=0.001 s (checked between chunks)" in record["error"]
    assert "kvbench: cell" in out.stderr and "failed: timeout" in out.stderr


def test_nan_perplexity_fails_the_cell(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "scheduler=h2o")
    real = perplexity.evaluate

    def broken(*args, **kwargs):
        metrics, windows = real(*args, **kwargs)
        metrics.extra["perplexity"] = math.nan
        return metrics, windows

    monkeypatch.setattr(perplexity, "evaluate", broken)
    outcome = run.execute(cfg)
    assert outcome.ran and outcome.record["status"] == "failed"
    assert outcome.record["failure"] == "nonfinite"
    assert outcome.record["error"] == "non-finite metric: metrics.perplexity is nan"
    assert json.loads(run.plan(cfg).path.read_text())["status"] == "failed"  # a complete record


def test_a_cell_started_twice_without_finishing_is_recorded_killed(tmp_path):
    cfg = _cfg(tmp_path, "scheduler=streaming_llm")
    cell = run.plan(cfg)
    cellstate.begin(cell.path)  # two starts that never finished (their processes were killed)
    cellstate.begin(cell.path)
    outcome = run.execute(cfg)
    assert outcome.record["status"] == "failed" and outcome.record["failure"] == "killed"
    assert outcome.record["error"].startswith("killed: started 2 times without finishing (last on ")
    assert not cellstate.starts(cell.path)
    # retry_failed tries it again from a clean count
    with initialize_config_dir(str(CONF), version_base="1.3"):
        retry = compose(
            "config",
            overrides=[
                *TINY,
                f"results_dir={tmp_path}",
                "name=faults",
                "scheduler=streaming_llm",
                "retry_failed=true",
            ],
        )
    assert run.execute(retry).record["status"] == "done"
