"""Tables of a score's parts: LongBench by task and category, LongBench-E by length, LongBench v2 by
difficulty and length, lm-eval by task and metric.

One row per stack, full cache first; each table shows only what its records hold (task names,
categories, buckets and metric names come from the records). Like :mod:`kvbench.report.tables`, a
pure function of the records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvbench.report.records import _get, merge_seeds
from kvbench.report.tables import (
    DASH,
    REFUSED,
    _n,
    format_row,
    render_footer,
    stack_order,
    with_settings,
)

CHANGE_LEGEND = (
    "`(+x)`/`(-x)`: the change against the full cache, in points (negative: below the full cache): "
    "the record's paired drop where it has one, else the difference from the full-cache row."
)
_LEAD = ["Router", "Compressor", "Scheduler", "Compression ×", "KV Mem (MB)"]
Cells = Callable[[dict, dict | None], list[str]]  # (record, full-cache record to compare with) -> cells


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _change(entry: Any, base: Any) -> float | None:
    """``entry``'s change against the full cache: its drop negated, else its score minus ``base``'s.

    ``entry`` and ``base`` are ``{"score", "drop"?}`` (a task, a bucket, the overall score) or None.
    """
    drop = _number(_get(entry, "drop", "value"))
    if drop is not None:
        return -drop
    score, reference = _number(_get(entry, "score")), _number(_get(base, "score"))
    return None if score is None or reference is None or base is None else score - reference


def _cell(score: Any, change: float | None) -> str:
    """``41.7 (-21.7)``: the score with one decimal, and its change when known."""
    value = _number(score)
    if value is None:
        return DASH
    return f"{value:.1f}" + ("" if change is None else f" ({round(change, 1) + 0.0:+.1f})")


def _overall(record: dict) -> dict:
    """The overall score as an entry of :func:`_change`: ``{"score", "drop"}``."""
    return {
        "score": _get(record, "metrics", "score", "value"),
        "drop": _get(record, "metrics", "accuracy_drop"),
    }


def _keys(records: Sequence[dict], *path: str) -> list[str]:
    """The keys of the mapping at ``path`` in each record, in order of first appearance."""
    seen: dict[str, None] = {}
    for r in records:
        seen.update(dict.fromkeys(_get(r, *path) or {}))
    return list(seen)


def breakdown_table(records: Sequence[dict], names: Sequence[str], cells: Cells) -> str:
    """One row per stack, full cache first: Settings (if any differ), roles, compression, KV MB, ``names``.

    ``cells(record, base)`` gives the columns in ``names``; ``base`` is the full-cache record to
    compare with (the table's only one), None for the full cache itself and for a row whose drop the
    sanity checks refused (its baseline scored other examples).
    """
    merged = merge_seeds(records)
    rows = sorted(merged, key=lambda r: stack_order(r) != 0)  # stable: the given order otherwise
    full = [r for r in rows if stack_order(r) == 0]
    body = []
    for r in rows:
        refused = "accuracy_drop" in (r.get("_refused") or {})
        base = full[0] if len(full) == 1 and r is not full[0] and not refused else None
        row = format_row(r)
        body.append([*row[:3], row[5], row[9], *cells(r if not refused else _without_drops(r), base)])
    return with_settings([*_LEAD, *names], body, "lllrr" + "r" * len(names), rows)


def _without_drops(record: dict) -> dict:
    """The record with its drops left out (they compare with a baseline that scored other examples)."""
    metrics = dict(record.get("metrics") or {})
    metrics["accuracy_drop"] = None
    tasks = metrics.get("tasks") or {}
    metrics["tasks"] = {t: {k: v for k, v in e.items() if k != "drop"} for t, e in tasks.items()}
    return {**record, "metrics": metrics}


def _overall_cell(record: dict, base: dict | None) -> str:
    if "score" in (record.get("_refused") or {}):
        return REFUSED
    overall = _overall(record)
    return _cell(overall["score"], _change(overall, base and _overall(base)))


def _task_layout(records: Sequence[dict]) -> dict[str, list[str]]:
    """Category -> its tasks, both in order of first appearance in the records."""
    layout: dict[str, list[str]] = {}
    seen: set[str] = set()
    for r in records:
        for task, entry in (_get(r, "metrics", "tasks") or {}).items():
            if task not in seen:
                seen.add(task)
                layout.setdefault(str(_get(entry, "category") or "Other"), []).append(task)
    return layout


def render_tasks(records: Sequence[dict]) -> str:
    """LongBench by task: each category's tasks then the category's mean, and the overall mean."""
    layout = _task_layout(records)
    names = [name for category, tasks in layout.items() for name in (*tasks, f"{category} (mean)")]

    def cells(record: dict, base: dict | None) -> list[str]:
        tasks = _get(record, "metrics", "tasks") or {}
        out = []
        for category, members in layout.items():
            changes = []
            for name in members:
                entry = tasks.get(name)
                changes.append(_change(entry, _get(base, "metrics", "tasks", name)))
                out.append(_cell(_get(entry, "score"), changes[-1]))
            known = [c for c in changes if c is not None]
            mean = sum(known) / len(known) if len(known) == len(changes) else None
            out.append(_cell(_get(record, "metrics", "categories", category), mean))
        return [*out, _overall_cell(record, base)]

    metrics: dict[str, str] = {}
    for r in records:
        for task, entry in (_get(r, "metrics", "tasks") or {}).items():
            metrics.setdefault(task, str(_get(entry, "metric") or DASH))
    legend = (
        "A task's score is 100 × the mean of its metric over its examples ("
        + ", ".join(f"{task}: {metric}" for task, metric in metrics.items())
        + "); each category's tasks are followed by their mean, and Overall is the mean over tasks. "
        + CHANGE_LEGEND
        + " A category's change is the mean of its tasks'."
    )
    return f"{legend}\n\n{breakdown_table(records, [*names, 'Overall'], cells)}"


def render_buckets(records: Sequence[dict]) -> str:
    """LongBench-E: the mean over tasks in each length bucket (``0-4k``, ``4-8k``, ``8k+``)."""
    buckets = _keys(records, "metrics", "buckets")

    def cells(record: dict, base: dict | None) -> list[str]:
        own = _get(record, "metrics", "buckets") or {}
        return [
            _cell(_get(own, b, "score"), _change(own.get(b), _get(base, "metrics", "buckets", b)))
            for b in buckets
        ]

    legend = (
        f"LongBench-E: the mean over tasks of the examples in each length bucket (words). {CHANGE_LEGEND}"
    )
    return f"{legend}\n\n{breakdown_table(records, buckets, cells)}"


def render_v2(records: Sequence[dict]) -> str:
    """LongBench v2: accuracy overall, by difficulty and by length, and the unparsed answers."""
    parts = [("by_difficulty", k) for k in _keys(records, "metrics", "by_difficulty")]
    parts += [("by_length", k) for k in _keys(records, "metrics", "by_length")]

    def cells(record: dict, base: dict | None) -> list[str]:
        out = [_overall_cell(record, base)]
        for group, key in parts:
            entry = _get(record, "metrics", group, key)
            out.append(_cell(_get(entry, "score"), _change(entry, _get(base, "metrics", group, key))))
        unparsed = _number(_get(record, "metrics", "unparsed"))
        return [*out, DASH if unparsed is None else f"{unparsed:g}", _n(record)]

    names = ["Overall", *(key.capitalize() for _, key in parts), "Unparsed", "n"]
    legend = (
        "LongBench v2: multiple-choice accuracy (%) overall, by difficulty and by length; Unparsed: "
        f"answers with no choice found (scored wrong). {CHANGE_LEGEND}"
    )
    return f"{legend}\n\n{breakdown_table(records, names, cells)}"


def _lm_eval_columns(records: Sequence[dict]) -> list[tuple[str, str]]:
    """(task, metric) in order of first appearance: numbers only, ``*_stderr`` keys left out."""
    columns: dict[tuple[str, str], None] = {}
    for r in records:
        for task, values in (_get(r, "metrics", "lm_eval") or {}).items():
            for metric, value in (values or {}).items():
                if _number(value) is not None and not metric.partition(",")[0].endswith("_stderr"):
                    columns[(task, metric)] = None
    return list(columns)


def _stderr_key(metric: str) -> str:
    """lm-eval's name of a metric's standard error: ``acc_stderr``, ``exact_match_stderr,strict-match``."""
    name, comma, where = metric.partition(",")
    return f"{name}_stderr{comma}{where}"


def render_lm_eval(records: Sequence[dict]) -> str:
    """lm-eval tasks: one column per task and metric, with lm-eval's names, ``value ± stderr``."""
    columns = _lm_eval_columns(records)

    def cells(record: dict, base: dict | None) -> list[str]:
        out = []
        for task, metric in columns:
            values = _get(record, "metrics", "lm_eval", task) or {}
            value, stderr = _number(values.get(metric)), _number(values.get(_stderr_key(metric)))
            text = DASH if value is None else f"{value:.4f}"
            out.append(text if value is None or stderr is None else f"{text} ± {stderr:.4f}")
        return out

    names = [f"{task}: {metric.removesuffix(',none')}" for task, metric in columns]
    legend = "lm-eval: each task's metrics under lm-eval's names, `value ± standard error` where it has one."
    return f"{legend}\n\n{breakdown_table(records, names, cells)}"


SECTIONS: tuple[tuple[str, tuple[str, ...], Callable[[Sequence[dict]], str]], ...] = (
    ("By task (LongBench)", ("metrics", "tasks"), render_tasks),
    ("By length (LongBench-E)", ("metrics", "buckets"), render_buckets),
    ("By difficulty and length (LongBench v2)", ("metrics", "by_difficulty"), render_v2),
    ("By task and metric (lm-eval)", ("metrics", "lm_eval"), render_lm_eval),
)


def render_breakdowns(records: Sequence[dict], command: str | None = None) -> list[str]:
    """The breakdown sections of one model and dataset, then their provenance; [] when none applies.

    Args:
        records: Records of one model and dataset (the ones not done are left out).
        command: The sweep's command, for the provenance.

    Returns:
        Markdown parts: a heading and a table per breakdown the records have, then the footer.
    """
    done = [r for r in records if r.get("status") == "done"]
    parts: list[str] = []
    shown: list[dict] = []
    for title, path, render in SECTIONS:
        having = [r for r in done if isinstance(_get(r, *path), dict) and _get(r, *path)]
        if having:
            parts += [f"### {title}", render(having)]
            shown += [r for r in having if all(r is not s for s in shown)]
    return [*parts, render_footer(shown, command)] if parts else []
