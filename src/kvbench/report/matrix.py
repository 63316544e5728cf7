"""The report of a technique matrix, in its shape: the sweep's plan (``sweep.plan``) gives the rows.

Like :mod:`kvbench.report.tables`, a pure function of the records and the plan: no model, no config.
"""

from __future__ import annotations

import shlex
from collections import defaultdict
from collections.abc import Sequence

from kvbench.report import sanity
from kvbench.report.breakdowns import render_breakdowns
from kvbench.report.document import drop_legend, render_failed, render_report
from kvbench.report.records import merge_seeds
from kvbench.report.tables import (
    _ALIGN,
    DASH,
    ROLES,
    _distinct,
    _first,
    format_row,
    markdown_table,
    render_footer,
    table_header,
    with_settings,
)

MATRIX_SECTIONS = (
    ("baseline", "Baseline"),
    ("floor", "Sanity floor"),
    ("single", "Single technique"),
    ("double", "Double"),
    ("triple", "Triple"),
    ("variant", "System variants"),
)
_PAIR_TITLES = {
    ("router", "compressor"): "Router + Compressor",
    ("router", "scheduler"): "Router + Scheduler",
    ("compressor", "scheduler"): "Compressor + Scheduler",
}


def _label_roles(label: str) -> dict[str, str]:
    """``router/eplb + compressor/chain[a,b] (knobs)`` as ``{"router": "eplb", ...}``."""
    stack = label.split(" (", 1)[0]
    return {r: n for r, _, n in (p.strip().partition("/") for p in stack.split(" + ")) if r in ROLES}


def _status_row(label: str, status: str) -> list[str]:
    roles = _label_roles(label)
    return [roles.get(r, DASH) for r in ROLES] + [status] + [DASH] * 9


def _settings(label: str) -> str:
    """The settings part of a row label, ``... (compressor.bits=2, budget=0.1)``, or the dash."""
    return label.split(" (", 1)[1].rstrip(")") if " (" in label else DASH


def _without_seeds(label: str) -> str:
    """A row label with its seed settings (``seed=1``, ``compressor.seed=2``) left out."""
    stack, _, knobs = label.partition(" (")
    settings = [k for k in knobs.rstrip(")").split(", ") if k]
    kept = [k for k in settings if k.partition("=")[0].rpartition(".")[2] != "seed"]
    return f"{stack} ({', '.join(kept)})" if kept else stack


def merge_seed_rows(entries: Sequence[tuple[dict, dict | None]]) -> list[tuple[dict, dict | None]]:
    """Rows that differ only in their seeds as one row: their done records merged over the seeds.

    A row keeps its place (its first seed's). Rows whose records differ in more than a seed stay apart;
    rows with no done record show the first one's status.
    """
    groups: dict[tuple[str, str], list[tuple[dict, dict | None]]] = {}
    for row, record in entries:
        groups.setdefault((row["section"], _without_seeds(row["label"])), []).append((row, record))
    out: list[tuple[dict, dict | None]] = []
    for (section, label), items in groups.items():
        done = [r for _, r in items if r is not None and r.get("status") == "done"]
        merged = merge_seeds(done)
        if len(items) == 1 or len(merged) > 1:
            out += items
        else:
            record = merged[0] if merged else next((r for _, r in items if r is not None), None)
            out.append(({**items[0][0], "section": section, "label": label}, record))
    return out


def _matrix_rows(entries: Sequence[tuple[dict, dict | None]], first: str | None) -> list[list[str]]:
    """Rows of a matrix table; ``first`` adds a leading column: the ``label`` or its ``settings``."""
    rows = []
    for row, record in entries:
        if record is not None and record.get("status") == "done":
            cells = format_row(record)
        else:
            cells = _status_row(row["label"], "failed" if record is not None else "not run")
        lead = {"label": [row["label"]], "settings": [_settings(row["label"])]}.get(first or "", [])
        rows.append([*lead, *cells])
    return rows


def _matrix_table(header: list[str], entries: Sequence[tuple[dict, dict | None]]) -> str:
    """A matrix table, with a Settings column: the swept settings of the rows' labels, else the
    settings in which the rows' records differ."""
    if any(" (" in row["label"] for row, _ in entries):
        return markdown_table(["Settings", *header], _matrix_rows(entries, "settings"), "l" + _ALIGN)
    return with_settings(header, _matrix_rows(entries, None), _ALIGN, _row_records(entries))


def _row_records(entries: Sequence[tuple[dict, dict | None]]) -> list[dict | None]:
    """Each row's done record, or None."""
    return [r if r is not None and r.get("status") == "done" else None for _, r in entries]


def _done(entries: Sequence[tuple[dict, dict | None]]) -> list[dict]:
    """The done records of some rows, each once (a record can be shown in two rows)."""
    unique = {id(r): r for _, r in entries if r is not None and r.get("status") == "done"}
    return list(unique.values())


def render_matrix_group(
    entries: Sequence[tuple[dict, dict | None]], dropped: Sequence[dict], command: str | None = None
) -> str:
    """One model and dataset in the matrix's shape: a table per section, doubles by role pair.

    Each table is followed by its provenance (:func:`~kvbench.report.tables.render_footer`).

    Args:
        entries: ``(row, record)`` pairs in the sweep's order; ``row`` is ``{"section", "label"}``
            from ``sweep.plan``; ``record`` is None for a cell that has not run. Rows that differ
            only in their seeds are shown as one.
        dropped: The sweep's illegal combinations, ``{"section", "label", "reason"}``.
        command: The sweep's command, shown in each table's provenance.
    """
    entries = merge_seed_rows(entries)
    done = _done(entries)
    model = _distinct(done, "model", "name") if done else DASH
    dataset = _distinct(done, "dataset", "name") if done else DASH
    parts = [f"## {model} · {dataset} ({_distinct(done, 'dataset', 'task')})", drop_legend(done)]
    score_name = _first(done, "metrics", "score", "name")
    header = table_header(score_name, _first(done, "metrics", "accuracy_drop", "name"))

    def table(rows: list[tuple[dict, dict | None]], rendered: str) -> None:
        parts.append(rendered)
        if shown := _done(rows):
            parts.append(render_footer(shown, command))

    for section, title in MATRIX_SECTIONS:
        rows = [(row, rec) for row, rec in entries if row["section"] == section]
        if not rows:
            continue
        parts.append(f"### {title} ({len(rows)})")
        if section == "variant":
            variants = _matrix_rows(rows, "label")
            table(rows, with_settings(["Variant", *header], variants, "l" + _ALIGN, _row_records(rows)))
        elif section == "double":
            for roles, pair_title in _PAIR_TITLES.items():
                pair = [(row, rec) for row, rec in rows if tuple(_label_roles(row["label"])) == roles]
                if pair:
                    parts.append(f"#### {pair_title} ({len(pair)})")
                    table(pair, _matrix_table(header, pair))
            other = [(row, rec) for row, rec in rows if tuple(_label_roles(row["label"])) not in _PAIR_TITLES]
            if other:
                table(other, _matrix_table(header, other))
        else:
            table(rows, _matrix_table(header, rows))
    parts += render_breakdowns(done, command)
    if dropped:
        lines = [f"- {d['section']} {d['label']}: {d['reason']}" for d in dropped]
        parts.append("### Dropped as illegal\n\n" + "\n".join(lines))
    return "\n\n".join(parts)


def render_matrix_report(records: Sequence[dict], manifest: dict, title: str) -> str:
    """Renders a swept folder in its matrix's shape (``sweep.plan``), then the other records.

    Args:
        records: The folder's records.
        manifest: The sweep's plan: ``cells`` (cell id, rows, model, dataset) and ``dropped``.
        title: Shown as ``# kvbench report: <title>``.

    Returns:
        The markdown document, ending with one newline.
    """
    checked = sanity.render(records)
    records = sanity.annotate(records)
    by_id = {str(r.get("cell_id")): r for r in records}
    groups: dict[tuple[str, str], list[tuple[dict, dict | None]]] = defaultdict(list)
    listed = set()
    for cell in manifest.get("cells", []):
        listed.add(str(cell.get("cell_id")))
        for row in cell.get("rows", []):
            key = (str(cell.get("model")), str(cell.get("dataset")))
            groups[key].append((row, by_id.get(str(cell.get("cell_id")))))
    parts = [f"# kvbench report: {title}"]
    command = f"python -m kvbench {shlex.join(manifest['command'])}" if manifest.get("command") else None
    if command:
        parts.append(f"Command: `{command}` ({manifest.get('created')})")
    parts += [render_matrix_group(groups[k], manifest.get("dropped", []), command) for k in groups]
    rest = [r for r in records if str(r.get("cell_id")) not in listed]
    if any(r.get("status") == "done" for r in rest):
        body = render_report(rest, title).split("\n", 1)[1].strip()  # without its title line
        parts.append("## Other cells in this folder (not in the last sweep)\n\n" + body)
    if checked:
        parts.append(checked)
    failed = [r for r in records if r.get("status") != "done" and str(r.get("cell_id")) in listed]
    if failed:
        parts.append(render_failed(failed))
    return "\n\n".join(parts) + "\n"
