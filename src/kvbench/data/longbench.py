"""LongBench examples: a local folder in LongBench's own layout, or the hub through ``datasets``.

A local folder (``dataset.path=DIR``) holds ``<task>.jsonl`` files (``<task>_e.jsonl`` for
LongBench-E), one JSON object per line with LongBench's fields: ``input`` (the question),
``context``, ``answers``, ``length``, ``dataset``, ``language``, ``all_classes``, ``_id``.
Without a path, each task is read from the hub dataset lm-eval's task names (``dataset_path``,
``dataset_name``, its test split) at ``dataset.revision``. There is no fallback: a task that cannot
be read is an error naming it and where it was looked for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench.data.hub import _hub_error
from kvbench.errors import ConfigError, DatasetLoadError

REQUIRED = ("context", "answers")


def task_file(root: str | Path, task: str, e: bool) -> Path:
    return Path(str(root)).expanduser() / f"{task}{'_e' if e else ''}.jsonl"


def check_local(root: Any, tasks: list[str], e: bool) -> None:
    """Before any model loads: ``root`` is a folder holding every task's file."""
    folder = Path(str(root)).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"dataset.path='{root}': not a folder (LongBench's layout: <task>.jsonl files)")
    for task in tasks:
        path = task_file(folder, task, e)
        if not path.is_file():
            raise ConfigError(f"dataset.tasks contains {task!r}: no file {path}")


def normalize(doc: dict[str, Any]) -> dict[str, Any]:
    """LongBench names the question ``input``, lm-eval's templates ``question``: give both."""
    doc = dict(doc)
    if "question" not in doc:
        doc["question"] = doc.get("input", "")
    doc.setdefault("input", doc["question"])
    doc.setdefault("all_classes", None)
    return doc


def json_lines(
    path: Path, name: str, limit: int | None, parse: Callable[[dict, str], dict[str, Any]]
) -> list[dict[str, Any]]:
    """The first ``limit`` examples of a JSON-lines file, each checked by ``parse(doc, where)``."""
    docs: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if limit is not None and len(docs) >= limit:
                break
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetLoadError(f"dataset '{name}': {path}:{number}: not JSON ({exc.msg})") from exc
            docs.append(parse(doc, f"dataset '{name}': {path}:{number}"))
    return docs


def _example(doc: dict, where: str) -> dict[str, Any]:
    missing = [k for k in REQUIRED if k not in doc] + (
        [] if "input" in doc or "question" in doc else ["input"]
    )
    if missing:
        raise DatasetLoadError(f"{where}: missing field {', '.join(missing)}")
    return normalize(doc)


def read_local(path: Path, name: str, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` examples of one task file."""
    docs = json_lines(path, name, limit, _example)
    if not docs:
        raise DatasetLoadError(f"dataset '{name}': {path} holds no examples")
    return docs


def read_hub(
    name: str, hf_path: str | None, hf_name: str | None, split: str, revision: str | None, limit: int | None
) -> list[dict[str, Any]]:
    """The first ``limit`` examples of one task from the hub (network or the HF cache)."""
    if not hf_path:
        raise DatasetLoadError(f"dataset '{name}': task {hf_name} names no hub dataset; set dataset.path")
    context = f"dataset '{name}': hub dataset '{hf_path}', config '{hf_name}', split '{split}'"
    try:
        import datasets

        data = datasets.load_dataset(hf_path, hf_name, split=split, revision=revision)
        rows = data.select(range(min(limit, len(data)))) if limit is not None else data
        docs = [normalize(dict(row)) for row in rows]
    except Exception as exc:
        raise _hub_error(context, exc) from exc
    if not docs:
        raise DatasetLoadError(f"{context}: no examples")
    return docs
