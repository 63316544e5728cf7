"""Corpora from ``datasets`` (``source: hub``): a hub id, a local directory of data files, or a builder.

Loading needs network access to the Hugging Face hub or a copy in the HF cache; every failure is a
:class:`~kvbench.errors.DatasetLoadError` that names the dataset and says how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kvbench.data.documents import DEFAULT_FIELD, _get, _joiner, _summary, _take_documents
from kvbench.errors import ConfigError, DatasetLoadError


def validate(cfg: Mapping[str, Any]) -> None:
    """Check the keys ``source: hub`` reads, without touching the network.

    Args:
        cfg: The dataset config.

    Raises:
        ConfigError: A hub key has the wrong type or is empty.
    """
    for key in ("hf_path", "split"):
        value = _get(cfg, key)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"dataset.{key}={value!r}: must be a non-empty string for source 'hub'")
    for key in ("hf_name", "revision"):
        value = _get(cfg, key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"dataset.{key}={value!r}: must be null or a string")
    streaming = _get(cfg, "streaming", False)
    if not isinstance(streaming, bool):
        raise ConfigError(f"dataset.streaming={streaming!r}: must be true or false")
    data_files = _get(cfg, "data_files")
    if data_files is not None and not isinstance(data_files, str | list | dict):
        raise ConfigError(
            f"dataset.data_files={data_files!r}: must be null, a path, a list or a split->files map"
        )


def load(cfg: Mapping[str, Any], name: str) -> str:
    """Load one column of a ``datasets`` split (map-style or streamed) and join its documents.

    Args:
        cfg: The dataset config: ``hf_path``, ``hf_name``, ``split``, ``revision``, ``data_files``,
            ``streaming``, ``field``, ``joiner``, ``max_documents``.
        name: The dataset name, for errors.

    Returns:
        The text.
    """
    hf_path, hf_name, split = _get(cfg, "hf_path"), _get(cfg, "hf_name"), _get(cfg, "split")
    if not hf_path:
        raise DatasetLoadError(
            f"dataset '{name}': dataset.hf_path is not set; name a hub id or a local directory"
        )
    config = f", config '{hf_name}'" if hf_name else ""
    context = f"dataset '{name}': hub dataset '{hf_path}'{config}, split '{split}'"
    field = _get(cfg, "field", DEFAULT_FIELD)
    split_data = _open_hub_split(cfg, context)
    try:
        documents = _take_documents(
            _hub_rows(split_data, field, context), field, _get(cfg, "max_documents"), context
        )
    except DatasetLoadError:
        raise
    except Exception as exc:  # a streamed split reads lazily: network and parse errors surface here
        raise _hub_error(context, exc) from exc
    text = _joiner(cfg, name).join(documents)
    if not text.strip():
        raise DatasetLoadError(
            f"{context}: column '{field}' holds no text; check dataset.split and dataset.field"
        )
    return text


def _open_hub_split(cfg: Mapping[str, Any], context: str) -> Any:
    """Call ``datasets.load_dataset`` for the configured split.

    Args:
        cfg: The dataset config.
        context: The error prefix naming the dataset.

    Returns:
        A ``datasets.Dataset``, or a ``datasets.IterableDataset`` when ``streaming`` is true.
    """
    kwargs: dict[str, Any] = {"split": _get(cfg, "split"), "revision": _get(cfg, "revision")}
    if _get(cfg, "data_files") is not None:
        kwargs["data_files"] = _get(cfg, "data_files")
    if _get(cfg, "streaming", False):
        kwargs["streaming"] = True
    try:
        import datasets

        split_data = datasets.load_dataset(_get(cfg, "hf_path"), _get(cfg, "hf_name"), **kwargs)
    except Exception as exc:
        raise _hub_error(context, exc) from exc
    if not isinstance(split_data, datasets.Dataset | datasets.IterableDataset):
        raise DatasetLoadError(
            f"{context}: load_dataset returned a {type(split_data).__name__}, not one split; "
            "set dataset.split"
        )
    return split_data


def _hub_rows(split_data: Any, field: str, context: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Iterate a split's rows, reading only ``field`` when the columns are known up front.

    Args:
        split_data: A ``datasets.Dataset`` or ``datasets.IterableDataset``.
        field: The text column.
        context: The error prefix naming the dataset.

    Yields:
        ``("row <i>", row)`` pairs, 0-based.
    """
    columns = split_data.column_names
    if columns is not None:
        if field not in columns:
            raise DatasetLoadError(
                f"{context}: no column '{field}' (columns: {', '.join(columns)}); "
                "set dataset.field to one of them"
            )
        split_data = split_data.select_columns([field])
    for index, row in enumerate(split_data):
        yield f"row {index}", row


def _hub_error(context: str, exc: BaseException) -> DatasetLoadError:
    """Wrap an exception from ``datasets`` in a one-line, actionable error, to raise ``from exc``."""
    return DatasetLoadError(
        f"{context}: could not be loaded ({_summary(exc)}); it needs network access to the Hugging Face hub "
        "or a local copy in the HF cache (HF_HOME / HF_DATASETS_CACHE), or set dataset.hf_path to a local "
        "directory of data files"
    )
