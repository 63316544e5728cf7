"""``kernels=auto``'s dispatch table (issue 30): the shipped table and its provenance, the rule that
takes Triton only where every bracketing measured point was faster, the record of the paths taken,
a decode step's states kept of one kind, cell identities (torch's unchanged) and
``bench_kernels.py --table``."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from helpers import make_stack, run_chunks, tokens
from kvbench import config, models, run
from kvbench.cache import partials
from kvbench.compressors.lora import LoraCompressor
from kvbench.kernels import dispatch
from test_bad_inputs import ROOT, TINY_PPL

H200 = "NVIDIA H200"
K = 1024

# docs/kernels.md, "Measured on an H200 (2026-11-26)": torch time / Triton time, batch 1 / batch 8
DOCS = {
    "kivi.quantize": ((5.3, 11.6), (11.6, 11.8), (11.7, 11.8)),
    "kivi.dequantize": ((2.0, 13.6), (13.6, 14.5), (14.3, 14.6)),
    "decode.kivi2bit": ((0.51, 2.6), (1.7, 2.9), (2.9, 3.0)),
    "decode.latent": ((0.85, 1.5), (1.4, 1.5), (1.3, 1.5)),
    "score.quest": ((4.3, 2.6), (3.1, 0.81), (0.89, 0.67)),
    "decode.masked": ((0.05, 0.13), (0.14, 0.63), (0.31, 0.90)),
    "decode.sparse1/8": ((0.16, 0.14), (0.14, 0.62), (0.31, 1.07)),
    "decode.window": ((0.48, 0.50), (0.48, 0.74), (0.49, 1.23)),
}


@pytest.fixture
def table():
    return dispatch.table()


@pytest.fixture
def measured(table):
    """The versions the H200 was measured at: the rule's tests stand whatever the current ones are."""
    return table["devices"][H200]["versions"]


@pytest.fixture
def timed(table):
    """The table with each module's rows those the H200 timed (a row added since, as
    ``decode.latent8bit``, it never timed: the module is torch there): the rule's tests stand on
    its figures whatever rows came after."""
    ratios = table["devices"][H200]["ratios"]
    modules = {name: [r for r in rows if r in ratios] for name, rows in table["modules"].items()}
    return {**table, "modules": modules}


def test_the_shipped_table_names_the_h200_with_its_provenance_and_the_docs_figures(table):
    entry = table["devices"][H200]
    assert (entry["commit"], entry["date"], entry["torch"], entry["triton"]) == (
        "e8ec299", "2026-11-26", "2.11", "3.6"
    )  # fmt: skip
    assert entry["command"] == "python scripts/bench_kernels.py"
    # every module has its rows; the H200 measured the modules of its day (pruned_decode and
    # svd_decode came after it: ``auto`` takes torch for them there, as for any module unmeasured)
    later_modules = {"pruned_decode", "svd_decode"}
    assert set(table["modules"]) == set(dispatch.VERSIONS) == {*entry["versions"], *later_modules}
    assert table["modules"]["compaction"] == []
    for row, figures in DOCS.items():
        for (b1, b8), context in zip(figures, ("4096", "32768", "131072"), strict=True):
            assert entry["ratios"][row]["1"][context] == b1 and entry["ratios"][row]["8"][context] == b8
    # every row the H200 timed speaks for a module; these came after it
    later = {
        "decode.ragged", "decode.pages1/8", "decode.blocks2/8", "decode.experts2/8", "decode.pruned",
        "decode.svd", "decode.latent8bit",
    }  # fmt: skip
    assert {r for rows in table["modules"].values() for r in rows} == {*DOCS, *later}
    assert set(DOCS) == set(entry["ratios"])
    assert dispatch.TABLE.read_text() == dispatch.dumps(table) + "\n"  # as bench_kernels --table writes it


def test_brackets_are_the_nearest_measured_points_on_each_side():
    points = [4 * K, 32 * K, 128 * K]
    assert dispatch.brackets(points, None) == points
    assert dispatch.brackets(points, 100) == [4 * K]
    assert dispatch.brackets(points, 8 * K) == [4 * K, 32 * K]
    assert dispatch.brackets(points, 32 * K) == [32 * K]
    assert dispatch.brackets(points, 200 * K) == [128 * K]


@pytest.mark.parametrize(
    "name, batch, slots, triton",
    [
        *[("kivi", b, s, True) for b in (1, 4, 8, 16, None) for s in (100, 4 * K, 128 * K, 1 << 20, None)],
        *[("attention", b, s, False) for b in (1, 4, 8, 16, None) for s in (4 * K, 64 * K, 128 * K, 1 << 20)],
        ("kivi_decode", 1, 4 * K, False),
        ("kivi_decode", 1, 8 * K, False),  # the bracketing 4k point lost
        ("kivi_decode", 1, 32 * K, True),
        ("kivi_decode", 1, 200 * K, True),
        ("kivi_decode", 1, None, False),
        *[("kivi_decode", 8, s, True) for s in (100, 4 * K, 8 * K, 32 * K, 200 * K, None)],
        ("kivi_decode", 4, 32 * K, True),  # between batches 1 and 8: both won at 32k
        ("kivi_decode", 4, 4 * K, False),
        ("latent_decode", 1, 8 * K, False),
        ("latent_decode", 1, 32 * K, True),
        ("latent_decode", 8, 4 * K, True),
        ("scoring", 1, 4 * K, True),
        ("scoring", 1, 32 * K, True),
        ("scoring", 1, 64 * K, False),  # the bracketing 128k point lost
        ("scoring", 8, 4 * K, True),
        ("scoring", 8, 32 * K, False),
        *[("compaction", b, s, False) for b in (1, 8, None) for s in (4 * K, 128 * K, None)],
    ],
)
def test_auto_takes_triton_only_where_every_bracketing_point_was_faster(
    timed, measured, name, batch, slots, triton
):
    assert dispatch.choose(timed, H200, name, batch, slots, measured) is triton


def test_a_version_or_a_device_the_table_did_not_measure_takes_torch(table, timed, measured):
    assert dispatch.choose(table, H200, "kivi", 8, 32 * K, measured)
    assert not dispatch.choose(table, H200, "kivi", 8, 32 * K, {**measured, "kivi": measured["kivi"] + 1})
    assert not dispatch.choose(table, "NVIDIA H100 80GB HBM3", "kivi", 8, 32 * K, measured)
    assert not dispatch.choose(table, None, "kivi", 8, 32 * K, measured)
    assert not dispatch.choose(table, H200, "unknown", 8, 32 * K, measured)
    for name in ("pruned_decode", "svd_decode"):  # on the table, never measured on the H200
        assert not dispatch.choose(table, H200, name, 1, 32 * K)
    # latent_decode won at batch 1 and 32k there, but its row over quantized latents came after
    assert dispatch.choose(timed, H200, "latent_decode", 1, 32 * K, measured)
    assert not dispatch.choose(table, H200, "latent_decode", 1, 32 * K, measured)
    partial = copy.deepcopy(table)
    del partial["devices"][H200]["ratios"]["kivi.dequantize"]
    assert not dispatch.choose(partial, H200, "kivi", 8, 32 * K, measured)  # a row not measured


def test_the_paths_taken_are_recorded_per_module(monkeypatch, measured):
    """Under ``auto`` on the H200 each call gets the table's answer, memoized, and :func:`taken`
    says which paths each module took; ``torch`` and ``triton`` answer as before."""
    monkeypatch.setattr(dispatch, "VERSIONS", dict(measured))
    monkeypatch.setattr(dispatch, "_DECIDED", {})
    with dispatch.using("auto", H200):
        assert dispatch.active() == "auto"
        assert dispatch.kernels("kivi") is not None
        assert dispatch.kernels("attention", 1, 32 * K) is None
        assert dispatch.kernels("kivi_decode", 1, 4 * K) is None
        assert dispatch.kernels("kivi_decode", 1, 32 * K) is not None
        assert dispatch.kernels("kivi_decode", 1, 32 * K) is not None  # memoized
        assert dispatch._DECIDED[("kivi_decode", H200, 1, 32 * K)] is True
        assert dispatch.taken() == {"attention": "torch", "kivi": "triton", "kivi_decode": "torch+triton"}
    with dispatch.using("torch"):
        assert dispatch.kernels("kivi") is None and dispatch.taken() == {"kivi": "torch"}
    with dispatch.using("triton"):
        assert dispatch.kernels("attention", 1, 4 * K) is not None
        assert dispatch.taken() == {"attention": "triton"}
    with dispatch.using("auto", "a GPU the table does not know"):
        assert dispatch.kernels("kivi") is None


def test_auto_is_torch_on_a_cpu_and_decided_per_call_on_cuda():
    assert dispatch.resolve("auto", torch.device("cpu")) == "torch"
    assert dispatch.resolve("auto", torch.device("cuda")) == "auto"
    assert dispatch.resolve("triton", torch.device("cpu")) == "triton"
    assert run.kernel_identity("auto") == f"auto@e8ec299@{dispatch.versions_stamp()}"


def test_a_cells_identity_names_its_path_and_torchs_is_unchanged(tmp_path, monkeypatch):
    """A CPU cell (``auto`` or ``torch``) has no ``kernels`` in its identity, as before the kernels
    existed; on CUDA ``triton`` says so and ``auto`` names the table's commit."""
    config.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfgs = {
            path: compose(
                "config", overrides=[*TINY_PPL, f"results_dir={tmp_path}", f"kernels={path}", "device=cpu"]
            )
            for path in ("auto", "torch", "triton")
        }
    stack = config.validate(cfgs["torch"])
    on_cpu = {path: run.identity(cfg, stack, "sha") for path, cfg in cfgs.items() if path != "triton"}
    assert on_cpu["auto"] == on_cpu["torch"] and "kernels" not in on_cpu["torch"]
    monkeypatch.setattr(models, "resolve_device", lambda name: torch.device("cuda"))
    on_cuda = {path: run.identity(cfg, stack, "sha") for path, cfg in cfgs.items()}
    assert on_cuda["torch"] == {**on_cpu["torch"], "device": "cuda"}
    assert on_cuda["triton"]["kernels"] == f"triton@{dispatch.versions_stamp()}"
    assert on_cuda["auto"]["kernels"] == f"auto@e8ec299@{dispatch.versions_stamp()}"


def test_a_decode_step_gathers_states_of_one_kind(monkeypatch, measured):
    """Inside :func:`dispatch.step` the segments of a step get the step's answer for ``attention``,
    and a fused decode only where the step took the attention kernel (its states need that merge)."""
    monkeypatch.setattr(dispatch, "VERSIONS", dict(measured))
    monkeypatch.setattr(dispatch, "_DECIDED", {})
    with dispatch.using("auto", H200):
        assert dispatch.kernels("kivi_decode", 1, 32 * K) is not None  # alone, the table's answer
        attention = importlib.import_module("kvbench.kernels.attention")
        with dispatch.step(None):
            assert dispatch.kernels("kivi_decode", 1, 32 * K) is None
            assert dispatch.kernels("attention", 8, 128 * K) is None
            assert dispatch.kernels("kivi", 1, 32 * K) is not None  # not a decode state: the table's
        with dispatch.step(attention):
            assert dispatch.kernels("attention", 1, 4 * K) is attention  # the step's, not the table's
            assert dispatch.kernels("kivi_decode", 1, 32 * K) is not None
            assert dispatch.kernels("kivi_decode", 1, 4 * K) is None
        assert dispatch.kernels("attention", 1, 4 * K) is None


def test_auto_with_a_fused_decode_faster_and_attention_slower_keeps_the_torch_logits(
    tiny_93, monkeypatch, measured
):
    """A lora cache under ``auto`` on a GPU whose table has the fused low-rank decode faster and the
    attention kernels slower: the torch path's partials stay torch (no kernel state mixed in), so
    the logits are the torch path's, bit for bit, and the paths taken say so."""
    fake = copy.deepcopy(dispatch.table())
    fake["devices"]["Fake GPU"] = entry = fake["devices"][H200]
    entry["ratios"]["decode.latent"] = entry["ratios"]["decode.latent8bit"] = {"1": {"4096": 2.0}}
    monkeypatch.setattr(dispatch, "table", lambda: fake)
    monkeypatch.setattr(dispatch, "VERSIONS", dict(measured))
    monkeypatch.setattr(dispatch, "_DECIDED", {})
    monkeypatch.setattr(partials, "PARTIAL_MIN_SLOTS", 0)  # the torch path's partials at tiny sizes
    assert dispatch.choose(fake, "Fake GPU", "latent_decode", 1, 40)

    def logits(path: str):
        lora = LoraCompressor(key_rank=4, value_rank=8, calibration_tokens=256)
        with dispatch.using(path, "Fake GPU"):
            out, _ = run_chunks(
                tiny_93, make_stack(tiny_93, compressor=lora, window=4, sinks=2), tokens(40), [30] + [1] * 5
            )
            return out, dispatch.taken()

    (want, _), (got, paths) = logits("torch"), logits("auto")
    assert torch.equal(got, want)
    # the window's moves are named by columns (nothing compacted by a plan): no compaction asked
    assert paths == {"attention": "torch", "latent_decode": "torch"}


def _bench_kernels():
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "scripts" / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_kernels_writes_its_gpus_entry_and_refuses_on_a_cpu(tmp_path, monkeypatch):
    """``--table`` replaces the measuring GPU's entry (others stay) with its ratios and provenance,
    in the shipped table's format; on a CPU it refuses in one line."""
    bench = _bench_kernels()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(bench, "RATIOS", {"kivi.quantize": {"1": {"4096": 3.0}}})
    monkeypatch.setattr(sys, "argv", ["scripts/bench_kernels.py", "--table", "t.json"])
    path = tmp_path / "t.json"
    path.write_text(dispatch.TABLE.read_text())
    bench.write_table(path, torch.device("cuda"))
    got = json.loads(path.read_text())
    assert got["devices"][H200] == dispatch.table()["devices"][H200]
    entry = got["devices"]["Fake GPU"]
    assert entry["ratios"] == {"kivi.quantize": {"1": {"4096": 3.0}}}
    assert entry["versions"] == dispatch.VERSIONS and entry["torch"] == torch.__version__
    assert entry["command"] == "python scripts/bench_kernels.py --table t.json"
    assert entry["commit"] == bench.commit() != "" and len(entry["date"]) == 10
    assert path.read_text() == dispatch.dumps(got) + "\n"
    fresh = tmp_path / "new.json"
    bench.write_table(fresh, torch.device("cuda"))
    assert set(json.loads(fresh.read_text())["devices"]) == {"Fake GPU"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as refused:
        bench.main()
    assert str(refused.value) == (
        "bench_kernels: --table needs CUDA: a CPU has no Triton timings to fill the table with"
    )
