"""Every option of every group composes and instantiates; every YAML starts with a comment."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvbench import config
from kvbench.stack import build_technique, chain_stages

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ROLE_OPTIONS = [
    (g, p.stem) for g in ("router", "compressor", "scheduler") for p in sorted((CONF / g).glob("*.yaml"))
]


@pytest.fixture(scope="module", autouse=True)
def _hydra():
    config.register()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        yield


@pytest.mark.parametrize(("group", "option"), ROLE_OPTIONS)
def test_every_technique_option_instantiates(group, option):
    extra = [f"{group}.stages=[snapkv,quantized]"] if option == "chain" else []
    cfg = compose("config", overrides=[f"{group}={option}", *extra])
    if option == "chain":  # the stack holds a chain's stages
        stages = chain_stages(cfg[group].stages)[0]
        assert [t.name for t in stages] == ["snapkv", "quantized"] and stages[0].role == group
        return
    tech = build_technique(cfg[group], group)
    assert (tech is None) == (option == "none")
    if tech is not None:
        assert tech.name == option and tech.role == group


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "model").glob("*.yaml")))
def test_every_model_option_composes(option):
    cfg = compose("config", overrides=[f"model={option}"])
    assert cfg.model.name == option and cfg.model.dtype in ("float32", "bfloat16", "float16")


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_composes(option):
    cfg = compose("config", overrides=[f"experiment={option}"])
    # A preset's records land in results/<name>/: one preset, or one family of them (the PiKV
    # system variants share `system_variants`, the RankKV ablations `rankkv_ablation`).
    assert cfg.name in (option, option.rsplit("_", 1)[0], "system_variants", "rankkv_ablation")
    assert f"experiment={option}" in (CONF / "experiment" / f"{option}.yaml").read_text()


def test_every_yaml_starts_with_a_comment():
    for path in CONF.rglob("*.yaml"):
        assert path.read_text().startswith("#"), path


def test_threads_follow_the_schedulers_allocation_unless_set(monkeypatch):
    from kvbench.run import thread_count

    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert thread_count(None) is None
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    assert thread_count(None) == 3 and thread_count(2) == 2
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "")
    assert thread_count(None) is None
