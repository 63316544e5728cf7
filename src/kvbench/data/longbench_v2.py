"""LongBench v2 examples: the hub dataset ``THUDM/LongBench-v2``, or a local file in its format.

An example is one JSON object with v2's fields: ``_id``, ``domain``, ``sub_domain``, ``difficulty``
(easy, hard), ``length`` (short, medium, long), ``question``, ``choice_A`` to ``choice_D``,
``answer`` (A to D) and ``context``. A local file (``dataset.path=FILE``) holds one object per
line (``.jsonl``), or one JSON array (``.json``, as the hub repository's ``data.json``). Without a
path, the hub dataset's ``train`` split is read through ``datasets`` at ``dataset.revision``. There is
no fallback: an example that cannot be read is an error naming the file (or hub row) and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbench.data import longbench
from kvbench.data.documents import _summary
from kvbench.errors import ConfigError, DatasetLoadError

HF_PATH = "THUDM/LongBench-v2"
SPLIT = "train"
CHOICES = ("A", "B", "C", "D")
DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")
TEXT = ("question", "choice_A", "choice_B", "choice_C", "choice_D", "context")
ALLOWED = {"answer": CHOICES, "difficulty": DIFFICULTIES, "length": LENGTHS}
OPTIONAL = ("_id", "domain", "sub_domain")


def check_local(path: Any) -> None:
    """Before any model loads: ``path`` is a file."""
    if not Path(str(path)).expanduser().is_file():
        raise ConfigError(
            f"dataset.path='{path}': no such file; allowed: a LongBench v2 .jsonl (or .json) file, or null"
        )


def example(doc: Any, where: str) -> dict[str, Any]:
    """One example with v2's fields, checked; ``where`` names it in errors."""
    if not isinstance(doc, dict):
        raise DatasetLoadError(f"{where}: not a JSON object")
    missing = [k for k in (*TEXT, *ALLOWED) if k not in doc]
    if missing:
        raise DatasetLoadError(f"{where}: missing field {', '.join(missing)}")
    for key in TEXT:
        if not isinstance(doc[key], str):
            raise DatasetLoadError(f"{where}: field {key} is {type(doc[key]).__name__}, not a string")
    for key, allowed in ALLOWED.items():
        if doc[key] not in allowed:
            raise DatasetLoadError(f"{where}: field {key}={doc[key]!r}: allowed {', '.join(allowed)}")
    return {**{k: doc.get(k) for k in OPTIONAL}, **{k: doc[k] for k in (*TEXT, *ALLOWED)}}


def _json_array(path: Path, name: str, limit: int | None) -> list[dict[str, Any]]:
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetLoadError(f"dataset '{name}': {path}: not JSON ({exc.msg})") from exc
    if not isinstance(items, list):
        raise DatasetLoadError(f"dataset '{name}': {path}: not a JSON array of examples")
    return [example(doc, f"dataset '{name}': {path}, item {i}") for i, doc in enumerate(items[:limit])]


def read_local(path: Any, name: str, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` examples of a local file (``.json``: one array; otherwise JSON lines)."""
    file = Path(str(path)).expanduser()
    try:
        docs = (
            _json_array(file, name, limit)
            if file.suffix == ".json"
            else longbench.json_lines(file, name, limit, example)
        )
    except OSError as exc:
        raise DatasetLoadError(f"dataset '{name}': {file}: cannot be read ({exc.strerror})") from exc
    if not docs:
        raise DatasetLoadError(f"dataset '{name}': {file} holds no examples")
    return docs


def read_hub(name: str, revision: str | None, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` examples of the hub dataset (network or the HF cache)."""
    where = f"dataset '{name}': hub dataset '{HF_PATH}', split '{SPLIT}'"
    try:
        import datasets

        data = datasets.load_dataset(HF_PATH, split=SPLIT, revision=revision)
        rows = data.select(range(min(limit, len(data)))) if limit is not None else data
        raw = [dict(row) for row in rows]
    except Exception as exc:
        raise DatasetLoadError(
            f"{where}: could not be loaded ({_summary(exc)}); it needs network access to the Hugging Face "
            "hub or a copy in the HF cache (HF_HOME / HF_DATASETS_CACHE), or set dataset.path to a local file"
        ) from exc
    if not raw:
        raise DatasetLoadError(f"{where}: no examples")
    return [example(row, f"{where}, row {i}") for i, row in enumerate(raw)]
