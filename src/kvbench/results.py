"""Cell identity and result records: one JSON file per cell, written atomically.

A cell is one point of a grid (a stack on a model and a dataset, with its settings). Its id
is a hash of the identity the runner builds from the resolved config, minus the keys that
cannot change a result (logging, launcher, output paths), so relaunching a grid skips the
cells already done. Records live at ``<results_dir>/<experiment>/<cell_id>.json``; the
report reads nothing else.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CELL_ID_LENGTH = 16
MANIFEST = "sweep.plan"  # a matrix sweep's shape, beside its records: JSON, but never read as a record
_JSON_SCALARS = (str, int, float, bool, type(None))


def json_leaves(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Yields ``(key path, scalar)`` for every leaf of a JSON value.

    Args:
        value: A tree of dicts with str keys, lists and JSON scalars.
        where: The key path of ``value`` itself, e.g. ``metrics.score``.

    Raises:
        TypeError: A key is not a str, or a value is not a JSON type (tuples and sets
            included), naming its key path.
    """
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where or '<root>'}: key {key!r} is a {type(key).__name__}, not a str")
            yield from json_leaves(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from json_leaves(item, f"{where}[{index}]")
    elif isinstance(value, _JSON_SCALARS):
        yield where, value
    else:
        raise TypeError(f"{where or '<root>'}: {type(value).__name__} {value!r} is not a JSON type")


def _check_json(value: Any) -> None:
    """Checks that ``value`` is plain JSON with finite floats only.

    Args:
        value: The tree to check.

    Raises:
        TypeError: A key or value is not a JSON type.
        ValueError: A float is NaN or infinite (unmeasured values must already be None).
    """
    for where, leaf in json_leaves(value, ""):
        if isinstance(leaf, float) and not math.isfinite(leaf):
            raise ValueError(f"{where or '<root>'} is {leaf!r}: write an unmeasured value as None (null)")


def cell_hash(identity: dict) -> str:
    """Returns the cell id: the first 16 hex chars of the sha256 of the canonical JSON.

    Canonical JSON: sorted keys, separators ``(",", ":")``, UTF-8 without escaping, floats as
    Python's ``repr``. The identity is hashed exactly as given: the runner removes the keys
    that do not change a result before calling this. Note that ``1`` and ``1.0`` differ.

    Args:
        identity: The cell's identity, plain JSON types only.

    Returns:
        A 16-character lowercase hex string.

    Raises:
        TypeError: ``identity`` is not a dict, or holds a value that is not a JSON type.
        ValueError: ``identity`` holds a NaN or infinite float.
    """
    if not isinstance(identity, dict):
        raise TypeError(f"identity must be a dict, got {type(identity).__name__}")
    _check_json(identity)
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:CELL_ID_LENGTH]


def _check_name(kind: str, name: str) -> None:
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"{kind} {name!r} must be a non-empty name without '/', '\\' or a leading '.'")


def record_path(results_dir: str | Path, experiment: str, cell_id: str) -> Path:
    """Returns where a cell's record lives: ``<results_dir>/<experiment>/<cell_id>.json``.

    Args:
        results_dir: The results root. Must be absolute: Hydra changes the working directory.
        experiment: The experiment name, one path component.
        cell_id: The cell id from :func:`cell_hash`.

    Returns:
        The record's path.

    Raises:
        ValueError: ``results_dir`` is relative, or a name is empty or holds a path separator.
    """
    root = Path(results_dir)
    if not root.is_absolute():
        raise ValueError(f"results_dir {str(results_dir)!r} must be an absolute path")
    _check_name("experiment", experiment)
    _check_name("cell_id", cell_id)
    return root / experiment / f"{cell_id}.json"


def _fsync_directory(directory: Path) -> None:
    """Flushes a directory entry (the rename) to disk, where the platform allows it."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` atomically: readers see the old file or the new, never a part.

    The text goes to ``.<name>.tmp-<pid>`` in the same directory (a name that never matches
    ``*.json``), is flushed and fsynced, then renamed over ``path`` with ``os.replace``. On any
    failure the temp file is removed and the old file, if any, is left untouched.

    Args:
        path: The destination. Parent directories are created.
        text: The full content, written as UTF-8.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def write_record(path: Path, record: dict) -> None:
    """Writes a result record atomically as indented JSON.

    Args:
        path: The record's path, usually from :func:`record_path`.
        record: The record; plain JSON types, unmeasured values as None.

    Raises:
        TypeError: A value is not a JSON type (named by its key path).
        ValueError: A float is NaN or infinite (named by its key path, e.g. ``metrics.kl``).
    """
    _check_json(record)
    text = json.dumps(record, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    write_text_atomic(path, text)


def read_record(path: Path) -> dict | None:
    """Reads a record.

    Args:
        path: The record's path.

    Returns:
        The record, or None if the file is missing, unreadable, not JSON or not an object.
    """
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def load_records(directory: str | Path) -> list[dict]:
    """Loads every record under ``directory``, recursively.

    Files whose name starts with ``.`` (temp files of an interrupted write), unparsable files
    and JSON files that are not records (no ``cell_id``) are skipped.

    Args:
        directory: The results root or one experiment's folder.

    Returns:
        The records sorted by ``(experiment, cell_id)``; empty when the directory is missing.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for path in root.rglob("*.json"):
        record = None if path.name.startswith(".") else read_record(path)
        if record is not None and "cell_id" in record:
            found.append((str(record.get("experiment", "")), str(record["cell_id"]), str(path), record))
    found.sort(key=lambda item: item[:3])
    return [item[3] for item in found]


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The ``sweep.plan`` a matrix sweep wrote into ``folder`` (:mod:`kvbench.sweep.plan`); None
    when there is none or it is not one."""
    try:
        value = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value.get("kind") == "kvbench-sweep" else None
