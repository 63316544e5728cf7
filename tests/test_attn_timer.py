"""Decode attention per layer per step (kvbench.cache.timing, issue 29): the timer's arithmetic
with a fake clock and fake CUDA events, where the engine opens its regions, that it adds nothing
when off and no operation when on, and the metric in a cell's record."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from tests.test_cli import ROOT

from helpers import make_stack, tokens
from kvbench import config, models, run
from kvbench.cache import timing
from kvbench.eval import loop, stepcost

CUDA = torch.device("cuda:0")
CPU = torch.device("cpu")


class FakeEvent:
    """A CUDA event read from a fake clock; ``synchronize`` is noted, as reading it must wait."""

    def __init__(self, now: float, log: list[str]):
        self.now, self.log = now, log

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.now - self.now) * 1000.0  # ms, as torch.cuda.Event's


class Clock:
    """A clock that moves by ``tick`` seconds at each read."""

    def __init__(self, tick: float):
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def _step(timer: timing.AttnTimer, device: torch.device, layers: int) -> None:
    """One decode step's regions as the engine opens them: attend, then the stack's work, per layer."""
    if not timer.sample(layers):
        return
    for _ in range(2 * layers):
        timer.stop(device, timer.start(device))


def test_cuda_events_are_read_at_the_end_of_the_cell_only():
    log: list[str] = []
    clock = Clock(0.002)  # each event 2 ms after the one before
    timer = timing.AttnTimer(every=2, event=lambda device: FakeEvent(clock(), log))
    for _ in range(5):  # steps 1, 3 and 5 are sampled
        _step(timer, CUDA, layers=4)
    assert timer.steps == 5 and timer.sampled == 3 and len(timer.pending) == 3 * 8
    assert log == []  # nothing waited for during the steps
    got = timer.metrics()
    assert log == ["synchronize"] * 24 and timer.pending == []
    # 8 regions of 2 ms per step, over 4 layers: 4 ms per layer per step
    assert got == {"decode_attn_ms": pytest.approx(4.0), "decode_attn_steps": 3}


def test_past_the_pending_bound_events_are_read_between_steps(monkeypatch):
    log: list[str] = []
    clock = Clock(0.001)
    monkeypatch.setattr(timing, "PENDING", 32)  # 16 pairs: two steps of 8 regions
    timer = timing.AttnTimer(every=1, event=lambda device: FakeEvent(clock(), log))
    _step(timer, CUDA, layers=4)
    _step(timer, CUDA, layers=4)
    assert log == [] and len(timer.pending) == 16
    _step(timer, CUDA, layers=4)  # read before this step's regions open
    assert log == ["synchronize"] * 16 and len(timer.pending) == 8
    assert timer.metrics()["decode_attn_ms"] == pytest.approx(2.0)


def test_cpu_regions_are_timed_by_the_clock():
    timer = timing.AttnTimer(every=3, clock=Clock(0.0005))
    for _ in range(7):  # steps 1, 4 and 7
        _step(timer, CPU, layers=2)
    # each region: two reads 0.5 ms apart; 4 regions per step over 2 layers: 1 ms per layer per step
    assert timer.metrics() == {"decode_attn_ms": pytest.approx(1.0), "decode_attn_steps": 3}


def test_no_sampled_step_or_an_untimed_device_is_null_not_zero():
    assert timing.AttnTimer().metrics() == {"decode_attn_ms": None, "decode_attn_steps": 0}
    timer = timing.AttnTimer(every=1)
    _step(timer, torch.device("mps"), layers=2)
    assert timer.metrics() == {"decode_attn_ms": None, "decode_attn_steps": 1}
    with pytest.raises(ValueError, match="every=0"):
        timing.AttnTimer(every=0)


def test_the_engine_times_attend_and_the_stacks_work_of_every_layer_on_sampled_steps(tiny, monkeypatch):
    """Regions per sampled step: one around each layer's attention and one around each layer's
    stack work; steps not sampled, prefills and steps outside a cell open none."""
    stack = make_stack(tiny)
    regions: list[torch.device] = []
    start = timing.AttnTimer.start

    def noting(self, device):
        regions.append(device)
        return start(self, device)

    monkeypatch.setattr(timing.AttnTimer, "start", noting)
    cache = loop.new_cache(tiny, stack)
    logits = loop.step(tiny, cache, tokens(40), [], keep=1)
    loop.greedy(tiny, cache, logits[-1], 4, [])  # outside a cell: nothing timed
    assert regions == [] and cache.timer is None
    with timing.cell(every=2) as timer:
        cache = loop.new_cache(tiny, stack)
        logits = loop.step(tiny, cache, tokens(40), [], keep=1)  # a prefill: not a decode step
        assert regions == []
        loop.greedy(tiny, cache, logits[-1], 6, [])  # 5 decode steps: 1, 3 and 5 sampled
    assert cache.timer is None  # held only while a sampled step runs
    assert timer.steps == 5 and timer.sampled == 3 and timer.layer_steps == 3 * tiny.num_layers
    assert regions == [CPU] * (3 * 2 * tiny.num_layers)
    assert timer.metrics()["decode_attn_ms"] > 0


def test_a_sampled_step_launches_nothing_more(tiny):
    """The timer adds no aten operation to a step (tests/test_step_cost.py counts untimed steps)."""
    stack = make_stack(tiny)

    def run_steps(steps: int, counter: stepcost.LaunchCounter) -> None:
        cache = loop.new_cache(tiny, stack)
        tok = int(loop.step(tiny, cache, tokens(40), keep=1)[-1].argmax())
        with counter:
            for _ in range(steps):
                tok = int(loop.step(tiny, cache, [tok], [], decode=True)[-1].argmax())

    off = stepcost.decode_cost(run_steps, tiny.num_layers)
    with timing.cell(every=1) as timer:
        on = stepcost.decode_cost(run_steps, tiny.num_layers)
    assert timer.sampled == 4 + 20 and on.ops == off.ops and on.syncs == off.syncs


def _cell(tmp, *overrides: str):
    config.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose(
            "config", overrides=["model=tiny_random", "name=attn", f"results_dir={tmp}", *overrides]
        )


NEEDLE = ["dataset=needle", "dataset.lengths=[90,140]", "dataset.depths=[0.5]", "dataset.offsets=1"]
NEEDLE += ["dataset.max_new_tokens=6", "window=8", "sinks=2"]
PYDOC = ["dataset=pydoc", "dataset.windows=2", "dataset.prefill=64", "dataset.chunks_per_window=1"]


@pytest.mark.parametrize(
    "overrides",
    [
        NEEDLE,
        [*NEEDLE, "scheduler=h2o", "budget=0.5", "dataset.batch_size=2"],
        [*PYDOC, "compressor=quantized"],
    ],
    ids=["needle", "needle-batched-h2o", "perplexity-quantized"],
)
def test_a_cell_records_its_decode_attention_beside_tpot(tmp_path, overrides):
    record = run.run(_cell(tmp_path, *overrides))
    assert record["status"] == "done", record["error"]
    m = record["metrics"]
    assert m["decode_attn_steps"] >= 1 and m["decode_attn_ms"] > 0
    # a part of the sampled steps, which are one in EVERY of the steps TPOT averages: their layers'
    # sum is under EVERY mean steps
    assert m["decode_attn_ms"] * record["model"]["layers"] < timing.EVERY * m["tpot_s"] * 1000
    assert "decode_attn" not in str(record["identity"])  # the timer changes no number: not identity


def test_a_cell_without_decode_steps_records_null(tmp_path):
    record = run.run(_cell(tmp_path, *PYDOC, "dataset.decode_steps=0"))
    assert record["status"] == "done", record["error"]
    assert record["metrics"]["tpot_s"] is None
    assert record["metrics"]["decode_attn_ms"] is None and record["metrics"]["decode_attn_steps"] == 0


@pytest.mark.gpu
def test_cuda_events_time_a_decode_step_on_a_gpu():
    lm = models.load(stepcost.model_config(stepcost.LAUNCH_MODEL), "cuda")
    stack = make_stack(lm)
    times: list[float] = []
    with timing.cell(every=1) as timer:
        cache = loop.new_cache(lm, stack)
        logits = loop.step(lm, cache, tokens(256), [], keep=1)
        loop.greedy(lm, cache, logits[-1], 9, times)
        assert len(timer.pending) == 8 * 2 * lm.num_layers  # unread until the cell ends
    got = timer.metrics()
    assert got["decode_attn_steps"] == 8
    assert 0 < got["decode_attn_ms"] * lm.num_layers < sum(times) / len(times) * 1000
