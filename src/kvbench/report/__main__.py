"""Render a results folder as markdown: ``python -m kvbench.report DIR [--out FILE]``.

Reads the records under DIR only (no model, no config files), writes ``DIR/REPORT.md`` (or
``--out``) atomically and prints it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvbench.report.tables import render_report
from kvbench.results import load_records, write_text_atomic


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
    records = load_records(directory)
    if not records:
        print(f"kvbench-report: no result records (*.json) under {directory}", file=sys.stderr)
        return 2
    text = render_report(records, directory.resolve().name)
    write_text_atomic(args.out or directory / "REPORT.md", text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
