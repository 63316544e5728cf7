"""Render a results folder as markdown: ``python -m kvbench.report DIR [--out FILE]``.

Reads the records under DIR only (no model, no config files), writes ``DIR/REPORT.md`` (or
``--out``) atomically and prints it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvbench.report import plots
from kvbench.report.document import render_report
from kvbench.report.matrix import render_matrix_report
from kvbench.report.wandb_report import create_or_explain
from kvbench.results import load_records, read_manifest, write_text_atomic


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvbench-report", description="Render kvbench result records as a markdown report."
    )
    parser.add_argument("dir", type=Path, help="a results folder (searched recursively for *.json)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: DIR/REPORT.md)")
    parser.add_argument(
        "--wandb-report",
        action="store_true",
        help="also create a W&B report (needs wandb-workspaces and W&B online; else prints its plan)",
    )
    parser.add_argument("--project", default=os.environ.get("WANDB_PROJECT", "kvbench"), help="W&B project")
    parser.add_argument("--entity", default=os.environ.get("WANDB_ENTITY"), help="W&B entity")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Renders the report of a results folder.

    Args:
        argv: Command-line arguments without the program name; None reads ``sys.argv``.

    Returns:
        0 on success; 2 when the folder is missing or holds no records.
    """
    args = _parse_args(argv)
    directory: Path = args.dir
    if not directory.is_dir():
        print(f"kvbench-report: {directory} is not a directory", file=sys.stderr)
        return 2
    path = write_report(directory, args.out)
    if path is None:
        print(f"kvbench-report: no result records (*.json) under {directory}", file=sys.stderr)
        return 2
    sys.stdout.write(path.read_text(encoding="utf-8"))
    if args.wandb_report:
        _, lines = create_or_explain(directory, args.project, args.entity)
        print("\n".join(lines), file=sys.stderr)
    return 0


def report_text(directory: Path) -> str | None:
    """The report of a results folder: in the matrix's shape where a sweep left ``sweep.plan``."""
    records = load_records(directory)
    if not records:
        return None
    manifest = read_manifest(directory)
    if manifest is not None:
        return render_matrix_report(records, manifest, directory.resolve().name)
    return render_report(records, directory.resolve().name)


def write_plots(directory: Path, where: Path) -> list[Path]:
    """Writes the report's PNG plots into ``where``: score against compression per model and
    dataset (and per category, for LongBench), and a needle heatmap per needle cell. Returns the
    files written."""
    records = [r for r in load_records(directory) if r.get("status") == "done"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        key = (str((r.get("model") or {}).get("name")), str((r.get("dataset") or {}).get("name")))
        groups.setdefault(key, []).append(r)
    written = []
    for (model, dataset), group in sorted(groups.items()):
        written += _save(plots.pareto(group), where / f"pareto-{model}-{dataset}.png")
        written += _save(plots.categories(group), where / f"categories-{model}-{dataset}.png")
        written += _save(plots.throughput_vs_compression(group), where / f"throughput-{model}-{dataset}.png")
        written += _save(plots.memory_vs_context(group), where / f"memory-{model}-{dataset}.png")
    for r in records:
        written += _save(plots.needle_heatmap(r), where / f"needle-{r['cell_id']}.png")
        written += _save(plots.retention_map(r), where / f"retention-{r['cell_id']}.png")
    return written


def _save(figure, path: Path) -> list[Path]:
    if figure is None:
        return []
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    figure.savefig(tmp, dpi=120)
    plots.plt.close(figure)
    os.replace(tmp, path)
    return [path]


def write_report(directory: Path, out: Path | None = None) -> Path | None:
    """Writes ``DIR/REPORT.md`` (or ``out``) and its plots beside it; None when there are no records."""
    text = report_text(directory)
    if text is None:
        return None
    path = out or Path(directory) / "REPORT.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    images = write_plots(directory, path.parent)
    if images:
        per_cell = ("needle-", "retention-")
        links = "\n".join(f"![{p.stem}]({p.name})" for p in images if not p.name.startswith(per_cell))
        titles = {
            "needle-": "Needle heatmaps (context length x depth)",
            "retention-": "Retention maps (layer x KV head: context and needle tokens kept)",
        }
        for prefix, title in titles.items():
            maps = [p for p in images if p.name.startswith(prefix)]
            if maps:
                cells = ", ".join(f"[{p.stem.removeprefix(prefix)}]({p.name})" for p in maps)
                links += f"\n\n{title}, one per cell: {cells}"
        text = text.rstrip("\n") + "\n\n## Plots\n\n" + links.strip() + "\n"
    write_text_atomic(path, text)
    return path


if __name__ == "__main__":
    sys.exit(main())
