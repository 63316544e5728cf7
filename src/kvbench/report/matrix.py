"""The report of a technique matrix, in its shape: the sweep's plan (``sweep.plan``) gives the rows.

Like :mod:`kvbench.report.tables`, a pure function of the records and the plan: no model, no config.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from kvbench.report import sanity
from kvbench.report.tables import (
    _ALIGN,
    DASH,
    ROLES,
    _distinct,
    _first,
    format_row,
    markdown_table,
    render_failed,
    render_footer,
    render_report,
    table_header,
)

MATRIX_SECTIONS = (
    ("baseline", "Baseline"),
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
    return [roles.get(r, DASH) for r in ROLES] + [status] + [DASH] * 8


def _settings(label: str) -> str:
    """The settings part of a row label, ``... (compressor.bits=2, budget=0.1)``, or the dash."""
    return label.split(" (", 1)[1].rstrip(")") if " (" in label else DASH


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
    """A matrix table, with a Settings column when some row was swept over a setting."""
    if any(" (" in row["label"] for row, _ in entries):
        return markdown_table(["Settings", *header], _matrix_rows(entries, "settings"), "l" + _ALIGN)
    return markdown_table(header, _matrix_rows(entries, None), _ALIGN)


def render_matrix_group(entries: Sequence[tuple[dict, dict | None]], dropped: Sequence[dict]) -> str:
    """One model and dataset in the matrix's shape: a table per section, doubles by role pair.

    Args:
        entries: ``(row, record)`` pairs in the sweep's order; ``row`` is ``{"section", "label"}``
            from ``sweep.plan``; ``record`` is None for a cell that has not run.
        dropped: The sweep's illegal combinations, ``{"section", "label", "reason"}``.
    """
    unique = {id(r): r for _, r in entries if r is not None and r.get("status") == "done"}
    done = list(unique.values())  # a record shown in two rows counts once
    model = _distinct(done, "model", "name") if done else DASH
    dataset = _distinct(done, "dataset", "name") if done else DASH
    parts = [f"## {model} · {dataset} ({_distinct(done, 'dataset', 'task')})"]
    score_name = _first(done, "metrics", "score", "name")
    header = table_header(score_name, _first(done, "metrics", "accuracy_drop", "name"))
    for section, title in MATRIX_SECTIONS:
        rows = [(row, rec) for row, rec in entries if row["section"] == section]
        if not rows:
            continue
        parts.append(f"### {title} ({len(rows)})")
        if section == "variant":
            parts.append(markdown_table(["Variant", *header], _matrix_rows(rows, "label"), "l" + _ALIGN))
        elif section == "double":
            for roles, pair_title in _PAIR_TITLES.items():
                pair = [(row, rec) for row, rec in rows if tuple(_label_roles(row["label"])) == roles]
                if pair:
                    parts.append(f"#### {pair_title} ({len(pair)})")
                    parts.append(_matrix_table(header, pair))
            other = [(row, rec) for row, rec in rows if tuple(_label_roles(row["label"])) not in _PAIR_TITLES]
            if other:
                parts.append(_matrix_table(header, other))
        else:
            parts.append(_matrix_table(header, rows))
    if dropped:
        lines = [f"- {d['section']} {d['label']}: {d['reason']}" for d in dropped]
        parts.append("### Dropped as illegal\n\n" + "\n".join(lines))
    if done:
        parts.append(render_footer(done))
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
    if manifest.get("command"):
        parts.append(
            f"Command: `python -m kvbench {' '.join(manifest['command'])}` ({manifest.get('created')})"
        )
    parts += [render_matrix_group(groups[k], manifest.get("dropped", [])) for k in groups]
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
