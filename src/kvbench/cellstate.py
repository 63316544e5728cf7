"""A cell's state on disk: done or failed (it has a complete record), interrupted, or pending; and
whether it runs. The one place that decides "is this cell done", for the runner and the sweep's plan.

Start markers are how a cell killed outright (kill -9, a cancelled job, the OOM killer) is noticed.
A killed process writes no record. Before a cell runs, the runner appends a start to
``<results>/<experiment>/.<cell_id>.starts`` (a dot-file: never read as a record); writing the
record removes it. A cell found with unfinished starts was killed (interrupted); after
``MAX_STARTS`` of them the runner records it ``failed`` (``killed: ...``) instead of trying it forever.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from kvbench.results import write_text_atomic

MAX_STARTS = 2
COMPLETE = ("done", "failed")  # a record with one of these statuses is the cell's result


def status(record: dict[str, Any] | None, record_path: Path) -> str:
    """``done`` or ``failed`` (the cell's complete record), ``interrupted`` (started, never
    finished) or ``pending``."""
    recorded = str(record.get("status")) if record else ""
    if recorded in COMPLETE:
        return recorded
    return "interrupted" if starts(record_path) else "pending"


def needs_run(state: str, *, force: bool, retry_failed: bool) -> bool:
    """A cell runs unless it is complete: done, or failed (``retry_failed`` reruns those); ``force``
    reruns any."""
    return force or state not in COMPLETE or (state == "failed" and retry_failed)


def marker_path(record_path: Path) -> Path:
    return record_path.with_name(f".{record_path.stem}.starts")


def starts(record_path: Path) -> list[dict[str, Any]]:
    """The unfinished starts of a cell (empty when none, or the marker is unreadable)."""
    try:
        value = json.loads(marker_path(record_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return value if isinstance(value, list) else []


def begin(record_path: Path) -> list[dict[str, Any]]:
    """Records a start; returns the unfinished starts that came before it."""
    before = starts(record_path)
    now = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        now["slurm_job"] = job
    write_text_atomic(marker_path(record_path), json.dumps([*before, now]))
    return before


def clear(record_path: Path) -> None:
    marker_path(record_path).unlink(missing_ok=True)


def killed_reason(before: list[dict[str, Any]]) -> str:
    last = before[-1]
    where = f"{last.get('host')} pid {last.get('pid')}" + (
        f" slurm job {last['slurm_job']}" if last.get("slurm_job") else ""
    )
    return (
        f"killed: started {len(before)} times without finishing (last on {where} at {last.get('time')}); "
        "retry_failed=true tries it again"
    )
