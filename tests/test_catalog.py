"""Every technique YAML of every role, on a tiny 3-layer model with the 9/3 GQA split.

For each: it runs alone and in a double and a triple stack (or the triple is refused with the
reason, for read selectors beside a router); its output differs from the full cache when the
budget is tight, and equals it at budget 1 where that is lossless (and at any budget for a
lossless placement such as flexgen, whose action is tested through its tier figures); a padded batch of two
sequences of different lengths gives the same logits as running them one by one.
Each technique's own invariant and byte count are tested in its family's test file.

The catalog docs (docs/techniques.md and README.md's option table) are generated from the YAMLs
and must be current; a technique's name, its YAML's file stem, is the same in its ``name:`` and its
class's default.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import get_class

from conftest import tiny_cfg
from helpers import budget_of, padded_batch_vs_solo, tokens
from kvbench import config, models
from kvbench.cache import engine
from kvbench.errors import ConfigError
from kvbench.eval import loop, stepcost
from kvbench.roles import BindContext
from kvbench.stack import Stack, build_technique, chain_stages

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ROLES = ("router", "compressor", "scheduler")
OPTIONS = [
    (role, p.stem)
    for role in ROLES
    for p in sorted((CONF / role).glob("*.yaml"))
    if p.stem not in ("none", "chain")
]
PARTNERS = {"router": "base", "compressor": "quantized", "scheduler": "h2o"}
TIGHT = dict(budget=0.25, sinks=2, window=8)
PREFILL, CHUNKS = 56, [4, 4, 1, 1]
# Representation compressors are lossy at any budget; routers read a subset at any budget.
LOSSY_AT_ONE = {"router"}


@pytest.fixture(scope="module")
def lm():
    return models.load(tiny_cfg("llama", heads=9, num_key_value_heads=3, num_hidden_layers=3), "cpu")


@pytest.fixture(scope="module", autouse=True)
def _env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("KVBENCH_CACHE", str(tmp_path_factory.mktemp("kvcache")))  # calibrations of the tiny model
    config.register()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        yield
    mp.undo()


# Knobs sized for the tiny model (3 layers, head_dim 16), from the YAML's ``# tiny: k=v ...`` comment
# line (after its keys, so that docs/techniques.md leaves it out); the YAML's defaults where none.
TINY_KNOBS = {
    f"{role}/{option}": knobs
    for role, option in OPTIONS
    if (knobs := stepcost.tiny_knobs(f"{role}/{option}"))
}


def technique(role: str, option: str, **knobs):
    extra = [*TINY_KNOBS.get(f"{role}/{option}", []), *(f"{role}.{k}={v}" for k, v in knobs.items())]
    cfg = compose("config", overrides=[f"{role}={option}", *extra])
    return build_technique(cfg[role], role)


def stack_of(lm, parts: dict, **budget) -> Stack:
    stack = Stack(**parts, budget=budget_of(**budget))
    stack.bind(BindContext.for_model(lm))
    return stack


def run(lm, stack, ids):
    cache = loop.new_cache(lm, stack)
    outs = [loop.step(lm, cache, ids[:PREFILL])]
    at = PREFILL
    for n in CHUNKS:
        outs.append(loop.step(lm, cache, ids[at : at + n]))
        at += n
    return torch.cat(outs), cache


@pytest.fixture(scope="module")
def ids():
    return tokens(PREFILL + sum(CHUNKS), seed=3)


@pytest.fixture(scope="module")
def full(lm, ids):
    return run(lm, stack_of(lm, {}), ids)[0]


@pytest.mark.parametrize(("role", "option"), OPTIONS)
def test_alone_tight_differs_and_budget_one(lm, ids, full, role, option):
    tech = technique(role, option)
    tight, cache = run(lm, stack_of(lm, {role: tech}, **TIGHT), ids)
    assert torch.isfinite(tight).all()
    if tech.flags.lossless:  # placement (flexgen): it acts on where the cache lives, never on outputs
        torch.testing.assert_close(tight, full, atol=1e-5, rtol=1e-5)
        return
    assert not torch.allclose(tight, full, atol=1e-4), f"{role}/{option} did not act at budget 0.25"
    tech = technique(role, option)
    if role in LOSSY_AT_ONE or tech.flags.changes_representation:
        return
    one, _ = run(lm, stack_of(lm, {role: tech}, budget=1.0, sinks=2, window=8), ids)
    torch.testing.assert_close(one, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("role", "option"), OPTIONS)
def test_double_and_triple(lm, ids, role, option):
    others = [r for r in ROLES if r != role]
    double = {role: technique(role, option), others[-1]: technique(others[-1], PARTNERS[others[-1]])}
    if role == "scheduler":
        double = {role: technique(role, option), "compressor": technique("compressor", "quantized")}
    out, _ = run(lm, stack_of(lm, double, **TIGHT), ids)
    assert torch.isfinite(out).all()
    triple = {r: technique(r, option if r == role else PARTNERS[r]) for r in ROLES}
    selectors = [r for r, t in triple.items() if t.flags.selects_reads]
    if len(selectors) > 1:
        with pytest.raises(ConfigError, match="select reads"):
            stack_of(lm, triple, **TIGHT)
        return
    out, cache = run(lm, stack_of(lm, triple, **TIGHT), ids)
    assert torch.isfinite(out).all() and cache.nbytes() > 0


@pytest.mark.parametrize(("role", "option"), OPTIONS)
def test_padded_batch_equals_one_by_one(lm, role, option):
    def make():
        return stack_of(lm, {role: technique(role, option)}, budget=0.4, sinks=2, window=8)

    padded_batch_vs_solo(lm, make, tokens(60, 1), tokens(41, 2), prefills=(54, 35), chunks=(3, 3))


CHAINS = {
    "[chunkkv,svd]": "[chunkkv,{name:svd,key_rank:4,value_rank:8,block_size:16}]",
    "[pyramidkv,fastv]": "[pyramidkv,{name:fastv,layer:1}]",
    "[lora,distillation]": "[{name:lora,key_rank:4,value_rank:8},distillation]",
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_chains_compose_from_the_command_line(lm, ids, full, chain):
    cfg = compose("config", overrides=["compressor=chain", f"compressor.stages={CHAINS[chain]}"])
    stages = chain_stages(cfg.compressor.stages)[0]
    assert Stack(compressor=stages).names()["compressor"] == f"chain{chain}"
    out, cache = run(lm, stack_of(lm, {"compressor": stages}, **TIGHT), ids)
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, full, atol=1e-4)
    assert cache.nbytes() < cache.reference_bytes() * 2  # fewer bytes than the float32 full cache


def test_two_selection_stages_compose_multiplicatively(lm, ids):
    """pyramidkv then fastv at budget 0.5: fastv, the second selection, keeps at most 0.5² of the
    seen tokens in its layers (>= 1), fewer than pyramidkv alone; layer 0 is pyramidkv's alone."""
    loose = dict(budget=0.5, sinks=2, window=4)
    _, one = run(lm, stack_of(lm, {"compressor": technique("compressor", "pyramidkv")}, **loose), ids)
    stages = CHAINS["[pyramidkv,fastv]"]
    chain = chain_stages(
        compose("config", overrides=["compressor=chain", f"compressor.stages={stages}"]).compressor.stages
    )[0]
    _, two = run(lm, stack_of(lm, {"compressor": chain}, **loose), ids)
    seen = len(ids)
    kept = [two.stores[i].row_tokens() for i in range(3)]
    assert torch.equal(kept[0], one.stores[0].row_tokens())
    assert (kept[1] < one.stores[1].row_tokens()).all()
    assert (kept[1] <= math.ceil(0.5**2 * seen)).all() and (kept[2] <= one.stores[2].row_tokens()).all()


def test_catalog_docs_are_current():
    """docs/techniques.md and README.md's option table are what the YAMLs generate."""
    got = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "catalog_table.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, got.stdout + got.stderr  # names the command that regenerates them


@pytest.mark.parametrize(
    ("role", "option"), [(role, p.stem) for role in ROLES for p in sorted((CONF / role).glob("*.yaml"))]
)
def test_name_is_the_file_stem_everywhere(role, option):
    """The file stem is the name (``<role>=<name>``); the YAML's ``name:`` (what records and reports
    carry) and the class's default ``name`` (a class built without its YAML) repeat it."""
    node = yaml.safe_load((CONF / role / f"{option}.yaml").read_text())
    name = node.get("name")
    assert name == option, f"conf/{role}/{option}.yaml: name: {name!r}, not {option!r}"
    if node.get("_target_") is not None:
        default = {f.name: f.default for f in dataclasses.fields(get_class(node["_target_"]))}["name"]
        assert default == option, f"{node['_target_']}.name defaults to {default!r}, not {option!r}"


@pytest.mark.parametrize(("role", "option"), OPTIONS)
def test_tiny_knobs_are_knobs_below_the_keys(role, option):
    """A ``# tiny:`` line sets only the YAML's own knobs, and sits after its keys (in the leading
    comment it would join the technique's description in the docs)."""
    lines = (CONF / role / f"{option}.yaml").read_text().splitlines()
    knobs = set(yaml.safe_load("\n".join(lines))) - {"_target_", "name"}
    first_key = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    for i, line in enumerate(lines):
        if line.startswith("# tiny:"):
            assert i > first_key, f"conf/{role}/{option}.yaml: put '# tiny:' after the keys"
            for kv in line.removeprefix("# tiny:").split():
                key, sep, _ = kv.partition("=")
                assert sep and key in knobs, f"conf/{role}/{option}.yaml: # tiny: {kv!r} is no knob=value"


@pytest.mark.parametrize(
    ("role", "option", "knobs"),
    [(r, o, {}) for r, o in OPTIONS] + [("compressor", "chunkkv", {"reuse_layers": 2})],
)
def test_each_layers_work_stays_on_its_device(lm, ids, role, option, knobs, monkeypatch):
    """With the layers placed on two (fake) devices, no technique reads, in one layer's work, a
    tensor made in the other's: across GPUs (``device_map="auto"``) that read would fail. State
    made at one layer and read at another goes through ``LayerStore.local``; what a cache shares
    between the layers of one device has the device in its key (here the fake one)."""
    from kvbench.cache import devices
    from kvbench.cache.engine import KVCache
    from kvbench.cache.store import LayerStore
    from tracking import LayerDevices

    seen = LayerDevices(split=1)

    def at_layer(method, where):
        def wrapped(*a, **k):
            with seen.at(where(a)):
                return method(*a, **k)

        return wrapped

    monkeypatch.setattr(KVCache, "update", at_layer(KVCache.update, lambda a: a[3]))
    monkeypatch.setattr(KVCache, "attend", at_layer(KVCache.attend, lambda a: a[1]))
    monkeypatch.setattr(Stack, "apply", at_layer(Stack.apply, lambda a: a[1]))

    def local(self, x):
        with seen.moving():
            return x.clone()

    real_key = LayerStore.position_key

    def position_key(self, qpos):  # it names the device; the fake devices are one CPU
        key = real_key(self, qpos)
        return None if key is None else (*key, seen.device(seen.layer))

    monkeypatch.setattr(LayerStore, "local", local)
    monkeypatch.setattr(LayerStore, "position_key", position_key)
    monkeypatch.setattr(devices, "device_of", lambda t: seen.device(seen.layer))  # memos of angles, ids
    stack = stack_of(lm, {role: technique(role, option, **knobs)}, **TIGHT)
    with seen:
        run(lm, stack, ids)
        stack.metrics()
    assert not seen.mixed, seen.mixed[:3]


# Host synchronisations per layer per decode step, the bounds (the full cache's is 0)
SYNCS_FULL, SYNCS_ANY = 2, 6


def decode_syncs(lm, stack, ids, steps: int = 8) -> float:
    """Host synchronisations per layer per decode step, after a prefill and two chunks."""
    from tracking import HostSyncs

    cache = loop.new_cache(lm, stack)
    at = PREFILL + 8
    loop.step(lm, cache, ids[:PREFILL])
    loop.step(lm, cache, ids[PREFILL:at])
    with HostSyncs() as syncs:
        for i in range(steps):
            loop.step(lm, cache, ids[at + i % 2 : at + i % 2 + 1])
        stack.metrics()  # what a technique defers to its metrics is counted too, once
    return syncs.count / (lm.num_layers * steps)


def test_full_cache_decode_step_syncs_the_host_at_most_twice_per_layer(lm, ids):
    assert decode_syncs(lm, stack_of(lm, {}), ids) <= SYNCS_FULL


@pytest.mark.parametrize(("role", "option"), OPTIONS)
def test_decode_step_syncs_the_host_at_most_six_times_per_layer(lm, ids, role, option):
    """Found: 22 (the full cache) to 82 (eplb) per layer per decode step, each a wait for the GPU
    (``int(lens.max())``, ``bool(...)``, ``.tolist()``, boolean indexing); at 32 layers, hundreds
    to thousands per generated token. Counted through torch's dispatch hooks (tests/tracking.py)."""
    stack = stack_of(lm, {role: technique(role, option)}, **TIGHT)
    assert decode_syncs(lm, stack, ids) <= SYNCS_ANY


@pytest.mark.parametrize(("role", "option"), OPTIONS)
def test_a_finished_cache_is_freed_without_the_garbage_collector(lm, ids, role, option):
    """Found on an H200 (gpu_check's memory part, 8B shapes at 32k): every technique's peak grew by
    one cache (5 GB) over the one before, as each finished cache waited in a reference cycle (a view
    holding its store; the engine's active cache) for the garbage collector. The cache and each of
    its stores must go when their last reference does."""
    stack = stack_of(lm, {role: technique(role, option)}, **TIGHT)
    gc.collect()
    gc.disable()
    try:
        cache = run(lm, stack, ids)[1]
        refs = [weakref.ref(cache), *(weakref.ref(s) for s in cache.stores)]
        del cache
        alive = [type(r()).__name__ for r in refs if r() is not None]
    finally:
        gc.enable()
    assert engine._ACTIVE.get() is None
    assert not alive, f"{role}={option}: kept by a reference cycle: {alive}"
