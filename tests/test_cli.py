"""The command line: one-line errors before any model loads, a multirun in one process, skip and force."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_kvbench

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model=tiny_random",
    "dataset=pydoc",
    "dataset.prefill=48",
    "dataset.chunk=8",
    "dataset.chunks_per_window=2",
    "dataset.windows=2",
    "dataset.decode_steps=2",
    "window=8",
    "sinks=2",
]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["scheduler=h2oo"], "scheduler='h2oo': unknown option (did you mean 'h2o'?); allowed: adakv, duo"),
        (["compressor=quantized", "compressor.bits=5"], "compressor.bits=5: allowed 2, 3, 4, 8"),
        (["budget=1.5"], "budget=1.5: must be in (0, 1]"),
        (["dataset=needle", "dataset.depths=[0.5,1.5]"], "needle depths must be in 0..1"),
        (
            ["dataset=text_file", "dataset.path=/no/such/file.txt"],
            "dataset.path='/no/such/file.txt': file not found",
        ),
        (["seed=abc"], "seed=abc"),
        (["-m", "compressor=quantized", "compressor.bits=2,5"], "compressor.bits=5"),
    ],
)
def test_bad_input_fails_in_one_line_before_loading(tmp_path, args, needle):
    out = run_kvbench(*args, tmp=tmp_path)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("kvbench: error:")]
    assert len(errors) == 1 and needle in errors[0], out.stderr
    assert not (tmp_path / "results").exists()  # nothing written
    assert not (tmp_path / "cache").exists()  # no model was loaded or converted


def test_multirun_in_one_process_then_skip_and_report(tmp_path):
    out = run_kvbench(
        "-m", *TINY, "scheduler=none,h2o", "compressor=none,quantized", "name=mini", tmp=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(p.read_text()) for p in (tmp_path / "results" / "mini").glob("*.json")]
    assert len(records) == 4 and all(r["status"] == "done" for r in records)
    assert len({r["cell_id"] for r in records}) == 4
    by_stack = {(r["stack"]["compressor"], r["stack"]["scheduler"]): r for r in records}
    base = by_stack[("none", "none")]["metrics"]
    both = by_stack[("quantized", "h2o")]["metrics"]
    assert base["accuracy_drop"] is None and both["accuracy_drop"]["name"] == "delta_ppl_pct"
    assert both["compression_mean"] > base["compression_mean"]
    assert both["score"]["value"] != base["score"]["value"]
    again = run_kvbench(
        "-m", *TINY, "scheduler=none,h2o", "compressor=none,quantized", "name=mini", tmp=tmp_path
    )
    assert "4 cells: 4 done, 0 failed earlier, 0 interrupted, 0 to run" in again.stderr
    assert "summary: 0 done, 4 skipped (already complete), 0 failed" in again.stderr
    rep = subprocess.run(
        [sys.executable, "-m", "kvbench.report", str(tmp_path / "results" / "mini")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert rep.returncode == 0 and "### Double" in rep.stdout and "quantized" in rep.stdout
    # each record's command reruns that cell alone: same cell id, found done
    cell = by_stack[("quantized", "h2o")]
    assert "compressor=quantized" in cell["command"] and "results_dir" not in cell["command"]
    alone = run_kvbench(*shlex.split(cell["command"]), tmp=tmp_path)
    assert alone.returncode == 0 and f"cell {cell['cell_id']} is done" in alone.stderr
    assert f"command `python -m kvbench {cell['command']}`" in rep.stdout  # its table's provenance


def test_record_identity_excludes_logging_and_paths(tmp_path):
    from hydra import compose, initialize_config_dir

    from kvbench import config, run

    config.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        a = compose("config", overrides=[*TINY, "logger=none", "results_dir=/a"])
        b = compose("config", overrides=[*TINY, "logger=wandb", "results_dir=/b", "name=other"])
        c = compose("config", overrides=[*TINY, "dataset.prefill=40"])
    stacks = [config.validate(x) for x in (a, b, c)]
    ids = [run.identity(x, s, "sha") for x, s in zip((a, b, c), stacks)]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_a_technique_version_past_one_is_part_of_the_cell_identity(monkeypatch):
    """Version 1 leaves the ids of cells computed before versions existed; a bump gives new ones, in
    single stacks and in a chain's stages alike."""
    from hydra import compose, initialize_config_dir

    from kvbench import config, run
    from kvbench.compressors.svd import SVDCompressor
    from kvbench.schedulers.flexgen import FlexGenScheduler

    config.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        one = compose("config", overrides=[*TINY, "scheduler=flexgen"])
        chain = compose("config", overrides=[*TINY, "compressor=chain", "compressor.stages=[chunkkv,svd]"])

    def ids() -> tuple[dict, dict]:
        return tuple(run.identity(x, config.validate(x), "sha") for x in (one, chain))  # type: ignore[return-value]

    before = ids()
    assert "version" not in before[0]["stack"]["scheduler"]
    monkeypatch.setattr(FlexGenScheduler, "version", 2)
    monkeypatch.setattr(SVDCompressor, "version", 3)
    after = ids()
    assert after[0]["stack"]["scheduler"] == {**before[0]["stack"]["scheduler"], "version": 2}
    stages = after[1]["stack"]["compressor"]["stages"]
    assert stages[0]["version"] == 4 and stages[1]["version"] == 3  # chunkkv at 4 on its own


def test_cfg_job_prints_the_composed_config_and_runs_nothing(tmp_path):
    """Hydra's own flags with a value (``--cfg job``) are not taken for overrides."""
    out = run_kvbench("--cfg", "job", *TINY, tmp=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "name: tiny_random" in out.stdout and "prefill: 48" in out.stdout
    assert not (tmp_path / "results").exists()
