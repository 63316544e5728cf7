"""Tests for kvbench.data.corpus: every source loads real text offline; every failure names the dataset."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from kvbench.data import describe_source, load_text, validate
from kvbench.errors import ConfigError, DatasetLoadError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "dataset"
SHIPPED = ("pydoc", "text_file", "wikitext2", "pg19", "c4")
PROTOCOL_KEYS = ("task", "prefill", "chunk", "chunks_per_window", "windows", "decode_steps")
PROVENANCE_KEYS = {"name", "source", "hf_path", "hf_name", "split", "revision", "path", "n_chars", "sha256"}
DOCS = ["The first document.", "", "The second document.", "   ", "The third document."]


def _cfg(name: str, source: str, **overrides: Any) -> dict[str, Any]:
    """A dataset config with the shipped keys' defaults.

    Args:
        name: The dataset name.
        source: pydoc, text_file or hub.
        **overrides: Keys to set.

    Returns:
        The config as a plain dict.
    """
    cfg: dict[str, Any] = {
        "name": name,
        "source": source,
        "hf_path": None,
        "hf_name": None,
        "split": None,
        "revision": None,
        "data_files": None,
        "streaming": False,
        "field": "text",
        "joiner": "\n\n",
        "max_documents": None,
        "path": None,
    }
    cfg.update(overrides)
    return cfg


def _write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    """Write one JSON object per line, each with ``field`` and an ``id``.

    Args:
        path: The file to write.
        texts: The documents.
        field: The key holding each document.

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": i, field: text}) for i, text in enumerate(texts)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def offline_hf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Put ``datasets`` and ``huggingface_hub`` offline, with a throwaway cache.

    Both libraries read the offline variables at import, so the module constants are patched as well.
    """
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets_config = pytest.importorskip("datasets.config")
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets_config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets_config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


# pydoc


def test_pydoc_is_large_deterministic_and_stably_hashed() -> None:
    cfg = _cfg("pydoc", "pydoc")
    first, second = load_text(cfg), load_text(cfg)
    assert len(first) > 300_000
    assert first == second
    info = describe_source(cfg, first)
    assert set(info) == PROVENANCE_KEYS
    assert info["sha256"] == describe_source(cfg, second)["sha256"]
    assert info["sha256"] == hashlib.sha256(first.encode("utf-8")).hexdigest()
    assert info["n_chars"] == len(first)
    assert info["hf_path"] is None and info["path"] is None


def test_pydoc_is_topics_in_sorted_key_order() -> None:
    from pydoc_data.topics import topics

    text = load_text(_cfg("pydoc", "pydoc"))
    first_key = sorted(topics)[0]
    assert text.startswith(topics[first_key])
    assert text.count("\n\n") >= len(topics) - 1


# text_file


def test_txt_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("Héllo wörld.\nSecond line.\n", encoding="utf-8")
    cfg = _cfg("mine", "text_file", path=str(path))
    validate(cfg)
    text = load_text(cfg)
    assert text == "Héllo wörld.\nSecond line.\n"
    info = describe_source(cfg, text)
    assert info["path"] == str(path.resolve())
    assert info["source"] == "text_file" and info["split"] is None


def test_jsonl_round_trip_skips_empty_documents(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "docs.jsonl", DOCS, field="body")
    cfg = _cfg("mine", "text_file", path=str(path), field="body", joiner="\n---\n")
    validate(cfg)
    assert load_text(cfg) == "The first document.\n---\nThe second document.\n---\nThe third document."


def test_jsonl_max_documents(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "docs.json", DOCS)
    cfg = _cfg("mine", "text_file", path=str(path), max_documents=2)
    assert load_text(cfg) == "The first document.\n\nThe second document."


def test_missing_file_names_dataset_and_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.txt"
    cfg = _cfg("mine", "text_file", path=str(path))
    with pytest.raises(DatasetLoadError, match=r"^dataset 'mine': ") as info:
        load_text(cfg)
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match="file not found") as config_info:
        validate(cfg)
    assert str(path) in str(config_info.value)


def test_bad_json_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(DatasetLoadError, match=r"^dataset 'mine': .*line 3 is not valid JSON") as info:
        load_text(_cfg("mine", "text_file", path=str(path)))
    assert str(path) in str(info.value)


def test_missing_field_lists_the_fields(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "docs.jsonl", DOCS, field="body")
    with pytest.raises(
        DatasetLoadError, match=r"^dataset 'mine': .*no field 'text' \(fields: id, body\)"
    ) as info:
        load_text(_cfg("mine", "text_file", path=str(path)))
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "suffix, content", [(".txt", ""), (".txt", " \n\n"), (".jsonl", ""), (".jsonl", '{"text": ""}\n')]
)
def test_empty_file_is_an_error(tmp_path: Path, suffix: str, content: str) -> None:
    path = tmp_path / f"empty{suffix}"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DatasetLoadError, match=r"^dataset 'mine': .*holds no text") as info:
        load_text(_cfg("mine", "text_file", path=str(path)))
    assert str(path) in str(info.value)


def test_non_utf8_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    with pytest.raises(DatasetLoadError, match=r"^dataset 'mine': .*UTF-8") as info:
        load_text(_cfg("mine", "text_file", path=str(path)))
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


# hub, exercised offline on local data files


def test_hub_local_directory(tmp_path: Path, offline_hf: None) -> None:
    _write_jsonl(tmp_path / "local" / "test.jsonl", DOCS)
    cfg = _cfg("local", "hub", hf_path=str(tmp_path / "local"), split="test")
    validate(cfg)
    text = load_text(cfg)
    assert text == "The first document.\n\nThe second document.\n\nThe third document."
    info = describe_source(cfg, text)
    assert (info["hf_path"], info["split"], info["path"]) == (str(tmp_path / "local"), "test", None)


def test_hub_parquet_directory_max_documents(tmp_path: Path, offline_hf: None) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), tmp_path / "pq" / "test.parquet")
    cfg = _cfg("pq", "hub", hf_path=str(tmp_path / "pq"), split="test", max_documents=2)
    assert load_text(cfg) == "The first document.\n\nThe second document."


def test_hub_json_builder_with_data_files(tmp_path: Path, offline_hf: None) -> None:
    path = _write_jsonl(tmp_path / "docs.jsonl", DOCS, field="body")
    cfg = _cfg("built", "hub", hf_path="json", data_files=str(path), split="train", field="body")
    validate(cfg)
    assert load_text(cfg).startswith("The first document.\n\nThe second document.")


def test_hub_streaming_takes_first_documents(tmp_path: Path, offline_hf: None) -> None:
    path = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    cfg = OmegaConf.create(
        _cfg(
            "stream",
            "hub",
            hf_path="json",
            data_files=[str(path)],
            split="train",
            streaming=True,
            max_documents=2,
        )
    )
    validate(cfg)
    assert load_text(cfg) == "The first document.\n\nThe second document."


def test_hub_missing_column_names_the_columns(tmp_path: Path, offline_hf: None) -> None:
    _write_jsonl(tmp_path / "local" / "test.jsonl", DOCS, field="body")
    cfg = _cfg("local", "hub", hf_path=str(tmp_path / "local"), split="test")
    with pytest.raises(DatasetLoadError, match=r"^dataset 'local': .*no column 'text' \(columns: id, body\)"):
        load_text(cfg)


@pytest.mark.parametrize("hf_path", ["{tmp}/does-not-exist", "kvbench-tests/no-such-dataset"])
def test_unloadable_hub_dataset_raises_and_never_falls_back(
    tmp_path: Path, offline_hf: None, hf_path: str
) -> None:
    cfg = _cfg("ghost", "hub", hf_path=hf_path.format(tmp=tmp_path), split="test")
    validate(cfg)  # the config is well formed; only loading can tell
    with pytest.raises(DatasetLoadError, match=r"^dataset 'ghost': hub dataset .*network access") as info:
        load_text(cfg)
    assert info.value.__cause__ is not None
    assert "\n" not in str(info.value)


def test_unknown_source_is_an_error() -> None:
    with pytest.raises(DatasetLoadError, match=r"^dataset 'odd': unknown source 'web'"):
        load_text(_cfg("odd", "web"))


# validate


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"source": "pydocs"}, r"dataset.source='pydocs': unknown source.*did you mean 'pydoc'"),
        ({"max_documents": 0}, r"dataset.max_documents=0: must be null or an integer >= 1"),
        ({"max_documents": "5"}, r"dataset.max_documents='5'"),
        ({"field": ""}, r"dataset.field='': must be a non-empty"),
        ({"path": None}, r"dataset.path=None: required for source 'text_file'"),
        ({"name": ""}, r"dataset.name='': must be a non-empty string"),
    ],
)
def test_validate_rejects_bad_values(tmp_path: Path, overrides: dict[str, Any], message: str) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("text", encoding="utf-8")
    cfg = _cfg("mine", "text_file", path=str(path))
    cfg.update(overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_validate_rejects_hub_without_split() -> None:
    with pytest.raises(ConfigError, match=r"dataset.split=None: must be a non-empty string for source 'hub'"):
        validate(_cfg("h", "hub", hf_path="wikitext"))


# shipped configs


@pytest.mark.parametrize("stem", SHIPPED)
def test_shipped_config_validates(stem: str, tmp_path: Path) -> None:
    yaml_path = CONF_DIR / f"{stem}.yaml"
    assert yaml_path.read_text(encoding="utf-8").startswith("#")
    assert f"python -m kvbench dataset={stem}" in yaml_path.read_text(encoding="utf-8")
    cfg = OmegaConf.load(yaml_path)
    assert cfg.name == stem
    assert all(key in cfg for key in PROTOCOL_KEYS) and cfg.task == "perplexity"
    assert cfg.joiner == "\n\n"
    if stem == "text_file":
        with pytest.raises(ConfigError, match=r"dataset.path=None: required"):
            validate(cfg)  # `path: ???` until the user supplies one
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("Some text.", encoding="utf-8")
        cfg.path = str(corpus)
    validate(cfg)


def test_pydoc_config_loads_the_pydoc_corpus() -> None:
    cfg = OmegaConf.load(CONF_DIR / "pydoc.yaml")
    assert load_text(cfg) == load_text(_cfg("pydoc", "pydoc"))
