"""Breakdown tables (LongBench by task, LongBench-E, LongBench v2, lm-eval) and the Settings column."""

from __future__ import annotations

from kvbench.report.breakdowns import render_breakdowns
from kvbench.report.document import render_report
from kvbench.report.matrix import render_matrix_report
from kvbench.report.records import merge_seeds
from kvbench.report.settings import row_settings


def _record(cell_id: str, compressor: str = "none", scheduler: str = "none", **metrics: object) -> dict:
    """A done record of model m on dataset d; ``metrics`` are added to the common ones."""
    order = int(compressor != "none") + int(scheduler != "none")
    stack = {"router": {"name": "none"}, "compressor": {"name": compressor}, "scheduler": {"name": scheduler}}
    if order:
        stack["budget"] = {"budget": 0.25, "sinks": 4, "window": 32}
    return {
        "cell_id": cell_id,
        "status": "done",
        "stack": {"router": "none", "compressor": compressor, "scheduler": scheduler, "order": order},
        "identity": {"model": {"name": "m"}, "dataset": {"name": "d", "limit": 6}, "stack": stack, "seed": 0},
        "model": {"name": "m", "dtype": "float32"},
        "dataset": {"name": "d", "task": "longbench", "sha256": "ab"},
        "device": {"type": "cpu"},
        "metrics": {
            "compression_mean": 1.0 + order,
            "kv_mem_mb_peak": 8.0 / (1 + order),
            "n_examples": 6,
            **metrics,
        },
    }


def _task(score: float, category: str, drop: float | None = None) -> dict:
    entry: dict = {"score": score, "n": 2, "metric": "qa_f1_score", "category": category}
    if drop is not None:
        entry["drop"] = {"name": "accuracy_points", "value": drop, "ci_low": 0.0, "ci_high": 1.0}
    return entry


def _longbench(cell_id: str, scores: tuple[float, float, float], drops=None, **kw: object) -> dict:
    """Tasks qasper (QA), trec (Few-shot), hotpotqa (QA): the categories interleave in task order."""
    drops = drops or (None, None, None)
    tasks = {
        "qasper": _task(scores[0], "QA", drops[0]),
        "trec": _task(scores[1], "Few-shot", drops[1]),
        "hotpotqa": _task(scores[2], "QA", drops[2]),
    }
    overall = sum(scores) / 3
    drop = None if drops[0] is None else {"name": "score_points", "value": sum(drops) / 3}
    return _record(
        cell_id,
        score={"name": "longbench_score", "value": overall, "higher_is_better": True},
        accuracy_drop=drop,
        tasks=tasks,
        categories={"QA": (scores[0] + scores[2]) / 2, "Few-shot": scores[1]},
        **kw,
    )


def _rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first table after ``heading``, header first (the rule line left out)."""
    table = text.split(heading, 1)[1].split("\n\n")[2]
    lines = [line for i, line in enumerate(table.splitlines()) if i != 1]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def _longbench_records() -> list[dict]:
    snapkv = _longbench("s", (40.0, 50.0, 20.0), drops=(20.0, 10.0, 10.0), compressor="snapkv")
    h2o = _longbench("h", (30.0, 70.0, 30.0), drops=(30.0, -10.0, 0.0), scheduler="h2o")
    return [snapkv, h2o, _longbench("b", (60.0, 60.0, 30.0))]  # the full cache last


def test_longbench_tasks_are_grouped_by_category_with_means_and_changes() -> None:
    text = render_report(_longbench_records(), "lb")
    rows = _rows(text, "### By task (LongBench)")
    assert rows[0] == [
        "Router", "Compressor", "Scheduler", "Compression ×", "KV Mem (MB)",
        "qasper", "hotpotqa", "QA (mean)", "trec", "Few-shot (mean)", "Overall",
    ]  # fmt: skip
    assert rows[1] == ["—", "—", "—", "1.00×", "8.00", "60.0", "30.0", "45.0", "60.0", "60.0", "50.0"]
    assert rows[2][1] == "snapkv" and rows[2][5:] == [
        "40.0 (-20.0)", "20.0 (-10.0)", "30.0 (-15.0)", "50.0 (-10.0)", "50.0 (-10.0)", "36.7 (-13.3)",
    ]  # fmt: skip
    assert rows[3][2] == "h2o" and rows[3][5:] == [
        "30.0 (-30.0)", "30.0 (+0.0)", "30.0 (-15.0)", "70.0 (+10.0)", "70.0 (+10.0)", "43.3 (-6.7)",
    ]  # fmt: skip
    assert "qasper: qa_f1_score" in text and "`(+x)`/`(-x)`: the change against the full cache" in text
    assert text.index("### Single technique") < text.index("### By task (LongBench)")
    assert "cells (config hashes): b, h, s" in text.split("### By task (LongBench)", 1)[1]


def test_without_recorded_drops_changes_are_against_the_full_cache_row() -> None:
    records = [_longbench("b", (60.0, 60.0, 30.0)), _longbench("s", (40.0, 65.0, 30.0), compressor="snapkv")]
    row = _rows(render_report(records, "lb"), "### By task (LongBench)")[2]
    assert row[5:] == [
        "40.0 (-20.0)",
        "30.0 (+0.0)",
        "35.0 (-10.0)",
        "65.0 (+5.0)",
        "65.0 (+5.0)",
        "45.0 (-5.0)",
    ]


def test_a_refused_drop_shows_no_change() -> None:
    records = _longbench_records()
    records[0]["_refused"] = {"accuracy_drop": "its baseline scored other examples"}
    row = _rows("\n\n".join(render_breakdowns(records)), "### By task (LongBench)")[2]
    assert row[1] == "snapkv" and row[5:] == ["40.0", "20.0", "30.0", "50.0", "50.0", "36.7"]


def test_seeds_average_the_task_scores() -> None:
    a = _longbench("s0", (40.0, 50.0, 20.0), compressor="snapkv")
    b = _longbench("s1", (50.0, 70.0, 30.0), compressor="snapkv")
    b["identity"]["seed"] = 1
    (merged,) = merge_seeds([a, b])
    assert (
        merged["metrics"]["tasks"]["trec"]["score"] == 60.0 and merged["metrics"]["tasks"]["trec"]["n"] == 2
    )
    assert merged["metrics"]["categories"] == {"QA": 35.0, "Few-shot": 60.0}


def test_longbench_e_buckets() -> None:
    def buckets(*scores: float) -> dict:
        return {
            label: {"score": s, "tasks": {"qasper": s}} for label, s in zip(("0-4k", "4-8k", "8k+"), scores)
        }

    records = [
        _longbench("b", (60.0, 60.0, 30.0), buckets=buckets(50.0, 40.0, 30.0)),
        _longbench("s", (40.0, 50.0, 20.0), compressor="snapkv", buckets=buckets(45.0, 30.0)),
    ]
    rows = _rows(render_report(records, "lbe"), "### By length (LongBench-E)")
    assert rows[0][5:] == ["0-4k", "4-8k", "8k+"]
    assert rows[1][5:] == ["50.0", "40.0", "30.0"]
    assert rows[2][5:] == ["45.0 (-5.0)", "30.0 (-10.0)", "—"]


def _v2(cell_id: str, overall: float, drop: float | None, unparsed: int, **kw: object) -> dict:
    return _record(
        cell_id,
        score={"name": "longbench_v2_accuracy", "value": overall, "higher_is_better": True},
        accuracy_drop=None if drop is None else {"name": "accuracy_points", "value": drop},
        unparsed=unparsed,
        by_difficulty={"easy": {"score": overall + 10, "n": 2}, "hard": {"score": overall - 10, "n": 4}},
        by_length={
            "short": {"score": 50.0, "n": 3},
            "medium": {"score": None, "n": 0},
            "long": {"score": 25.0, "n": 3},
        },
        **kw,
    )


def test_longbench_v2_by_difficulty_and_length() -> None:
    records = [_v2("b", 40.0, None, 0), _v2("s", 30.0, 10.0, 2, compressor="snapkv")]
    rows = _rows(render_report(records, "v2"), "### By difficulty and length (LongBench v2)")
    assert rows[0][5:] == ["Overall", "Easy", "Hard", "Short", "Medium", "Long", "Unparsed", "n"]
    assert rows[1][5:] == ["40.0", "50.0", "30.0", "50.0", "—", "25.0", "0", "6"]
    assert rows[2][5:] == [
        "30.0 (-10.0)",
        "40.0 (-10.0)",
        "20.0 (-10.0)",
        "50.0 (+0.0)",
        "—",
        "25.0 (+0.0)",
        "2",
        "6",
    ]


def test_lm_eval_tasks_keep_their_metric_names_and_stderr() -> None:
    def lm_eval(acc: float, em: float) -> dict:
        return {
            "arc_easy": {"acc,none": acc, "acc_stderr,none": 0.01, "acc_norm,none": acc + 0.1},
            "gsm8k": {"exact_match,strict-match": em, "exact_match_stderr,strict-match": 0.02},
        }

    records = [
        _record("b", score={"name": "arc_easy acc", "value": 0.6}, lm_eval=lm_eval(0.6, 0.3)),
        _record(
            "s", compressor="snapkv", score={"name": "arc_easy acc", "value": 0.5}, lm_eval=lm_eval(0.5, 0.25)
        ),
    ]
    rows = _rows(render_report(records, "lm"), "### By task and metric (lm-eval)")
    assert rows[0][5:] == ["arc_easy: acc", "arc_easy: acc_norm", "gsm8k: exact_match,strict-match"]
    assert rows[2][5:] == ["0.5000 ± 0.0100", "0.6000", "0.2500 ± 0.0200"]


def test_settings_show_what_differs_between_rows() -> None:
    records = [_record("a", scheduler="streaming_llm"), _record("b", scheduler="streaming_llm")]
    records[1]["identity"]["stack"]["budget"]["sinks"] = 0
    records[1]["identity"]["seed"] = 1  # a seed alone never shows (rows over seeds are merged)
    text = render_report(records, "sinks")
    assert "| Settings | Router | Compressor | Scheduler     |" in text
    assert "| sinks=4  | —      | —          | streaming_llm |" in text
    assert "| sinks=0  | —      | —          | streaming_llm |" in text
    same = render_report([_record("a", scheduler="streaming_llm"), _record("b", scheduler="h2o")], "same")
    assert "Settings" not in same


def test_settings_leave_out_what_the_role_columns_show() -> None:
    a, b, full = _record("a", compressor="quantized"), _record("b", compressor="kivi"), _record("f")
    a["identity"]["stack"]["compressor"]["bits"] = 2
    b["identity"]["stack"]["compressor"]["bits"] = 4  # another technique's knob: not a difference
    assert row_settings([a, b, full]) is None
    c = _record("c", compressor="quantized")
    c["identity"]["stack"]["compressor"]["bits"] = 4
    assert row_settings([a, c, b]) == ["bits=2", "bits=4", ""]
    assert row_settings([a, c], shown={"compressor.bits"}) is None
    c["identity"]["model"]["revision"], c["identity"]["dataset"]["revision"] = "v2", "r2"
    a["identity"]["model"]["revision"], a["identity"]["dataset"]["revision"] = "v1", "r1"
    assert row_settings([a, c]) == [
        "model.revision=v1, dataset.revision=r1, bits=2",
        "model.revision=v2, dataset.revision=r2, bits=4",
    ]  # two keys share a leaf name: their dotted paths


def test_a_matrix_without_swept_labels_shows_the_records_settings() -> None:
    records = [_longbench("b", (60.0, 60.0, 30.0)), _longbench("s", (40.0, 50.0, 20.0), scheduler="h2o")]
    records.append(_longbench("t", (45.0, 50.0, 20.0), scheduler="h2o"))
    records[2]["identity"]["stack"]["budget"]["window"] = 64
    cells = [
        {
            "cell_id": "b",
            "model": "m",
            "dataset": "d",
            "rows": [{"section": "baseline", "label": "full cache"}],
        },
        {
            "cell_id": "s",
            "model": "m",
            "dataset": "d",
            "rows": [{"section": "single", "label": "scheduler/h2o"}],
        },
        {
            "cell_id": "t",
            "model": "m",
            "dataset": "d",
            "rows": [{"section": "single", "label": "scheduler/h2o"}],
        },
        {
            "cell_id": "n",
            "model": "m",
            "dataset": "d",
            "rows": [{"section": "single", "label": "scheduler/lru"}],
        },
    ]
    text = render_matrix_report(records, {"kind": "kvbench-sweep", "command": ["-m"], "cells": cells}, "t")
    single = text.split("### Single technique (3)", 1)[1]
    assert "| Settings  | Router |" in single and "| window=32 | —" in single and "| window=64 | —" in single
    assert "| —         | —      | —          | lru       |         not run |" in single
    rows = _rows(text, "### By task (LongBench)")
    assert [row[0] for row in rows] == ["Settings", "—", "window=32", "window=64"]
    assert "command `python -m kvbench -m`" in text.split("### By task (LongBench)", 1)[1]


def test_perplexity_and_needle_reports_have_no_breakdowns() -> None:
    for task, name in (("perplexity", "perplexity"), ("needle", "needle_accuracy")):
        records = [
            _record("b", score={"name": name, "value": 0.5}),
            _record("s", "snapkv", score={"name": name, "value": 0.4}),
        ]
        for r in records:
            r["dataset"]["task"] = task
        text = render_report(records, task)
        assert "### By " not in text and "Settings" not in text and render_breakdowns(records) == []
