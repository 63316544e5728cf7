"""dataset.batch_size: a protocol's examples run at once through the padded-batch path and give
what they give one at a time (float tolerance), per example and per cell."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tests.test_cli import ROOT

from helpers import make_stack, tokens
from kvbench import config, run
from kvbench.compressors.quantized import QuantizedCompressor
from kvbench.errors import ConfigError
from kvbench.eval import perplexity
from kvbench.schedulers.h2o import H2OScheduler
from kvbench.schedulers.streaming_llm import StreamingLLMScheduler

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


PERPLEXITY = dict(name="t", prefill=40, chunk=8, chunks_per_window=3, windows=4, decode_steps=3)
STACKS = {
    "none": {},
    "streaming_llm": dict(scheduler=StreamingLLMScheduler(), budget=0.5, sinks=2, window=8),
    "h2o": dict(scheduler=H2OScheduler(), budget=0.5, sinks=2, window=8),
    "quantized": dict(compressor=QuantizedCompressor(bits=2, group_size=8), sinks=2, window=8),
}


def perplexity_at(lm, parts, batch_size, baseline=None):
    cfg = OmegaConf.create({**PERPLEXITY, "batch_size": batch_size})
    return perplexity.evaluate(lm, make_stack(lm, **parts), tokens(400), cfg, baseline, keep_logprobs=True)


@pytest.mark.parametrize("name", list(STACKS))
def test_perplexity_batch_equals_one_by_one(tiny, name):
    """4 windows at batch 3 (a batch of 3, then 1) give per window and per cell what batch 1 gives."""
    _, baseline = perplexity_at(tiny, {}, 1)
    one, wins1 = perplexity_at(tiny, STACKS[name], 1, baseline)
    three, wins3 = perplexity_at(tiny, STACKS[name], 3, baseline)
    close = dict(rel=1e-4, abs=1e-6)
    for w1, w3 in zip(wins1, wins3, strict=True):
        assert torch.allclose(w1.nll, w3.nll, rtol=1e-4, atol=1e-6)
        assert w3.chunk_nll == pytest.approx(w1.chunk_nll, **close)
        assert w3.kl == pytest.approx(w1.kl, **close) and w3.top1 == w1.top1
        assert w3.compression_chunks == pytest.approx(w1.compression_chunks, rel=1e-9)
        assert w3.per_layer_prefill == w1.per_layer_prefill
        assert len(w3.tpot) == len(w1.tpot) == PERPLEXITY["decode_steps"]
    assert three.score.value == pytest.approx(one.score.value, rel=1e-4)
    assert (one.kv_hit is None) == (three.kv_hit is None) == (name == "none")  # no probe without a stack
    for key in ("kl", "top1_agreement", "kv_hit", "kv_hit_excl", "delta_nll"):
        if getattr(one, key) is not None:
            assert getattr(three, key) == pytest.approx(getattr(one, key), **close), key
    assert three.extra == pytest.approx(one.extra, rel=1e-4)
    for key in ("compression_prefill", "compression_mean", "kv_mem_mb_prefill"):
        assert getattr(three, key) == pytest.approx(getattr(one, key), rel=1e-9), key
    # the peak is the largest batch's: three windows' bytes at once
    assert three.kv_mem_mb_peak == pytest.approx(3 * one.kv_mem_mb_peak, rel=1e-9)


def test_perplexity_cell_batches(tmp_path):
    """``dataset.batch_size`` reaches the perplexity protocol through the config and the record."""
    base = ["model=tiny_random", "dataset=pydoc", "dataset.prefill=48", "dataset.chunk=8"]
    base += ["dataset.chunks_per_window=2", "dataset.windows=3", "dataset.decode_steps=2", "window=8"]
    base += ["sinks=2", "scheduler=h2o", "budget=0.5", "name=batch"]
    one = run.run(cell(tmp_path / "1", base=base))
    two = run.run(cell(tmp_path / "2", "dataset.batch_size=2", base=base))
    assert one["status"] == two["status"] == "done", (one["error"], two["error"])
    assert [e["chunk_nll"] for e in two["examples"]] == [
        pytest.approx(e["chunk_nll"], rel=1e-4) for e in one["examples"]
    ]
    m1, m2 = one["metrics"], two["metrics"]
    assert m2["score"]["value"] == pytest.approx(m1["score"]["value"], rel=1e-4)
    for key in ("kv_hit", "compression_prefill", "compression_mean", "kv_mem_mb_prefill"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4), key
    assert one["cell_id"] != two["cell_id"]


def test_perplexity_refuses_batch_size_zero(tmp_path):
    with pytest.raises(ConfigError, match="dataset.batch_size=0: must be an integer >= 1"):
        config.validate(cell(tmp_path, "dataset.batch_size=0", base=["model=tiny_random", "dataset=pydoc"]))
