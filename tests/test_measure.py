"""Timing, memory and placement over every device a model uses, checked on the CPU with
torch.cuda's calls recorded in place of a GPU's."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from tests.test_cli import ROOT

from conftest import tiny_cfg
from helpers import make_stack
from kvbench import config, models, run
from kvbench.codec import ByteCodec
from kvbench.compressors.quantized import QuantizedCompressor
from kvbench.errors import ConfigError
from kvbench.eval import loop, measure

CUDA = [torch.device("cuda:0"), torch.device("cuda:1")]


def test_a_timed_region_waits_for_every_device(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    times: list[float] = []
    with measure.timed([*CUDA, torch.device("cpu")], times):
        waited.append("body")
    assert waited == [*CUDA, "body", *CUDA] and len(times) == 1


def test_peaks_are_reset_and_read_on_each_device(monkeypatch):
    reset = []
    allocated = {"cuda:0": 3 * 2**20, "cuda:1": 5 * 2**20}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: reset.append(str(d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: allocated[str(d)])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 2 * allocated[str(d)])
    measure.reset_peak(CUDA)
    assert reset == ["cuda:0", "cuda:1"]
    got = measure.memory(CUDA, {"cuda:0": 2**20, "cuda:1": 2 * 2**20})
    assert got == {
        "cuda:0": {"peak_allocated_mb": 3.0, "peak_reserved_mb": 6.0, "weights_mb": 1.0},
        "cuda:1": {"peak_allocated_mb": 5.0, "peak_reserved_mb": 10.0, "weights_mb": 2.0},
    }
    assert measure.peak_mb(CUDA) == 8.0  # each device's own peak, summed


def test_weights_are_counted_per_device(tiny):
    params = sum(p.numel() * p.element_size() for p in tiny.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in tiny.model.buffers())
    assert tiny.devices == [torch.device("cpu")]
    assert tiny.weight_bytes == {"cpu": params + buffers}


def test_a_process_warms_each_model_up_once_before_any_timed_pass(tmp_path, monkeypatch):
    """The first timed region of a job comes after an untimed forward; a second cell of the same
    model runs no warm-up again. The record has each device's memory and its weights."""
    events: list[str] = []
    real_timed = measure.timed

    def timed(devices, out):
        events.append("timed")
        return real_timed(devices, out)

    monkeypatch.setattr(measure, "timed", timed)
    monkeypatch.setattr(loop, "_WARM", type(loop._WARM)())
    config.register()
    overrides = ["model=tiny_random", "dataset=pydoc", "dataset.windows=1", "name=warm"]
    lm = None
    for n, extra in enumerate([[], ["scheduler=h2o", "budget=0.5"]]):
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[*overrides, f"results_dir={tmp_path / str(n)}", *extra])
        lm = models.load(cfg.model, cfg.device)
        hook = lm.model.register_forward_pre_hook(lambda *_: events.append("forward"))
        try:
            record = run.run(cfg)
        finally:
            hook.remove()
        assert record["status"] == "done", record.get("error")
        assert record["metrics"]["kv_resident_mb_peak"] > record["metrics"]["kv_mem_mb_peak"] > 0
        memory = record["metrics"]["memory"]
        assert list(memory) == ["cpu"] and memory["cpu"]["weights_mb"] == lm.weight_bytes["cpu"] / 2**20
        assert memory["cpu"]["peak_rss_mb"] is None or memory["cpu"]["peak_rss_mb"] > 0
        # the cache's peaks on its device: on one device, the record's totals
        assert memory["cpu"]["kv_resident_peak_mb"] == record["metrics"]["kv_resident_mb_peak"]
        assert memory["cpu"]["kv_stored_peak_mb"] == record["metrics"]["kv_mem_mb_peak"]
        if n == 0:
            assert events[:2] == ["forward", "forward"] and "timed" in events  # prefill, one step
            first = events.index("timed")
            assert events[:first].count("forward") == 2
        else:
            assert events[0] == "timed"  # no second warm-up
        events.clear()


def test_offloaded_layers_are_refused_in_one_line():
    """Under CPU or disk offload a layer's weights are on 'meta' between forwards: no device for its
    cache. Refused at load, naming the layers and the key."""
    cfg = tiny_cfg("llama", num_hidden_layers=4)
    model = models._tiny(cfg, torch.float32)
    for layer in model.get_decoder().layers[2:]:
        layer.to("meta")
    with pytest.raises(
        ConfigError, match=r"^model.device_map=None \(model=tiny_llama_6\): layers 2-3 are offloaded"
    ) as err:
        models._wrap(cfg, model, ByteCodec())
    assert "\n" not in str(err.value)


def test_resident_bytes_count_every_tensor_the_cache_holds(tiny):
    """Resident bytes are the stores' fields at their capacity (an independent count here), plus
    the KV-hit shadow's keys; a quantized cache holds more than it stores (its joined, dequantized
    view)."""
    ids = list(range(100))
    cache = loop.new_cache(tiny, make_stack(tiny))
    loop.step(tiny, cache, ids)
    fields = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for store in cache.stores
        for seg in store.segments
        for t in seg.rows.fields.values()
    }
    h, n = tiny.kv_heads, len(ids)
    # besides the fields: per layer, the valid mask of its full rows (a bool a slot of capacity);
    # once, the step's positions and counts of tokens seen, which the layers share
    bookkeeping = sum(h * store.fp.rows.capacity for store in cache.stores) + 8 * n + 8
    assert cache.resident_bytes() == sum(fields.values()) + bookkeeping > cache.nbytes()
    shadowed = loop.new_cache(tiny, make_stack(tiny), shadow=True)
    loop.step(tiny, shadowed, ids)
    keys = tiny.num_layers * tiny.kv_heads * len(ids) * tiny.head_dim * 4  # fp32 keys
    assert shadowed.resident_bytes() == cache.resident_bytes() + keys
    quantized = make_stack(tiny, compressor=QuantizedCompressor(bits=2, group_size=16), sinks=2, window=8)
    cache = loop.new_cache(tiny, quantized)
    loop.step(tiny, cache, ids)
    cache.stores[0].view()
    assert cache.resident_bytes() > 2 * cache.nbytes()
