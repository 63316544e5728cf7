"""The technique catalog page is generated from the YAMLs and must be current."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_technique_docs_are_current():
    got = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_technique_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, got.stdout + got.stderr


def test_every_technique_has_a_docs_line_with_a_paper_and_an_example():
    page = (ROOT / "docs" / "techniques.md").read_text()
    for role in ("router", "compressor", "scheduler"):
        for path in (ROOT / "conf" / role).glob("*.yaml"):
            if path.stem == "none":
                continue
            line = next(x for x in page.splitlines() if x.startswith(f"| `{role}/{path.stem}` |"))
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]
            assert len(cells[1]) > 40, (path, cells[1])  # a real sentence, not a truncated label
            assert cells[2], path
            assert path.stem == "chain" or cells[4].startswith("`python -m kvbench"), path
