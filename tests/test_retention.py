"""Retention maps: per layer and KV head, the share of the context and of the needle still stored."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from tests.test_cli import ROOT
from tests.test_wandb import NEEDLE

from kvbench import config, run
from kvbench.codec import ByteCodec
from kvbench.eval.retention import needle_span
from kvbench.report.__main__ import write_report

config.register()


def _cell(tmp, *extra):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*NEEDLE, f"results_dir={tmp}", "name=ret", *extra])
    return run.execute(cfg).record


def test_needle_span_finds_the_needle_tokens():
    codec = ByteCodec()
    head = codec.encode("abc def. The secret code for Oslo is 4242. ghi")
    span = needle_span(head, codec.encode("The secret code for Oslo is 4242."))
    assert span is not None
    assert codec.decode([head[i] for i in span]) == "The secret code for Oslo is 4242."
    assert needle_span(head, codec.encode("Not in there at all.")) is None


def test_full_cache_keeps_everything_and_a_tight_budget_keeps_its_share(tmp_path):
    full = _cell(tmp_path)
    h2o = _cell(tmp_path, "scheduler=h2o", "budget=0.25")
    for case in full["examples"]:
        assert {v for row in case["kept_by_layer_head"] for v in row} == {1.0}
        assert {v for row in case["needle_kept_by_layer_head"] for v in row} == {1.0}
    for case in h2o["examples"]:
        kept = [v for row in case["kept_by_layer_head"] for v in row]
        assert (
            len(case["kept_by_layer_head"]) == 2 and len(case["kept_by_layer_head"][0]) == 2
        )  # layers x heads
        assert all(0.2 <= v <= 0.3 for v in kept), kept  # the budget, sinks and window inside it
        needle = [v for row in case["needle_kept_by_layer_head"] for v in row]
        assert all(0.0 <= v <= 1.0 for v in needle) and min(needle) < 1.0
    path = write_report(tmp_path / "ret")
    assert path is not None and "Retention maps (layer x KV head" in path.read_text()
    maps = list((tmp_path / "ret").glob("retention-*.png"))
    assert len(maps) == 2 and all(p.stat().st_size > 10_000 for p in maps)
