"""What every corpus source shares: reading a dataset config's keys, collecting documents from
rows, the string between documents, and one-line summaries of errors for the messages.

:mod:`~kvbench.data.corpus` and :mod:`~kvbench.data.hub` both build on these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from kvbench.errors import DatasetLoadError

DEFAULT_JOINER = "\n\n"
DEFAULT_FIELD = "text"
_MISSING = "???"  # Hydra's mandatory-value marker
_SUMMARY_CHARS = 200


def _take_documents(
    rows: Iterable[tuple[str, Mapping[str, Any]]], field: str, max_documents: int | None, context: str
) -> list[str]:
    """Collect the non-empty ``field`` values of ``rows``, stopping after ``max_documents``.

    Args:
        rows: ``(where, row)`` pairs; ``where`` (e.g. ``"line 3"``) locates the row in errors.
        field: The key holding each document's text.
        max_documents: How many non-empty documents to keep; None keeps all.
        context: The ``dataset '<name>': <source>`` prefix for errors.

    Returns:
        The documents, in order. Missing values (None) and whitespace-only strings are skipped.
    """
    documents: list[str] = []
    for where, row in rows:
        if field not in row:
            fields = ", ".join(map(str, row)) or "none"
            raise DatasetLoadError(
                f"{context}: {where} has no field '{field}' (fields: {fields}); "
                "set dataset.field to one of them"
            )
        value = row[field]
        if value is not None and not isinstance(value, str):
            raise DatasetLoadError(
                f"{context}: {where} field '{field}' is a {type(value).__name__}, not text; "
                "set dataset.field to a text field"
            )
        if value and value.strip():
            documents.append(value)
            if max_documents is not None and len(documents) >= max_documents:
                break
    return documents


def _summary(exc: BaseException) -> str:
    """Summarize an exception as ``"<Type>: <first non-empty line>"``, cut to a couple hundred characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else "no message"
    if len(first) > _SUMMARY_CHARS:
        first = first[: _SUMMARY_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {first}"


def _joiner(cfg: Mapping[str, Any], name: str) -> str:
    """The string placed between documents: ``cfg["joiner"]``, a blank line when absent."""
    joiner = _get(cfg, "joiner", DEFAULT_JOINER)
    if not isinstance(joiner, str):
        raise DatasetLoadError(
            f"dataset '{name}': dataset.joiner={joiner!r} is not a string; set it to e.g. '\\n\\n'"
        )
    return joiner


def _name(cfg: Mapping[str, Any]) -> str:
    """The dataset's name for error messages: ``cfg["name"]``, or ``"<unnamed>"`` when unset."""
    name = _get(cfg, "name")
    return str(name) if name else "<unnamed>"


def _get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """Read one key from a DictConfig or a dict, as plain Python values.

    Args:
        cfg: The dataset config.
        key: The key to read.
        default: Returned when the key is absent.

    Returns:
        The value; None for Hydra's mandatory ``???``; nested omegaconf containers become lists/dicts.
    """
    if isinstance(cfg, DictConfig):
        if key not in cfg:
            return default
        if OmegaConf.is_missing(cfg, key):
            return None
        value = cfg[key]
        if isinstance(value, DictConfig | ListConfig):
            return OmegaConf.to_container(value, resolve=True)
        return value
    value = cfg.get(key, default)
    return None if value == _MISSING else value
