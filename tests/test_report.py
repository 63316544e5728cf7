"""The markdown report (kvbench.report), rendered from result records only.

Set KVBENCH_UPDATE_GOLDEN=1 to rewrite the golden files after a deliberate format change,
then read the diff before committing it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvbench.report import DASH, format_row, render_report, render_table
from kvbench.report.__main__ import main
from kvbench.report.records import merge_seeds
from kvbench.report.tables import (
    format_drop,
    format_score,
    format_significant,
    qualified_stack,
)
from kvbench.results import load_records, record_path, write_record

GOLDEN = Path(__file__).parent / "golden"


def _record(cell_id: str, router: str, compressor: str, scheduler: str, **metrics: object) -> dict:
    """A done perplexity record; ``metrics`` override the defaults."""
    stack = {"router": router, "compressor": compressor, "scheduler": scheduler}
    base = {
        "score": {"name": "perplexity", "value": 12.3456, "higher_is_better": False},
        "accuracy_drop": {"name": "delta_ppl_pct", "value": 3.1, "ci_low": 2.0, "ci_high": 4.2},
        "delta_nll": {"value": 0.03, "ci_low": 0.02, "ci_high": 0.04},
        "compression_prefill": 4.1, "compression_mean": 3.9,
        "kv_mem_mb_prefill": 1.23, "kv_mem_mb_peak": 1.5,
        "kv_hit": 0.93, "kv_hit_excl": 0.88, "kl": 0.01, "top1_agreement": 0.98,
        "ttft_s": 0.8, "tpot_s": 0.04, "throughput_tok_s": 25.0, "peak_memory_mb": 900.0,
        "n_examples": 4,
    }  # fmt: skip
    return {
        "kvbench_version": "0.1.0",
        "protocol_version": 1,
        "experiment": "default",
        "cell_id": cell_id,
        "status": "done",
        "error": None,
        "stack": {**stack, "order": sum(name != "none" for name in stack.values())},
        "config": {},
        "identity": {},
        "command": f"router={router} compressor={compressor} scheduler={scheduler} dataset=pydoc",
        "model": {
            "name": "smollm2_135m",
            "hf_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "description": "SmolLM2-135M-Instruct from a Q4_1 GGUF, dequantized",
            "dtype": "float32",
            "attn": "kvbench",
        },
        "dataset": {"name": "pydoc", "task": "perplexity", "sha256": "0123456789abcdef" * 4, "n_examples": 4},
        "device": {"type": "cpu", "name": "x86_64", "torch": "2.13.0", "transformers": "5.23.0"},
        "metrics": {**base, **metrics},
        "per_layer_bytes": [123, 456],
        "timings": {"load_s": 1.0, "eval_s": 10.0, "total_s": 11.0},
        "created": "2026-11-21T12:00:00Z",
    }


def _full_cache(**metrics: object) -> dict:
    """The baseline record: no drop, compression 1, bytes consistent with the other records' defaults."""
    consistent = {"kv_mem_mb_prefill": 4.1 * 1.23}  # compression x stored MB = the reference MB
    return _record(
        "0000000000000b00",
        "none",
        "none",
        "none",
        accuracy_drop=None,
        compression_prefill=1.0,
        **consistent,
        **metrics,
    )


def _records() -> list[dict]:
    failed = _record("f00d0000000000f1", "pikv", "svd", "none")
    failed.update(status="failed", error="ConfigError: compressor.rank=0\nmust be in [1, 64]", metrics=None)
    return [
        _full_cache(
            score={"name": "perplexity", "value": 11.96, "higher_is_better": False},
            delta_nll=None,
            compression_mean=1.0,
            kv_mem_mb_peak=6.0,
            kv_hit=1.0,
            decode_attn_ms=0.5124,
        ),
        _record(
            "5100000000000002", "none", "quantized", "none", tpot_s=0.0455, ttft_s=0.8123, decode_attn_ms=1.25
        ),
        _record(
            "5100000000000001",
            "none",
            "none",
            "h2o",
            score={"name": "perplexity", "value": 1234.56, "higher_is_better": False},
            accuracy_drop={"name": "delta_ppl_pct", "value": -0.5, "ci_low": -1.25, "ci_high": 0.0},
            compression_mean=None,
            compression_prefill=2.0,
            kv_mem_mb_prefill=4.1 * 1.23 / 2.0,
            decode_attn_ms=0.75,
        ),
        _record(
            "d000000000000001", "none", "quantized", "h2o", compression_mean=7.456
        ),  # before decode_attn_ms
        _record(
            "7000000000000001",
            "base",
            "snapkv",
            "streaming_llm",
            kv_hit=None,
            tpot_s=None,
            accuracy_drop={"name": "delta_ppl_pct", "value": 12.345, "ci_low": None, "ci_high": None},
        ),
        failed,
    ]


def _write_all(directory: Path, records: list[dict]) -> None:
    for record in records:
        write_record(record_path(directory, record["experiment"], record["cell_id"]), record)


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("KVBENCH_UPDATE_GOLDEN"):
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")


def test_report_matches_golden(tmp_path: Path) -> None:
    _write_all(tmp_path / "runs", _records())
    text = render_report(load_records(tmp_path / "runs"), "runs")
    _check_golden("report_basic.md", text)


def _seeded(cell_id: str, compressor: str, seed: int, ppl: float, drop: float, **metrics: object) -> dict:
    """A record of ``compressor`` run with ``seed`` (the run's seed, or the technique's for random)."""
    record = _record(cell_id, "none", compressor, "none", **metrics)
    knob = "compressor.seed" if compressor == "random" else "seed"
    record["command"] += f" {knob}={seed}"
    technique = {"name": compressor, **({"seed": seed} if compressor == "random" else {})}
    record["identity"] = {"stack": {"compressor": technique}, "seed": 0 if compressor == "random" else seed}
    record["metrics"]["score"]["value"] = ppl
    drop_metric = {"name": "delta_ppl_pct", "value": drop, "ci_low": 0.0, "ci_high": 9.0}
    record["metrics"]["accuracy_drop"] = drop_metric
    return record


def _seed_records() -> list[dict]:
    """A baseline, quantized over three run seeds, random over two technique seeds, svd once."""
    return [
        _full_cache(),
        _seeded("9000000000000000", "quantized", 0, 12.0, 1.0, decode_attn_ms=1.0),
        _seeded("9000000000000001", "quantized", 1, 12.6, 4.0, ttft_s=0.9, decode_attn_ms=1.5),
        _seeded("9000000000000002", "quantized", 2, 12.3, 2.5, ttft_s=1.0, decode_attn_ms=2.0),
        _seeded("a000000000000000", "random", 0, 13.0, 9.0, compression_mean=3.95),
        _seeded("a000000000000001", "random", 1, 14.0, 17.0, compression_mean=3.85),
        _seeded("c000000000000000", "svd", 0, 12.2, 2.0),
    ]


def test_seeds_show_as_mean_and_range_with_n(tmp_path: Path) -> None:
    text = render_report(_seed_records(), "seeds")
    _check_golden("report_seeds.md", text)
    rows = {row[1]: row for row in map(format_row, merge_seeds(_seed_records()))}
    # quantized: the mean of 1.0, 4.0 and 2.5 over 3 seeds and their range; TTFT averaged too
    assert rows["quantized"][3:7] == ["12.30", "+2.50 (range 1.00, 4.00)", "3.90×", "0.900"]
    assert rows["quantized"][8] == "1.500"  # decode attention: the mean over the seeds
    assert rows["quantized"][11] == "3×4"  # n: seeds x examples
    assert rows["random"][4:6] == ["+13.00 (range 9.00, 17.00)", "3.90×"]  # 3.95 and 3.85
    assert rows["svd"][4] == "+2.00 [0.00, 9.00]" and rows["svd"][11] == "4"  # one seed: over examples
    assert "mean over the seeds and their range" in text
    for cell in ("9000000000000000", "9000000000000001", "9000000000000002", "a000000000000001"):
        assert f"`{cell}`: `python -m kvbench " in text  # each seed's own command


def test_row_of_an_unmeasured_record_is_dashes_not_zeros() -> None:
    empty = dict.fromkeys(
        ["score", "accuracy_drop", "compression_prefill", "compression_mean", "ttft_s", "tpot_s"]
        + ["kv_mem_mb_peak", "kv_hit", "n_examples"]
    )
    record = _record("c", "none", "quantized", "none", **empty)
    record["device"] = None
    assert format_row(record) == [DASH, "quantized", DASH] + [DASH] * 10
    record["metrics"] = None
    assert format_row(record)[3:] == [DASH] * 10
    assert "| 0" not in render_table([record])


def test_row_formats() -> None:
    row = format_row(
        _record("c", "base", "quantized", "h2o", tpot_s=0.0455, decode_attn_ms=0.12345, kv_mem_mb_peak=0.004)
    )
    assert row == ["base", "quantized", "h2o", "12.35", "+3.10 [2.00, 4.20]", "3.90×"] + [
        "0.800", "45.5", "0.123", "0.00", "0.930", "4", "cpu",
    ]  # fmt: skip


def test_decode_attention_sits_beside_tpot_and_records_from_before_it_show_a_dash() -> None:
    new = _record("a", "none", "quantized", "none", decode_attn_ms=0.5)
    old = _record("b", "none", "none", "h2o")  # written before decode_attn_ms existed
    assert "decode_attn_ms" not in old["metrics"]
    header, _, *rows = render_table([new, old]).splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    assert names[names.index("TPOT (ms)") + 1] == "Attn (ms/layer)"
    cells = {r.split("|")[2].strip(): [c.strip() for c in r.strip("|").split("|")] for r in rows}
    assert cells["quantized"][names.index("Attn (ms/layer)")] == "0.500"
    assert cells["—"][names.index("Attn (ms/layer)")] == DASH


@pytest.mark.parametrize(
    "value, text",
    [(12.3456, "12.35"), (1234.56, "1235"), (49152.3, "49152"), (9.99996, "10.00"), (0.5, "0.5000")]
    + [(0.00012344, "0.0001234"), (0.0, "0.000")],
)
def test_significant_digits(value: float, text: str) -> None:
    assert format_significant(value) == text


def test_needle_score_and_drop_formats() -> None:
    assert format_score({"name": "needle_accuracy", "value": 0.8125, "higher_is_better": True}) == "81.2%"
    assert format_score({"name": "needle_accuracy", "value": None}) == DASH
    assert format_score(None) == DASH
    drop = {"name": "accuracy_points", "value": -1.0, "ci_low": -2.5, "ci_high": 0.25}
    assert format_drop(drop) == "-1.00 [-2.50, 0.25]"
    assert format_drop({"name": "accuracy_points", "value": 0.0, "ci_low": 0.0, "ci_high": 0.0}) == (
        "+0.00 [0.00, 0.00]"
    )
    assert format_drop(None) == DASH


def test_needle_header_names_its_metrics() -> None:
    record = _record(
        "c",
        "none",
        "quantized",
        "none",
        score={"name": "needle_accuracy", "value": 0.75, "higher_is_better": True},
        accuracy_drop={"name": "accuracy_points", "value": 5.0, "ci_low": 1.0, "ci_high": 9.0},
    )
    header = render_table([record]).splitlines()[0]
    assert "needle_accuracy" in header and "Accuracy-Drop (accuracy_points)" in header
    assert "75.0%" in render_table([record])


def test_qualified_stack() -> None:
    assert qualified_stack(_record("c", "pikv", "none", "h2o")) == "router/pikv + scheduler/h2o"
    assert qualified_stack(_record("c", "none", "none", "none")) == "full cache (all roles none)"


def test_cli_writes_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    _write_all(runs, _records())
    assert main([str(runs)]) == 0
    written = (runs / "REPORT.md").read_text(encoding="utf-8")
    plots = (
        "\n## Plots\n\n![pareto-smollm2_135m-pydoc](pareto-smollm2_135m-pydoc.png)\n"
        "![throughput-smollm2_135m-pydoc](throughput-smollm2_135m-pydoc.png)\n"
    )
    assert written == (GOLDEN / "report_basic.md").read_text(encoding="utf-8") + plots
    assert capsys.readouterr().out == written
    assert sorted(p.name for p in runs.iterdir()) == [
        "REPORT.md",
        "default",
        "pareto-smollm2_135m-pydoc.png",
        "throughput-smollm2_135m-pydoc.png",
    ]
    assert main([str(runs), "--out", str(tmp_path / "out" / "r.md")]) == 0
    assert (tmp_path / "out" / "r.md").read_text(encoding="utf-8") == written


@pytest.mark.parametrize("make", [True, False])
def test_cli_without_records_returns_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: bool
) -> None:
    directory = tmp_path / "empty"
    if make:
        directory.mkdir()
    assert main([str(directory)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert not (directory / "REPORT.md").exists()


def test_allocation_sweeps_get_rankkvs_table() -> None:
    records = []
    for i, (allocation, budget) in enumerate([("rankkv", 0.2), ("uniform", 0.2), ("uniform", 0.1)]):
        r = _record(f"a{i}", "none", "none", "h2o", peak_memory_mb=900.0 + i)
        r["config"] = {"budget": budget, "scheduler": {"name": "h2o", "allocation": allocation}}
        records.append(r)
    text = render_report(records, "rk")
    table = text.split("### Layer allocation (RankKV's table)\n\n", 1)[1]
    lines = table.splitlines()
    assert lines[0].startswith(
        "| Method        | Allocation | Budget | perplexity | TTFT (s) | TPOT (ms) | Attn (ms/layer) |"
    )
    assert [line.split("|")[2].strip() for line in lines[2:5]] == ["uniform", "uniform", "rankkv"]
    assert [line.split("|")[3].strip() for line in lines[2:5]] == ["0.1", "0.2", "0.2"]
    assert "| scheduler/h2o | uniform    | 0.1    |      12.35 |    0.800 |      40.0 |" in table
    assert "cells (config hashes): a0, a1, a2" in table  # its own provenance
    assert "Layer allocation" not in render_report(records[:1], "one")
