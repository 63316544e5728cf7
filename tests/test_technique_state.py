"""One way to hold a technique's state (issue 31): its knobs are the dataclass's fields, set from
the YAML; what it derives is declared as a field with ``field(init=False)`` and built in
``on_bind``; ``check_knobs`` only checks; and no technique writes its ``__dict__``. Checked on every
technique of the catalog after a prefill and decode steps on a tiny random model. And what
technique code touches of a layer's store is the surface :mod:`kvbench.cache.store` lists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from kvbench import config, models
from kvbench.cache.store import LayerStore
from kvbench.cache.surface import ACTS as surface_acts
from kvbench.cache.surface import READS as surface_reads
from kvbench.eval import loop, stepcost
from kvbench.roles import Technique

SRC = Path(__file__).resolve().parents[1] / "src" / "kvbench"
BOUND = {"ctx", "num_layers"}  # what the base's bind sets on every technique
CATALOG = stepcost.catalog()


@pytest.fixture(scope="module")
def lm():
    config.register()
    spec = {**stepcost.HOST_MODEL, "config": {**stepcost.HOST_MODEL["config"], "num_hidden_layers": 3}}
    return models.load(stepcost.model_config(spec), "cpu")


def techniques(stack) -> list[Technique]:
    return [t for t in stack.pipeline if isinstance(t, Technique)]


@pytest.mark.parametrize("technique", CATALOG)
def test_a_technique_holds_only_its_declared_fields(lm, technique):
    stack = stepcost.technique_stack(lm, technique, 0.5, tiny=True)
    cache = loop.new_cache(lm, stack)
    ids = [3 + i % 250 for i in range(140)]
    loop.step(lm, cache, ids[:128], keep=1)
    for token in ids[128:]:
        loop.step(lm, cache, [token])
    for tech in techniques(stack):
        declared = {f.name for f in dataclasses.fields(tech)} | BOUND
        extra = sorted(set(vars(tech)) - declared)
        assert not extra, f"{technique}: {type(tech).__name__} holds undeclared {extra}"


@pytest.mark.parametrize("technique", CATALOG)
def test_check_knobs_only_checks(lm, technique):
    stack = stepcost.technique_stack(lm, technique, 0.5, tiny=True)
    for tech in techniques(stack):
        before = dict(vars(tech))
        for klass in reversed(type(tech).__mro__):
            check = klass.__dict__.get("check_knobs")
            if check is not None:
                check(tech)
        after = vars(tech)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) is not after.get(k))
        assert not changed, f"{technique}: check_knobs set {changed}"


def test_no_technique_writes_its_dict():
    files = [*SRC.glob("compressors/*.py"), *SRC.glob("routers/*.py"), *SRC.glob("schedulers/*.py")]
    files.append(SRC / "select.py")
    assert len(files) > 25
    writes = [
        f"{f.name}:{n}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if "__dict__" in line
    ]
    assert not writes, f"__dict__ in technique code: {writes}"


def test_techniques_touch_only_the_stores_surface():
    """Technique code takes a ``TechniqueStore`` (never names ``LayerStore`` in code), every
    ``store.<member>`` it writes is one of the surface's, each of those is still used (the surface
    only shrinks), and the store has them all (mypy checks their types: ``surface._conforms``)."""
    files = [*SRC.glob("compressors/*.py"), *SRC.glob("routers/*.py"), *SRC.glob("schedulers/*.py")]
    used: dict[str, list[str]] = {}
    named: list[str] = []
    for f in [*files, SRC / "select.py", SRC / "roles.py"]:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            for member in re.findall(r"(?<![.\w])store\.([A-Za-z_]\w*)", line):
                used.setdefault(member, []).append(f"{f.name}:{n}")
            if re.search(r"import .*\bLayerStore\b|[:\[]\s*LayerStore\b", line):
                named.append(f"{f.name}:{n}")
    assert not named, f"technique code names LayerStore (take a TechniqueStore): {named}"
    surface = surface_reads | surface_acts
    outside = {m: at[:3] for m, at in used.items() if m not in surface}
    assert not outside, f"technique code touches store members outside the surface: {outside}"
    assert not surface - set(used), f"on the surface but unused (remove them): {sorted(surface - set(used))}"
    store = LayerStore(1, 2, 4, torch.float32, torch.device("cpu"))
    assert all(hasattr(store, m) for m in surface), sorted(m for m in surface if not hasattr(store, m))
