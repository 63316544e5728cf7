"""Corpora for the perplexity task: one string of real English text per dataset config.

The config's ``source`` key picks where the text comes from:

- ``pydoc``: the topic help pages that ship with Python (``pydoc_data.topics``); always available.
- ``text_file``: a local ``.jsonl``/``.json`` file holding one JSON object per line, or any other file
  read whole as UTF-8 text (``.txt``, wikitext's ``wiki.test.raw``, ...).
- ``hub``: anything ``datasets.load_dataset`` opens: a hub id (needs network or a copy in the HF cache),
  a local directory of data files, or a builder such as ``json`` with ``data_files``
  (:mod:`kvbench.data.hub`).

There is no fallback: every failure raises :class:`~kvbench.errors.DatasetLoadError`, whose message starts
with ``dataset '<name>': `` and says how to fix it.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import platform
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvbench.data import hub
from kvbench.data.documents import (
    DEFAULT_FIELD,
    DEFAULT_JOINER,
    _get,
    _joiner,
    _name,
    _summary,
    _take_documents,
)
from kvbench.errors import ConfigError, DatasetLoadError

SOURCES = ("pydoc", "text_file", "hub")
JSON_SUFFIXES = (".jsonl", ".json")  # parsed as records; any other file is read as UTF-8 text
PYDOC_JOINER = "\n\n"


def load_text(cfg: Mapping[str, Any]) -> str:
    """Load the full corpus a dataset config names, as one string.

    Args:
        cfg: The dataset config (an omegaconf ``DictConfig`` or a plain dict) with ``name``, ``source``
            and the keys that source reads (see the module docstring and ``conf/dataset/*.yaml``).

    Returns:
        The corpus text: never empty.

    Raises:
        DatasetLoadError: The source is unknown, or its text could not be loaded or is empty.
    """
    name = _name(cfg)
    source = _get(cfg, "source")
    if source == "pydoc":
        text = _load_pydoc(name)
    elif source == "text_file":
        text = _load_text_file(cfg, name)
    elif source == "hub":
        text = hub.load(cfg, name)
    else:
        raise DatasetLoadError(
            f"dataset '{name}': unknown source {source!r}; set dataset.source to one of {', '.join(SOURCES)}"
        )
    if not text.strip():
        raise DatasetLoadError(
            f"dataset '{name}': source '{source}' gave no text; point it at a non-empty corpus"
        )
    return text


def describe_source(cfg: Mapping[str, Any], text: str) -> dict[str, Any]:
    """Describe where a corpus came from, for the result record.

    Args:
        cfg: The dataset config the text was loaded from.
        text: The text ``load_text(cfg)`` returned.

    Returns:
        ``{"name", "source", "hf_path", "hf_name", "split", "revision", "path", "n_chars", "sha256"}``;
        keys that do not apply to the source are None. ``sha256`` is the hex digest of the UTF-8 text. For
        ``pydoc`` the revision is the Python version, since the help pages change with it.
    """
    source = _get(cfg, "source")
    hub = source == "hub"
    path = _get(cfg, "path") if source == "text_file" else None
    revision = _get(cfg, "revision") if hub else None
    if source == "pydoc":
        revision = f"python-{platform.python_version()}"
    return {
        "name": _get(cfg, "name"),
        "source": source,
        "hf_path": _get(cfg, "hf_path") if hub else None,
        "hf_name": _get(cfg, "hf_name") if hub else None,
        "split": _get(cfg, "split") if hub else None,
        "revision": revision,
        "path": str(Path(str(path)).expanduser().resolve()) if path else None,
        "n_chars": len(text),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }


def validate(cfg: Mapping[str, Any]) -> None:
    """Check a dataset config cheaply, before any model loads. Reads no data and downloads nothing.

    Args:
        cfg: The dataset config.

    Raises:
        ConfigError: One line naming the key, its value and what is allowed.
    """
    name = _get(cfg, "name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"dataset.name={name!r}: must be a non-empty string (the option's name, e.g. pydoc)"
        )
    source = _get(cfg, "source")
    if source not in SOURCES:
        hint = difflib.get_close_matches(str(source), SOURCES, n=1)
        did_you_mean = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(
            f"dataset.source={source!r}: unknown source; allowed: {', '.join(SOURCES)}{did_you_mean}"
        )
    max_documents = _get(cfg, "max_documents")
    if max_documents is not None and (
        isinstance(max_documents, bool) or not isinstance(max_documents, int) or max_documents < 1
    ):
        raise ConfigError(f"dataset.max_documents={max_documents!r}: must be null or an integer >= 1")
    joiner = _get(cfg, "joiner", DEFAULT_JOINER)
    if not isinstance(joiner, str):
        raise ConfigError(f"dataset.joiner={joiner!r}: must be a string, e.g. '\\n\\n'")
    if source == "pydoc":
        return
    field = _get(cfg, "field", DEFAULT_FIELD)
    if not isinstance(field, str) or not field.strip():
        raise ConfigError(f"dataset.field={field!r}: must be a non-empty column name, e.g. 'text'")
    if source == "text_file":
        _validate_path(_get(cfg, "path"))
    else:
        hub.validate(cfg)


def size_bound(cfg: Mapping[str, Any]) -> int | None:
    """The corpus's UTF-8 size in bytes, or an upper bound on it, known without a tokenizer or a hub.

    Args:
        cfg: A validated dataset config.

    Returns:
        The pydoc pages' exact size; a text file's size on disk (its text is read whole, newlines
        normalised, so never longer); None for JSON files and hub datasets, which must be read first.
    """
    source = _get(cfg, "source")
    if source == "pydoc":
        try:
            return _pydoc_bytes()
        except DatasetLoadError:
            return None
    path = _get(cfg, "path")
    if source == "text_file" and path and Path(str(path)).suffix.lower() not in JSON_SUFFIXES:
        return Path(str(path)).expanduser().stat().st_size
    return None


@functools.lru_cache(maxsize=1)
def _pydoc_bytes() -> int:
    return len(_load_pydoc("pydoc").encode("utf-8"))


def _validate_path(raw: Any) -> None:
    """Check ``dataset.path`` names a readable file (any suffix: only ``.jsonl``/``.json`` are parsed).

    Args:
        raw: The configured path (None when unset or Hydra's ``???``).

    Raises:
        ConfigError: The path is unset, missing, or not a readable file.
    """
    if raw is None or not str(raw).strip():
        raise ConfigError(
            f"dataset.path={raw!r}: required for source 'text_file'; pass dataset.path=/my/file.txt"
        )
    path = Path(str(raw)).expanduser()
    if not path.exists():
        raise ConfigError(f"dataset.path='{raw}': file not found")
    if not path.is_file():
        raise ConfigError(f"dataset.path='{raw}': not a regular file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"dataset.path='{raw}': file is not readable (check its permissions)")


def _load_pydoc(name: str) -> str:
    """Join Python's pydoc topic pages, in sorted key order, with a blank line between pages."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:
        raise DatasetLoadError(
            f"dataset '{name}': pydoc_data is missing from this Python ({_summary(exc)}); "
            "use a Python build that ships its full standard library"
        ) from exc
    return PYDOC_JOINER.join(topics[key] for key in sorted(topics))


def _load_text_file(cfg: Mapping[str, Any], name: str) -> str:
    """Join one field of a ``.jsonl``/``.json`` file's objects, or read any other file whole as UTF-8.

    Args:
        cfg: The dataset config: ``path``, ``field``, ``joiner``, ``max_documents``.
        name: The dataset name, for errors.

    Returns:
        The text.
    """
    raw = _get(cfg, "path")
    if raw is None or not str(raw).strip():
        raise DatasetLoadError(f"dataset '{name}': no file given; pass dataset.path=/my/file.txt")
    path = Path(str(raw)).expanduser()
    context = f"dataset '{name}': '{path}'"
    if not path.is_file():
        raise DatasetLoadError(f"{context}: file not found; pass dataset.path=<an existing file>")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetLoadError(
            f"{context}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            f"kvbench reads {'/'.join(JSON_SUFFIXES)} files as JSON lines and any other file as UTF-8 text"
        ) from exc
    except OSError as exc:
        raise DatasetLoadError(f"{context}: unreadable ({_summary(exc)}); check its permissions") from exc
    if path.suffix.lower() not in JSON_SUFFIXES:
        text = content
    else:
        field = _get(cfg, "field", DEFAULT_FIELD)
        documents = _take_documents(_json_rows(content, context), field, _get(cfg, "max_documents"), context)
        text = _joiner(cfg, name).join(documents)
    if not text.strip():
        raise DatasetLoadError(f"{context}: holds no text; point dataset.path at a non-empty file")
    return text


def _json_rows(content: str, context: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Parse JSON Lines, skipping blank lines.

    Args:
        content: The file's text.
        context: The ``dataset '<name>': '<path>'`` prefix for errors.

    Yields:
        ``("line <n>", object)`` for each non-blank line (1-based line numbers).
    """
    # Split on "\n" only: str.splitlines would also break on U+2028, which JSON allows inside strings.
    for number, line in enumerate(content.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetLoadError(
                f"{context}: line {number} is not valid JSON ({exc.msg} at column {exc.colno}); "
                "write one JSON object per line"
            ) from exc
        if not isinstance(row, dict):
            raise DatasetLoadError(
                f"{context}: line {number} is a JSON {type(row).__name__}, not an object; "
                "write one JSON object per line"
            )
        yield f"line {number}", row
