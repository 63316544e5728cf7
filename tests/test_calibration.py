"""Calibration: disjoint text, cached artifacts, effective ranks, key/value bases and DuoAttention gates,
on tiny models (GQA 9/3 and GPT-NeoX with partial rotary)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_cfg
from helpers import make_stack, run_chunks, tokens
from kvbench import calibration, models
from kvbench.cache import engine
from kvbench.data.calibration import calibration_ids, calibration_text, describe
from kvbench.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and lose much on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def neox():
    return models.load(tiny_cfg("gpt_neox"), "cpu")


@pytest.fixture(scope="module")
def mistral():
    return models.load(tiny_cfg("mistral"), "cpu")  # sliding window 24


# --- calibration text --------------------------------------------------------------------------


def test_text_disjoint_from_evaluated_corpus():
    from pydoc_data.topics import topics

    evaluated = "\n\n".join(topics.values())
    text = calibration_text()
    for start in torch.linspace(0, len(text) - 200, 25).long().tolist():
        assert text[start : start + 200] not in evaluated
    for start in torch.linspace(0, len(evaluated) - 200, 25).long().tolist():
        assert evaluated[start : start + 200] not in text


def test_a_file_shadowing_a_standard_module_is_refused(tmp_path):
    """A script's folder comes first on ``sys.path``: a ``trace.py`` beside it would replace the
    standard library's ``trace`` in the calibration text, and the bases fitted on it. Refused in
    one line naming the module and the file."""
    (tmp_path / "trace.py").write_text('"""not the standard library\'s trace"""\n')
    code = (
        "from kvbench.data.calibration import calibration_text\n"
        "from kvbench.errors import ConfigError\n"
        "try:\n    calibration_text()\nexcept ConfigError as err:\n    print(err)\n"
    )
    (tmp_path / "run.py").write_text(code)
    out = subprocess.run(
        [sys.executable, str(tmp_path / "run.py")], capture_output=True, text=True, check=True
    )
    line = out.stdout.strip()
    assert "module 'trace'" in line and str(tmp_path / "trace.py") in line and "\n" not in line, line


def test_text_long_enough_and_described(tiny):
    text = calibration_text()
    assert len(text) >= 120_000  # >= 30k tokens at about 4 characters per token
    assert len(text.split()) > 30_000  # words of prose
    info = describe()
    assert info["name"] == "stdlib_docstrings" and len(info["sha256"]) == 64 and info["python"]
    assert calibration_ids(tiny, 100, offset=50) == list(text.encode("utf-8")[50:150])
    with pytest.raises(ConfigError, match=r"10000000 tokens.*\d+ tokens long"):
        calibration_ids(tiny, 10_000_000)


# --- artifact store ----------------------------------------------------------------------------


def test_artifact_computed_once_then_loaded(tiny, cache_dir, capsys):
    calls = []

    def compute():
        calls.append(1)
        return {"x": torch.arange(6.0).reshape(2, 3)}

    ident = models.model_identity(tiny.cfg)
    first, rec = calibration.get_or_compute("test", ident, {"a": 1}, compute)
    assert "kvbench: calibrating test for tiny_llama_6" in capsys.readouterr().err
    again, rec2 = calibration.get_or_compute("test", ident, {"a": 1}, compute)
    assert len(calls) == 1 and rec2 == rec
    assert torch.equal(first["x"], again["x"]) and again["x"].device.type == "cpu"
    path = Path(rec["path"])
    assert path.parent == cache_dir / "calibration" and path.name == f"test-{rec['hash']}.pt"
    assert len(rec["hash"]) == 16 and rec["sha256"] == models.file_sha256(path)
    assert rec["settings"] == {"a": 1} and rec["text"] == describe()
    assert not list(path.parent.glob("*.tmp-*"))
    _, rec3 = calibration.get_or_compute("test", ident, {"a": 2}, compute)
    assert len(calls) == 2 and rec3["path"] != rec["path"]


# --- effective rank ----------------------------------------------------------------------------


def test_effective_rank_formula():
    assert calibration.effective_rank(torch.eye(7)).item() == pytest.approx(7.0)
    u, v = torch.randn(9, 1), torch.randn(1, 5)
    assert calibration.effective_rank(u @ v).item() == pytest.approx(1.0, abs=1e-6)
    two = torch.diag(torch.tensor([3.0, 3.0, 0.0, 0.0]))
    assert calibration.effective_rank(two).item() == pytest.approx(2.0)
    s = torch.tensor([4.0, 2.0, 1.0, 1.0])  # hand-computed: p = s / 8
    expect = torch.exp(-(s / 8 * torch.log(s / 8)).sum())
    assert calibration.effective_rank(torch.diag(s)).item() == pytest.approx(expect.item())


def test_effective_ranks_per_layer(tiny_93):
    ids = calibration_ids(tiny_93, 96)
    ranks = calibration.effective_ranks(tiny_93, ids)
    assert ranks.shape == (tiny_93.num_layers,)
    assert bool(((ranks >= 1) & (ranks <= 96)).all())
    assert torch.equal(ranks, calibration.effective_ranks(tiny_93, ids))


# --- capture attention -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny_93", "mistral", "neox"])
def test_capture_matches_engine_and_restores_it(which, request):
    lm = request.getfixturevalue(which)
    ids = tokens(64)
    before = run_chunks(lm, make_stack(lm), ids, [64])[0]
    with torch.no_grad():
        hidden = calibration.run(lm, ids, calibration.Capture())
        captured = lm.model.get_output_embeddings()(hidden)[0]
    assert torch.allclose(captured, before, atol=1e-4)  # same attention, sliding window included
    calibration.kv_bases(lm, ids, 2, 2)
    calibration.effective_ranks(lm, ids)
    assert lm.model.config._attn_implementation == engine.ATTN_NAME
    assert torch.equal(run_chunks(lm, make_stack(lm), ids, [64])[0], before)


def test_capture_restores_after_error(tiny):
    def boom(layer, key, value):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        calibration.run(tiny, tokens(8), calibration.Capture(on_kv=boom))
    assert tiny.model.config._attn_implementation == engine.ATTN_NAME


# --- key / value bases -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny_93", "neox"])
def test_kv_bases(which, request):
    lm = request.getfixturevalue(which)
    ids = calibration_ids(lm, 128)
    d, hkv = lm.head_dim, lm.kv_heads
    bases = calibration.kv_bases(lm, ids, key_rank=4, value_rank=6)
    assert bases["key"].shape == (lm.num_layers, hkv, d, 4) and bases["key"].dtype == torch.float32
    assert bases["value"].shape == (lm.num_layers, hkv, d, 6)
    for b in bases.values():
        gram = b.transpose(-1, -2) @ b
        assert torch.allclose(gram, torch.eye(b.shape[-1]).expand_as(gram), atol=1e-5)
    full = calibration.kv_bases(lm, ids, d, d)  # columns largest first: rank r is the first r
    assert torch.allclose(full["key"][..., :4], bases["key"], atol=1e-5)
    keys, values = calibration.prerope_kv(lm, ids)  # (L, Hkv, T, D)
    errors = []
    for r in range(1, d + 1):
        basis = full["key"][..., :r]
        errors.append(float((keys @ basis @ basis.mT - keys).norm() / keys.norm()))
    assert errors[-1] < 1e-5  # full rank: exact
    assert all(a >= b - 1e-6 for a, b in zip(errors, errors[1:])) and errors[0] > errors[-1] + 0.01
    # The basis is the top right-singular subspace of the pre-RoPE keys (uncentered).
    top = torch.linalg.svd(keys.double(), full_matrices=False).Vh[..., :4, :].transpose(-1, -2)
    assert torch.allclose(top @ top.transpose(-1, -2), (bases["key"] @ bases["key"].mT).double(), atol=1e-4)
    vtop = torch.linalg.svd(values.double(), full_matrices=False).Vh[..., :6, :].transpose(-1, -2)
    assert torch.allclose(vtop @ vtop.mT, (bases["value"] @ bases["value"].mT).double(), atol=1e-4)


def test_prerope_keys_do_not_depend_on_position(tiny_93):
    """Layer 0 keys see only the token itself before RoPE: equal tokens, equal pre-RoPE keys."""
    ids = [7, 42, 99] * 10
    keys, _ = calibration.prerope_kv(tiny_93, ids)
    assert torch.allclose(keys[0, :, 0], keys[0, :, 27], atol=1e-5)
    assert not torch.allclose(keys[0, :, 0], keys[0, :, 1], atol=1e-3)


def test_bases_ranks_checked(tiny):
    with pytest.raises(ConfigError, match="key_rank=17"):
        calibration.kv_bases(tiny, tokens(8), 17, 4)


# --- DuoAttention gates ------------------------------------------------------------------------


def test_passkey_samples(tiny):
    samples = calibration.passkey_samples(tiny, 3, 600, seed=1)
    assert samples == calibration.passkey_samples(tiny, 3, 600, seed=1)
    for s in samples:
        text = bytes(s).decode()
        key = text.rsplit(" ", 1)[-1]
        assert key.isdigit() and len(key) == 5
        assert f"The pass key is {key}. Remember it." in text and text.endswith(f"The pass key is {key}")
        assert text.split(" The pass key is")[0].rstrip().endswith((".", "!", "?"))


@pytest.mark.parametrize("which", ["tiny_93", "neox"])
def test_duo_gates(which, request):
    lm = request.getfixturevalue(which)
    samples = calibration.passkey_samples(lm, 2, 96, seed=0)
    start = time.perf_counter()
    kw = dict(sinks=2, window=8, steps=8, lr=0.05, seed=3)
    free = calibration.duo_gates(lm, samples, l1=0.0, **kw)
    assert time.perf_counter() - start < 10
    assert free.shape == (lm.num_layers, lm.kv_heads)
    assert bool(((free >= 0) & (free <= 1)).all())
    assert torch.equal(free, calibration.duo_gates(lm, samples, l1=0.0, **kw))
    pushed = calibration.duo_gates(lm, samples, l1=10.0, **kw)
    assert bool((pushed < free).all()) and bool(((pushed >= 0) & (pushed <= 1)).all())
    assert all(p.requires_grad and p.grad is None for p in lm.model.parameters())
    assert lm.model.config._attn_implementation == engine.ATTN_NAME


# --- artifacts and the CLI ---------------------------------------------------------------------


def test_cli_precomputes_what_a_run_finds(cache_dir, capsys):
    spec = importlib.util.spec_from_file_location("calibrate_cli", ROOT / "scripts" / "calibrate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    argv = ["--model", "tiny_random", "--key-rank", "4", "--value-rank", "8", "--lora-tokens", "128"]
    records = cli.main([*argv, "--steps", "2", "--samples", "1", "--length", "64", "--rank-tokens", "128"])
    assert [r["kind"] for r in records] == ["lora", "duo", "rankkv"]
    out = capsys.readouterr().out
    assert all(Path(r["path"]).exists() and r["path"] in out for r in records)
    lm = models.load(cli.OmegaConf.load(ROOT / "conf" / "model" / "tiny_random.yaml"), "cpu")
    tensors, rec = calibration.rankkv_artifact(lm, 128)  # found, not recomputed
    assert rec == records[2] and tensors["ranks"].shape == (lm.num_layers,)
    assert calibration.lora_artifact(lm, 4, 8, 128)[1] == records[0]
