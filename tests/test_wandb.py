"""W&B logging, checked through W&B's own offline run files (no network, no account)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.test_cli import ROOT, TINY
from tests.wandb_files import run_summary

SECRET = "kvbench-test-secret-0123456789abcdef"
NEEDLE = [
    "model=tiny_random",
    "dataset=needle",
    "dataset.lengths=[80,120]",
    "dataset.depths=[0.2,0.8]",
    "dataset.offsets=1",
    "dataset.max_new_tokens=4",
    "window=8",
    "sinks=2",
]


def _sweep(tmp: Path, *args: str, key: str | None = None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "KVBENCH_CACHE": str(tmp / "cache"),
        "KVBENCH_HYDRA_DIR": str(tmp / "hydra"),
        "WANDB_DIR": str(tmp / "wandb"),
        "WANDB_MODE": "online",  # no key: kvbench itself must fall back to offline
    }
    env.pop("WANDB_API_KEY", None)
    if key:
        env.update(WANDB_API_KEY=key, WANDB_MODE="offline")
    return subprocess.run(
        [sys.executable, "-m", "kvbench", "-m", *args, f"results_dir={tmp / 'results'}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def _runs(tmp: Path) -> list[dict]:
    return [run_summary(p) for p in sorted((tmp / "wandb").rglob("run-*.wandb"))]


def _table(tmp: Path, run_id: str, key: str) -> dict:
    (path,) = [p for p in (tmp / "wandb").rglob(f"*{run_id}/files/media/table/{key}_*.table.json")]
    return json.loads(path.read_text())


def test_a_sweep_logs_cells_and_a_summary_run(tmp_path):
    out = _sweep(tmp_path, *TINY, "logger=wandb", "name=wb", "hydra.sweeper.order=1", "scheduler=h2o,lru")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no W&B API key found: logging offline" in out.stderr
    assert "upload it with `wandb sync " in out.stderr
    records = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "results" / "wb").glob("*.json")}
    runs = {r["id"]: r for r in _runs(tmp_path)}
    summary_runs = [r for r in runs.values() if r["job_type"] == "summary"]
    assert set(runs) - {r["id"] for r in summary_runs} == set(records)  # run id = cell id
    for cell_id, record in records.items():
        run = runs[cell_id]
        assert run["group"] == "wb"
        assert run["job_type"] == {0: "baseline", 1: "single"}[record["stack"]["order"]]
        assert run["name"] in ("full cache", "scheduler/h2o", "scheduler/lru")
        assert run["config"]["cell_id"] == cell_id and len(run["config"]["config_sha256"]) == 64
        assert run["config"]["command"] == record["command"]
        assert f"scheduler={record['stack']['scheduler']}" in record["command"]
        assert run["config"]["scheduler"] == record["config"]["scheduler"]
        assert run["summary"]["score/value"] == record["metrics"]["score"]["value"]
        assert run["summary"]["status"] == "done"
        layers = _table(tmp_path, cell_id, "per_layer_bytes")
        assert (
            layers["columns"] == ["layer", "bytes"]
            and [row[1] for row in layers["data"]] == record["per_layer_bytes"]
        )
        examples = _table(tmp_path, cell_id, "examples")
        assert len(examples["data"]) == len(record["examples"]) and "nll" in examples["columns"]
    (summary,) = summary_runs
    matrix = _table(tmp_path, summary["id"], "matrix")
    assert len(matrix["data"]) == 3 and {"section", "label", "cell_id", "status", "score"} <= set(
        matrix["columns"]
    )
    files = summary["artifacts"]["wb-report"]
    assert "REPORT.md" in files and "pareto-tiny_random-pydoc.png" in files


def test_needle_cells_log_a_heatmap_and_the_key_never_leaks(tmp_path):
    out = _sweep(tmp_path, *NEEDLE, "logger=wandb", "name=wbn", "scheduler=none,h2o", key=SECRET)
    assert out.returncode == 0, out.stderr[-2000:]
    runs = [r for r in _runs(tmp_path) if r["job_type"] != "summary"]
    assert len(runs) == 2 and all("needle_heatmap/_type" in r["history"] for r in runs)
    images = list((tmp_path / "wandb").rglob("files/media/images/needle_heatmap_*.png"))
    assert len(images) == 2 and all(p.stat().st_size > 5000 for p in images)
    assert SECRET not in out.stdout + out.stderr
    for path in (tmp_path / "results").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    for path in (tmp_path / "wandb").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_rerun_continues_the_same_runs_and_logger_none_writes_nothing(tmp_path):
    args = [*TINY, "name=again", "scheduler=h2o"]
    assert _sweep(tmp_path, *args, "logger=wandb").returncode == 0
    assert _sweep(tmp_path, *args, "logger=wandb", "force=true").returncode == 0
    ids = [r["id"] for r in _runs(tmp_path) if r["job_type"] != "summary"]
    assert len(ids) == 2 and len(set(ids)) == 1  # the same run id: W&B resumes, no duplicate
    quiet = tmp_path / "quiet"
    assert _sweep(quiet, *args, "logger=none").returncode == 0
    assert not (quiet / "wandb").exists()


def test_wandb_report_offline_says_what_it_would_create(tmp_path):
    import pytest

    from kvbench.report.wandb_report import build
    from kvbench.results import write_record

    record = {"cell_id": "a", "experiment": "x", "status": "done", "stack": {"scheduler": "h2o"}}
    write_record(tmp_path / "x" / "a.json", record)
    code = subprocess.run(
        [sys.executable, "-m", "kvbench.report", str(tmp_path / "x"), "--wandb-report", "--project", "p"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")},
    )
    assert code.returncode == 0
    assert "not creating a W&B report: no WANDB_API_KEY. It would hold:" in code.stderr
    assert "Panel grid over the runs of p in group 'x'" in code.stderr
    pytest.importorskip("wandb_workspaces")
    report = build(tmp_path / "x", "p", "team")  # the report object, built offline (never saved)
    assert report.title == "kvbench: x" and [type(b).__name__ for b in report.blocks] == [
        "H1",
        "P",
        "MarkdownBlock",
        "PanelGrid",
    ]
