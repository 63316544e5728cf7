"""The whole report of a results folder: a section per model and dataset (its tables, their
provenance, the breakdowns and allocations), the sanity checks, then the failed cells.

It assembles the pieces of :mod:`~kvbench.report.tables`, :mod:`~kvbench.report.breakdowns`,
:mod:`~kvbench.report.allocations` and :mod:`~kvbench.report.sanity`, and like them is a pure function
of the records.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from kvbench.report import sanity
from kvbench.report.allocations import allocation_records, render_allocations
from kvbench.report.breakdowns import render_breakdowns
from kvbench.report.records import _get, merge_seeds
from kvbench.report.tables import (
    DASH,
    _distinct,
    _first,
    _stack_key,
    qualified_stack,
    render_footer,
    render_table,
    stack_order,
)

SECTION_TITLES = {0: "Baseline", 1: "Single technique", 2: "Double", 3: "Triple"}


def render_group(records: Sequence[dict]) -> str:
    """Renders one model and dataset: heading, a table per stack order, and the footer.

    Args:
        records: Done records sharing a model name and a dataset name.

    Returns:
        The markdown section, without a trailing newline.
    """
    model, dataset = _distinct(records, "model", "name"), _distinct(records, "dataset", "name")
    parts = [f"## {model} · {dataset} ({_distinct(records, 'dataset', 'task')})"]
    score_name = _first(records, "metrics", "score", "name")
    drop_name = _first(records, "metrics", "accuracy_drop", "name")
    by_order: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        by_order[stack_order(record)].append(record)
    parts.append(drop_legend(records))
    for order in sorted(by_order):
        parts.append(f"### {SECTION_TITLES.get(order, f'Order {order}')}")
        parts.append(render_table(by_order[order], score_name=score_name, drop_name=drop_name))
        parts.append(render_footer(by_order[order]))
    parts += render_breakdowns(records)

    allocations = render_allocations(records)
    if allocations:
        parts += [allocations, render_footer(allocation_records(records))]
    return "\n\n".join(parts)


def drop_legend(records: Sequence[dict]) -> str:
    """How to read the accuracy drop, the decode attention and n, including the seeds' form when
    some setting has several."""
    legend = (
        "Accuracy-Drop: the cell's drop against the full cache on the same examples, with its 95 % "
        "paired bootstrap interval over the examples `[low, high]`; n: examples. Attn: of a decode "
        "step, the cache's attention and the stack's work after the forward, in ms per layer, the "
        "mean over sampled steps (beside TPOT, the whole step's); a dash where it was not measured."
    )
    if any(r.get("_seeds") for r in merge_seeds(records)):
        legend += (
            " A setting run over several seeds shows the mean over the seeds and their range "
            "`(range min, max)`, and n as seeds×examples."
        )
    return legend


def _failure_line(record: dict) -> str:
    status = record.get("status")
    reason = " ".join(str(record.get("error") or "").split())  # one line
    if not reason:
        reason = "no reason recorded" if status == "failed" else f"status {status!r}"
    where = f"{_get(record, 'model', 'name') or DASH} · {_get(record, 'dataset', 'name') or DASH}"
    return f"- {qualified_stack(record)} ({where}, cell `{record.get('cell_id')}`): {reason}"


def render_failed(records: Sequence[dict]) -> str:
    """Renders the ``Failed cells`` section: one line per record that is not done.

    Args:
        records: Records whose status is not ``done``.

    Returns:
        The markdown section, without a trailing newline.
    """
    key = lambda r: (str(_get(r, "model", "name")), str(_get(r, "dataset", "name")), *_stack_key(r))
    return "\n".join(["## Failed cells", "", *(_failure_line(r) for r in sorted(records, key=key))])


def render_report(records: Sequence[dict], title: str) -> str:
    """Renders the whole report: a section per (model, dataset), then the failed cells.

    Args:
        records: Records as returned by :func:`kvbench.results.load_records`.
        title: Shown as ``# kvbench report: <title>``, usually the results folder's name.

    Returns:
        The markdown document, ending with one newline.
    """
    checked = sanity.render(records)
    records = sanity.annotate(records)
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for record in records:
        if record.get("status") == "done":
            key = (str(_get(record, "model", "name") or DASH), str(_get(record, "dataset", "name") or DASH))
            groups[key].append(record)
    parts = [f"# kvbench report: {title}"]
    parts += [render_group(groups[key]) for key in sorted(groups)]
    failed = [r for r in records if r.get("status") != "done"]
    if not groups:
        parts.append("No completed cells.")
    if checked:
        parts.append(checked)
    if failed:
        parts.append(render_failed(failed))
    return "\n\n".join(parts) + "\n"
