"""The GPU scripts' own logic, on the CPU (issue 29): ``gpu_check.py``'s targets and its kvpress
table from rows of known figures, ``bench_kvpress.py`` where kvpress is not installed, and a cell's
warm-up of its Triton kernels (``loop.warm_up_kernels``), which runs on a GPU only and, forced here,
changes nothing the cell records but its timings."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from kvbench import run
from kvbench.eval import loop
from test_bad_inputs import ROOT, cell

TIMINGS = ("decode_attn_ms", "throughput_tok_s", "tpot_s", "ttft_s", "memory", "peak_memory_mb")


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(tpot_ms: float, total_s: float = 1.0, evicts: bool = False) -> dict:
    return dict(tpot_ms=tpot_ms, prefill_s=0.5, total_s=total_s, evicts=evicts)


def test_targets_hold_evictions_and_kivi_to_the_full_cache_and_the_rest_to_one_and_a_half(capsys):
    n = 32768
    rows = {
        ("transformers", "sdpa", n): row(100.0),
        ("full cache", "torch", n): row(104.0),
        ("compressor/snapkv", "torch", n): row(90.0, evicts=True),
        ("scheduler/h2o", "torch", n): row(110.0, evicts=True),  # an eviction slower than the full cache
        ("compressor/quantized", "torch", n): row(105.0),  # KIVI: held to the full cache too
        ("router/base", "torch", n): row(150.0),  # within 1.5x
        ("compressor/lora", "torch", n): row(160.0),  # over 1.5x
        ("compressor/snapkv", "torch", 8192): row(500.0, evicts=True),  # another context: not judged
    }
    gpu_check().print_targets(rows, "torch", n)
    out = capsys.readouterr().out
    assert "full cache / transformers 1.04x (target <= 1.05x) ok" in out
    assert "2/5 within" in out
    misses = [line.split("MISS ")[1].split()[0] for line in out.splitlines() if "MISS" in line]
    assert misses == ["scheduler/h2o", "compressor/quantized", "compressor/lora"]


def test_kvpress_table_pairs_each_press_with_kvbench_and_says_why_a_row_is_missing(tmp_path, capsys):
    data = {
        "kvpress": "0.5.5",
        "transformers": "5.2.0",
        "rows": {
            "none@8192": {"prefill_s": 0.3, "tpot_ms": 20.0, "total_s": 0.6},
            "snapkv@8192": {"prefill_s": 0.3, "tpot_ms": 20.0, "total_s": 2.0},
            "h2o@32768": {"skipped": "eager attention at 32768 tokens exceeds 40.0 GB"},
            "adakv@8192": {"prefill_s": 0.3, "tpot_ms": 20.0, "total_s": 1.0},
        },
    }
    file = tmp_path / "kvpress.json"
    file.write_text(json.dumps(data))
    rows = {
        ("full cache", "torch", 8192): row(30.0, 1.2),
        ("compressor/snapkv", "torch", 8192): row(15.0, 1.0),
    }
    gpu_check().print_kvpress(rows, "torch", str(file))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("kvpress 0.5.5 (transformers 5.2.0)")
    by = {line[:28].strip(): line for line in lines[2:]}
    assert by["full cache"].endswith("2.00x")  # 1.2 s against kvpress's 0.6 s
    assert by["compressor/snapkv"].endswith("0.50x")
    assert by["scheduler/h2o"].endswith("exceeds 40.0 GB")
    assert by["scheduler/adakv"].endswith("kvbench row missing")


def test_bench_kvpress_without_kvpress_writes_why(tmp_path):
    out = tmp_path / "kvpress.json"
    script = ROOT / "scripts" / "bench_kvpress.py"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('kvpress') is not None)"
    if subprocess.run([sys.executable, "-c", probe]).returncode:
        return  # kvpress is installed here: the script would time it, which is the GPU's job
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["error"].startswith("kvpress not importable: ModuleNotFoundError") and data["rows"] == {}


def test_no_warm_up_of_kernels_where_none_can_run(tmp_path, monkeypatch):
    """On the CPU every path is torch's: the warm-up neither builds a stack nor runs."""
    built = []
    monkeypatch.setattr(loop, "warm_up_kernels", lambda lm, make, **kw: built.append(make) or False)
    record = run.run(cell(tmp_path, "router=adaptive"))
    assert record["status"] == "done" and len(built) == 1  # asked once per cell
    lm = type("LM", (), {"devices": [__import__("torch").device("cpu")]})()
    for path in ("torch", "auto"):
        with loop.dispatch.using(path):
            assert not loop.kernels_may_run(lm)


@pytest.mark.parametrize("technique", ["router=adaptive", "compressor=quantized", "compressor=random"])
def test_a_forced_warm_up_changes_no_recorded_number(tmp_path, monkeypatch, technique):
    """The warm-up runs a throwaway stack in its own dispatch cell and restores the generators, so
    the cell's scores, bytes and technique metrics are bit for bit those of a cell without it."""
    plain = run.run(cell(tmp_path / "plain", technique))
    ran = []
    real = loop.warm_up_kernels
    monkeypatch.setattr(loop, "kernels_may_run", lambda lm: True)  # as on a GPU with kernels=auto
    monkeypatch.setattr(loop, "warm_up_kernels", lambda lm, make, **kw: ran.append(real(lm, make, **kw)))
    warmed = run.run(cell(tmp_path / "warmed", technique))
    assert ran == [True] and plain["status"] == warmed["status"] == "done"
    strip = lambda m: {k: v for k, v in m.items() if k not in TIMINGS}  # noqa: E731
    assert strip(warmed["metrics"]) == strip(plain["metrics"])
    assert warmed.get("kernel_paths") == plain.get("kernel_paths")
