"""Cell identity and atomic result records (kvbench.results)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest

from kvbench import cellstate
from kvbench.results import (
    cell_hash,
    load_records,
    read_record,
    record_path,
    write_record,
)

IDENTITY = {
    "model": {"name": "smollm2_135m", "dtype": "float32", "attn": "kvbench"},
    "compressor": {"_target_": "kvbench.compressors.quantized.QuantizedCompressor", "bits": 2},
    "scheduler": {"name": "h2o", "budget": 0.5, "sinks": 4},
    "dataset": {"name": "pydoc", "lengths": [512, 1024]},
    "seed": 0,
    "flag": True,
    "nothing": None,
}


def _record(experiment: str, cell_id: str, status: str = "done") -> dict:
    return {
        "experiment": experiment,
        "cell_id": cell_id,
        "status": status,
        "error": None if status == "done" else "boom",
        "metrics": {"kl": 0.01, "score": {"name": "perplexity", "value": 12.5}},
        "per_layer_bytes": [1, 2],
    }


def test_cell_hash_matches_hand_built_canonical_json() -> None:
    identity = {"b": 1, "a": [1.5, "é", None, True], "c": {"z": 0.1, "y": 1e-07}}
    canonical = '{"a":[1.5,"é",null,true],"b":1,"c":{"y":1e-07,"z":0.1}}'
    expected = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
    assert cell_hash(identity) == expected
    assert len(expected) == 16


def test_cell_hash_is_stable_and_ignores_key_order() -> None:
    shuffled = {key: IDENTITY[key] for key in reversed(IDENTITY)}
    shuffled["scheduler"] = {"sinks": 4, "budget": 0.5, "name": "h2o"}
    assert cell_hash(IDENTITY) == cell_hash(copy.deepcopy(IDENTITY)) == cell_hash(shuffled)


@pytest.mark.parametrize(
    "path, value",
    [
        (("model", "dtype"), "bfloat16"),
        (("model", "attn"), "sdpa"),
        (("compressor", "bits"), 4),
        (("scheduler", "budget"), 0.25),
        (("scheduler", "name"), "streaming_llm"),
        (("dataset", "lengths"), [1024, 512]),
        (("seed",), 1),
        (("flag",), False),
        (("nothing",), 0),
    ],
)
def test_cell_hash_changes_with_any_value(path: tuple[str, ...], value: object) -> None:
    changed = copy.deepcopy(IDENTITY)
    target = changed
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert cell_hash(changed) != cell_hash(IDENTITY)


@pytest.mark.parametrize("bad", [{"a": (1, 2)}, {"a": {1, 2}}, {"a": object()}, {1: "x"}, [1, 2]])
def test_cell_hash_rejects_non_json_types(bad: object) -> None:
    with pytest.raises(TypeError):
        cell_hash(bad)  # type: ignore[arg-type]


def test_record_path_layout_and_relative_dir(tmp_path: Path) -> None:
    assert record_path(tmp_path, "default", "a1b2") == tmp_path / "default" / "a1b2.json"
    assert record_path(str(tmp_path), "default", "a1b2") == tmp_path / "default" / "a1b2.json"
    with pytest.raises(ValueError, match="absolute"):
        record_path("results", "default", "a1b2")
    with pytest.raises(ValueError, match="experiment"):
        record_path(tmp_path, "../escape", "a1b2")


def test_write_record_round_trips(tmp_path: Path) -> None:
    path = record_path(tmp_path, "exp", "c1")
    write_record(path, _record("exp", "c1"))
    assert read_record(path) == _record("exp", "c1")
    assert json.loads(path.read_text()) == _record("exp", "c1")
    assert [p.name for p in path.parent.iterdir()] == ["c1.json"]


def test_write_record_is_atomic_when_replace_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = record_path(tmp_path, "exp", "c1")

    def failing_replace(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_record(path, _record("exp", "c1"))
    assert list(tmp_path.rglob("*.json")) == []
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_failed_replace_keeps_the_old_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = record_path(tmp_path, "exp", "c1")
    write_record(path, _record("exp", "c1", status="failed"))
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        write_record(path, _record("exp", "c1"))
    assert read_record(path) == _record("exp", "c1", status="failed")
    assert [p.name for p in path.parent.iterdir()] == ["c1.json"]


@pytest.mark.parametrize(
    "where, value",
    [(("metrics", "kl"), float("nan")), (("metrics", "score", "value"), float("inf"))],
)
def test_write_record_rejects_non_finite_naming_the_key(
    tmp_path: Path, where: tuple[str, ...], value: float
) -> None:
    record = _record("exp", "c1")
    target = record
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    with pytest.raises(ValueError, match=r"\.".join(where)):
        write_record(tmp_path / "c1.json", record)
    assert not (tmp_path / "c1.json").exists()


def test_write_record_names_a_list_index(tmp_path: Path) -> None:
    record = _record("exp", "c1")
    record["per_layer_bytes"] = [1, float("-inf")]
    with pytest.raises(ValueError, match=r"per_layer_bytes\[1\]"):
        write_record(tmp_path / "c1.json", record)


def test_read_record_missing_or_broken(tmp_path: Path) -> None:
    assert read_record(tmp_path / "missing.json") is None
    (tmp_path / "broken.json").write_text('{"cell_id": "x", "stat')
    assert read_record(tmp_path / "broken.json") is None
    (tmp_path / "list.json").write_text("[1, 2]")
    assert read_record(tmp_path / "list.json") is None


def test_cell_state_and_whether_it_runs(tmp_path: Path) -> None:
    done, failed = record_path(tmp_path, "exp", "d"), record_path(tmp_path, "exp", "f")
    write_record(done, _record("exp", "d"))
    write_record(failed, _record("exp", "f", status="failed"))
    missing, killed = record_path(tmp_path, "exp", "missing"), record_path(tmp_path, "exp", "k")
    cellstate.begin(killed)
    states = {p.stem: cellstate.status(read_record(p), p) for p in (done, failed, missing, killed)}
    assert states == {"d": "done", "f": "failed", "missing": "pending", "k": "interrupted"}
    runs = lambda state, **kw: cellstate.needs_run(state, **{"force": False, "retry_failed": False, **kw})
    assert [runs(s) for s in ("done", "failed", "pending", "interrupted")] == [False, False, True, True]
    assert runs("failed", retry_failed=True) and not runs("done", retry_failed=True)
    assert runs("done", force=True)


def test_load_records_sorts_and_skips_temp_and_broken_files(tmp_path: Path) -> None:
    for experiment, cell_id in [("b", "01"), ("a", "ff"), ("a", "0a")]:
        write_record(record_path(tmp_path, experiment, cell_id), _record(experiment, cell_id))
    (tmp_path / "a" / ".0b.json.tmp-4242").write_text('{"cell_id": "0b", "experi')
    (tmp_path / "a" / ".hidden.json").write_text(json.dumps(_record("a", "00")))
    (tmp_path / "a" / "broken.json").write_text("{")
    (tmp_path / "a" / "not_a_record.json").write_text('{"wandb": 1}')
    (tmp_path / "REPORT.md").write_text("# old report\n")
    records = load_records(tmp_path)
    assert [(r["experiment"], r["cell_id"]) for r in records] == [("a", "0a"), ("a", "ff"), ("b", "01")]
    assert load_records(tmp_path / "missing") == []
