"""dataset.batch_size: a protocol's examples run at once through the padded-batch path and give
what they give one at a time (float tolerance), per example and per cell."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from tests.test_cli import ROOT

from kvbench import config, run
from kvbench.errors import ConfigError

NEEDLE = [
    "model=tiny_random",
    "dataset=needle",
    "dataset.lengths=[90,140,200]",
    "dataset.depths=[0.2,0.8]",
    "dataset.offsets=1",
    "dataset.max_new_tokens=5",
    "window=8",
    "sinks=2",
    "name=batch",
]


def cell(tmp, *extra, base=NEEDLE):
    config.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*base, f"results_dir={tmp}", *extra])


@pytest.mark.parametrize(
    "stack", [[], ["scheduler=h2o", "budget=0.5"], ["compressor=snapkv", "router=base", "scheduler=adakv"]]
)
def test_needle_batch_equals_one_by_one(tmp_path, stack):
    one = run.run(cell(tmp_path / "1", *stack))
    four = run.run(cell(tmp_path / "4", *stack, "dataset.batch_size=4"))
    assert one["status"] == four["status"] == "done", (one["error"], four["error"])
    keys = ("answer", "context_tokens", "kept_by_layer_head")
    assert [[e[k] for k in keys] for e in one["examples"]] == [[e[k] for k in keys] for e in four["examples"]]
    assert [e["batch"] for e in four["examples"]] == [0, 0, 0, 0, 1, 1]
    for key in ("compression_prefill", "compression_mean", "kv_mem_mb_prefill"):
        assert one["metrics"][key] == pytest.approx(four["metrics"][key], rel=1e-9), key
    assert one["metrics"]["score"] == four["metrics"]["score"]
    assert one["cell_id"] != four["cell_id"]  # batching is part of the identity (float tolerance)


def test_batch_size_one_keeps_the_cell_ids_of_before(tmp_path):
    """Cells planned before batching existed had no dataset.batch_size: theirs stay the same."""
    ident = run.plan(cell(tmp_path)).ident
    assert "batch_size" not in ident["dataset"]


def test_perplexity_refuses_batches_it_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="dataset.batch_size=2: perplexity runs one window at a time"):
        config.validate(cell(tmp_path, "dataset.batch_size=2", base=["model=tiny_random", "dataset=pydoc"]))
