"""Render a results folder as markdown: ``python -m kvbench.report DIR [--out FILE]``.

Reads the records under DIR only (no model, no config files), writes ``DIR/REPORT.md`` (or
``--out``) atomically and prints it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvbench.report.matrix import render_matrix_report
from kvbench.report.tables import render_report
from kvbench.results import load_records, write_text_atomic
from kvbench.sweep.plan import read_manifest


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvbench-report", description="Render kvbench result records as a markdown report."
    )
    parser.add_argument("dir", type=Path, help="a results folder (searched recursively for *.json)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: DIR/REPORT.md)")
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
    text = report_text(directory)
    if text is None:
        print(f"kvbench-report: no result records (*.json) under {directory}", file=sys.stderr)
        return 2
    write_text_atomic(args.out or directory / "REPORT.md", text)
    sys.stdout.write(text)
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


def write_report(directory: Path) -> Path | None:
    """Writes ``DIR/REPORT.md``; returns its path, or None when the folder holds no records."""
    text = report_text(directory)
    if text is None:
        return None
    path = Path(directory) / "REPORT.md"
    write_text_atomic(path, text)
    return path


if __name__ == "__main__":
    sys.exit(main())
