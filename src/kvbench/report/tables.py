"""Markdown tables of result records, in the shape of the PiKV experiment matrix.

Everything here is a pure function of the records (the schema written by
``kvbench.results``): no model, no config files. A value that was not measured (null)
renders as an em dash, never as 0.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from kvbench.report.records import _get, cell_ids, commands_by_cell, merge_seeds
from kvbench.report.settings import row_settings

DASH = "—"
REFUSED = "refused"  # a number the sanity checks refuse (the report says why)
ROLES = ("router", "compressor", "scheduler")
PERCENT_SCORES = frozenset({"needle_accuracy"})
ATTN = "Attn (ms/layer)"  # decode_attn_ms: a decode step's attention and stack work, per layer
# Column alignment: l(eft) for names, r(ight) for numbers.
_ALIGN = "lllrrrrrrrrrl"


def _first(records: Sequence[dict], *keys: str) -> Any:
    """Returns the first non-null value at ``keys`` among ``records``, or None."""
    return next((v for r in records if (v := _get(r, *keys)) is not None), None)


def _distinct(records: Sequence[dict], *keys: str, width: int | None = None) -> str:
    """Joins the distinct non-null values at ``keys`` with ``/`` (a mix stays visible)."""
    values = sorted({str(v)[:width] for r in records if (v := _get(r, *keys)) is not None})
    return "/".join(values) if values else DASH


def _fixed(value: float | None, decimals: int, *, scale: float = 1.0, suffix: str = "") -> str:
    """Formats with a fixed number of decimals; None renders as the dash."""
    return DASH if value is None else f"{value * scale:.{decimals}f}{suffix}"


def format_significant(value: float, digits: int = 4) -> str:
    """Formats ``value`` with ``digits`` significant digits, never in exponent notation.

    Integer digits beyond ``digits`` are kept: 12.3456 → ``12.35``, 49152.3 → ``49152``.

    Args:
        value: A finite number.
        digits: Significant digits to show.

    Returns:
        The formatted number.
    """
    if value == 0:
        return f"{0:.{digits - 1}f}"
    rounded = float(f"{value:.{digits}g}")  # so 9.99996 counts as 10.00, not 9.9999
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(rounded))))
    return f"{value:.{decimals}f}"


def format_score(score: dict | None) -> str:
    """Formats the task score: percent with 1 decimal for accuracies, else 4 significant digits.

    Args:
        score: ``metrics.score`` of a record: ``{"name", "value", "higher_is_better"}``.

    Returns:
        The formatted score, or the dash when unmeasured.
    """
    value = _get(score, "value")
    if value is None:
        return DASH
    if _get(score, "name") in PERCENT_SCORES:
        return f"{value * 100:.1f}%"
    return format_significant(value)


def format_drop(drop: dict | None) -> str:
    """Formats an accuracy drop as ``+3.10 [2.00, 4.20]``: value (signed) and its interval.

    Args:
        drop: ``metrics.accuracy_drop`` of a record: ``{"name", "value", "ci_low", "ci_high"}``.

    Returns:
        The formatted drop (without the interval if either bound is null), or the dash.
    """
    value = _get(drop, "value")
    if value is None:
        return DASH
    low, high = _get(drop, "ci_low"), _get(drop, "ci_high")
    interval = "" if low is None or high is None else f" [{low:.2f}, {high:.2f}]"
    return f"{value:+.2f}{interval}"


def format_seed_range(value: float | None, low: float | None, high: float | None) -> str:
    """Formats a mean over seeds with their range: ``+3.10 (range 2.00, 4.20)``; the dash when unmeasured."""
    if value is None:
        return DASH
    return f"{value:+.2f}" + ("" if low is None or high is None else f" (range {low:.2f}, {high:.2f})")


def _role(record: dict, role: str) -> str:
    name = _get(record, "stack", role)
    if name == "chain":  # show what it chains: chain[chunkkv,svd]
        stages = _get(record, "config", role, "stages") or []
        names = [str(s.get("name")) if isinstance(s, dict) else str(s) for s in stages]
        return f"chain[{','.join(names)}]"
    return DASH if name in (None, "none") else str(name)


def _n(record: dict) -> str:
    """The n column: examples, or ``seeds×examples`` for a record merged over seeds."""
    n_examples = _get(record, "metrics", "n_examples")
    n = DASH if n_examples is None else str(n_examples)
    seeds = _get(record, "_seeds", "n")
    return f"{seeds}×{n}" if seeds else n


def format_row(record: dict) -> list[str]:
    """Formats one done record as the cells of a matrix row (see :func:`table_header`).

    Args:
        record: A result record.

    Returns:
        Thirteen strings: roles, score, drop, compression, TTFT, TPOT, decode attention per layer
        (``decode_attn_ms``; a dash for records from before it was measured), KV memory, KV hit, n,
        device.
        A record merged over seeds (:func:`merge_seeds`) shows means, the drop's range over the
        seeds instead of its interval over examples, and n as ``seeds×examples``.
    """
    metrics = record.get("metrics") or {}
    compression = metrics.get("compression_mean")
    if compression is None:
        compression = metrics.get("compression_prefill")
    drop = format_drop(metrics.get("accuracy_drop"))
    if seeds := record.get("_seeds"):  # merged over seeds by merge_seeds
        low, high = seeds.get("drop") or (None, None)
        drop = format_seed_range(_get(metrics, "accuracy_drop", "value"), low, high)
    refused = record.get("_refused") or {}  # set by kvbench.report.sanity.annotate
    score = REFUSED if "score" in refused else format_score(metrics.get("score"))
    if record.get("_flag"):
        score += " ⚑"
    return [
        *(_role(record, role) for role in ROLES),
        score,
        REFUSED if "accuracy_drop" in refused else drop,
        REFUSED if "compression" in refused else _fixed(compression, 2, suffix="×"),
        _fixed(metrics.get("ttft_s"), 3),
        _fixed(metrics.get("tpot_s"), 1, scale=1000.0),
        _fixed(metrics.get("decode_attn_ms"), 3),
        _fixed(metrics.get("kv_mem_mb_peak"), 2),
        _fixed(metrics.get("kv_hit"), 3),
        _n(record),
        str(_get(record, "device", "type") or DASH),
    ]


def table_header(score_name: str | None, drop_name: str | None) -> list[str]:
    """Returns the matrix header, naming the score and the accuracy-drop metric.

    Args:
        score_name: e.g. ``perplexity``; None shows ``Score``.
        drop_name: e.g. ``delta_ppl_pct``; None leaves the name out.
    """
    drop = f"Accuracy-Drop ({drop_name})" if drop_name else "Accuracy-Drop"
    score = score_name or "Score"
    names = ["Router", "Compressor", "Scheduler", score, drop, "Compression ×", "TTFT (s)", "TPOT (ms)"]
    return names + [ATTN, "KV Mem (MB)", "KV Hit", "n", "device"]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> str:
    """Renders a padded markdown table.

    Args:
        header: Column titles.
        rows: Cells, one list per row, as long as ``header``.
        align: One ``l`` or ``r`` per column.

    Returns:
        The table, without a trailing newline.
    """
    cells = [[c.replace("|", "\\|") for c in row] for row in (header, *rows)]
    widths = [max(3, *(len(row[i]) for row in cells)) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        padded = (c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align))
        return "| " + " | ".join(padded) + " |"

    rule = (":" + "-" * (w + 1) if a == "l" else "-" * (w + 1) + ":" for w, a in zip(widths, align))
    return "\n".join([line(cells[0]), "|" + "|".join(rule) + "|", *(line(row) for row in cells[1:])])


def _stack_key(record: dict) -> tuple[str, ...]:
    return (*(str(_get(record, "stack", role)) for role in ROLES), str(record.get("cell_id")))


def render_table(
    records: Sequence[dict], *, score_name: str | None = None, drop_name: str | None = None
) -> str:
    """Renders done records as one matrix table, rows sorted by (router, compressor, scheduler).

    Args:
        records: Done records of one model and dataset.
        score_name: The score column's title; by default the first score name in ``records``.
        drop_name: The drop metric's name; by default the first one in ``records``.

    Returns:
        The markdown table, without a trailing newline.
    """
    score_name = score_name or _first(records, "metrics", "score", "name")
    drop_name = drop_name or _first(records, "metrics", "accuracy_drop", "name")
    merged = sorted(merge_seeds(records), key=_stack_key)
    return with_settings(table_header(score_name, drop_name), [format_row(r) for r in merged], _ALIGN, merged)


def with_settings(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    align: str,
    records: Sequence[dict | None],
    shown: Collection[str] = (),
) -> str:
    """A markdown table led by a Settings column when its rows' settings differ.

    Args:
        header: Column titles, without Settings.
        rows: Cells, one list per row.
        align: One ``l`` or ``r`` per column of ``header``.
        records: Row i's record, or None for a row that has none (a cell not run).
        shown: Settings the table shows in columns of their own (see
            :func:`~kvbench.report.settings.row_settings`).
    """
    found = row_settings([r for r in records if r is not None], shown)
    if found is None:
        return markdown_table(header, rows, align)
    settings = iter(found)
    lead = [next(settings) if r is not None else "" for r in records]
    cells = [[text or DASH, *row] for text, row in zip(lead, rows)]
    return markdown_table(["Settings", *header], cells, "l" + align)


def stack_order(record: dict) -> int:
    """Returns the number of non-none roles: ``stack.order``, else counted from the roles."""
    order = _get(record, "stack", "order")
    if isinstance(order, int):
        return order
    return sum(_get(record, "stack", role) not in (None, "none") for role in ROLES)


def qualified_stack(record: dict, empty: str = "full cache (all roles none)") -> str:
    """Names a stack with its roles, e.g. ``compressor/quantized + scheduler/h2o``.

    Roles set to none are left out; the full-cache stack is ``empty``.
    """
    names = [f"{role}/{_get(record, 'stack', role)}" for role in ROLES if _role(record, role) != DASH]
    return " + ".join(names) or empty


def render_footer(records: Sequence[dict], command: str | None = None) -> str:
    """Renders a table's provenance: model, dtype, data, device, versions, the command and the cells.

    Where records disagree (two dtypes, two protocol versions) every value is shown, joined by ``/``.
    Each cell's own command, which reruns it alone, follows in a collapsed list.

    Args:
        records: The table's records (merged records stand for each of their seeds).
        command: The command that produced the table (a sweep's); by default the cells' command
            when they share one.
    """
    model = _distinct(records, "model", "name")
    description = _distinct(records, "model", "description")
    if description != DASH:
        model = f"{model} ({description})"
    ids = sorted({cell for r in records for cell in cell_ids(r)})
    revision = _distinct(records, "dataset", "source", "revision")
    data = f"dataset sha256 {_distinct(records, 'dataset', 'sha256', width=12)}"
    if revision != DASH:
        data += f" (revision {revision})"
    device = f"{_distinct(records, 'device', 'type')} ({_distinct(records, 'device', 'name')})"
    torch = _distinct(records, "device", "torch")
    versions = f"torch {torch} · transformers {_distinct(records, 'device', 'transformers')}"
    commands = {c for r in records for c in commands_by_cell(r).values() if c}
    if command is None and len(commands) == 1:
        command = commands.pop()
    line = (
        f"Model: {model} · dtype {_distinct(records, 'model', 'dtype')} · {data}"
        f" · device {device} · {versions}"
        f" · kvbench {_distinct(records, 'kvbench_version')}"
        f" protocol {_distinct(records, 'protocol_version')}"
        + (f" · command `{command}`" if command else "")
        + f" · cells (config hashes): {', '.join(ids)}"
    )
    per_cell = sorted({(cell, c) for r in records for cell, c in commands_by_cell(r).items() if c})
    if not per_cell or (len(ids) == 1 and per_cell[0][1] == command):
        return line
    items = "\n".join(f"- `{cell}`: `{c}`" for cell, c in per_cell)
    return f"{line}\n\n<details><summary>Each cell's command</summary>\n\n{items}\n\n</details>"
