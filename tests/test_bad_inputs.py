"""Bad input a new user meets (issue 12): each gets one line naming the key, the value and what is
allowed, before any model loads; and inputs that were refused wrongly are accepted."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import run_kvbench
from kvbench import config, models
from kvbench.data import corpus
from kvbench.errors import ConfigError, DatasetLoadError
from kvbench.eval import perplexity

ROOT = Path(__file__).resolve().parents[1]
TINY_PPL = ["model=tiny_random", "dataset=pydoc", "dataset.prefill=48", "dataset.chunk=8"]
TINY_PPL += ["dataset.chunks_per_window=2", "dataset.windows=2", "window=8", "sinks=2"]
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: refused at once, with or without a network


def one_line(message: str) -> str:
    assert "\n" not in message, message
    return message


def cell(tmp: Path, *overrides: str):
    config.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*TINY_PPL, f"results_dir={tmp}", *overrides])


def refused(tmp: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        config.validate(cell(tmp, *overrides))
    return one_line(str(info.value))


# the command line: exactly one line on stderr, nothing written, no model loaded


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["device=tpu"], {}, "device='tpu': allowed auto, cpu, cuda, cuda:N"),
        (
            ["dataset=pydoc", "dataset.windows=100000"],
            {},
            "dataset.windows=100000: corpus 'pydoc' (",
        ),
        (
            ["model=qwen2_5_0_5b"],
            {"HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_ENDPOINT": UNREACHABLE},
            f"model.hf_id='Qwen/Qwen2.5-0.5B-Instruct' (model=qwen2_5_0_5b): not in the local HF cache "
            f"and {UNREACHABLE} is unreachable",
        ),
    ],
)
def test_the_cli_refuses_in_one_line(tmp_path, args, env, needle):
    out = run_kvbench(*args, tmp=tmp_path, HF_HOME=str(tmp_path / "hf"), **env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr[-2000:]
    assert out.stderr.startswith("kvbench: error: ") and needle in out.stderr, out.stderr
    assert not (tmp_path / "results").exists() and not (tmp_path / "cache").exists()


def test_help_names_kvbench_says_what_it_does_and_gives_the_readmes_commands(tmp_path):
    out = run_kvbench("--help", tmp=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("kvbench: honest benchmarks of KV-cache compression for LLMs.")
    assert "powered by Hydra" not in out.stdout.splitlines()[0] and "__main__" not in out.stdout
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    commands = [line for line in readme if line.startswith(("make demo ", "make test "))]
    assert len(commands) == 2 and all(f"  {c}" in out.stdout.splitlines() for c in commands)
    assert "== Configuration groups ==" in out.stdout
    assert any(line.startswith("scheduler: ") and "h2o" in line for line in out.stdout.splitlines())


# device


def test_an_unknown_device_is_refused(tmp_path):
    for bad in ("tpu", "gpu", "cuda:x", "cuda:-1", "CUDA"):
        assert refused(tmp_path, f"device={bad}") == (
            f"device='{bad}': allowed auto, cpu, cuda, cuda:N (N a GPU index), mps"
        )


def test_cuda_is_refused_where_there_is_none(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:0"):
        message = refused(tmp_path, f"device={name}")
        assert message.startswith(f"device='{name}': ")
        assert message.endswith("use device=auto or cpu on this machine")
    config.validate(cell(tmp_path, "device=auto"))
    config.validate(cell(tmp_path, "device=cpu"))
    # a SLURM launch runs on the cluster's GPU nodes: the submitting machine needs none
    config.validate(cell(tmp_path, "device=cuda", "launcher=slurm"))


def test_a_cuda_index_beyond_the_machines_gpus_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    message = refused(tmp_path, "device=cuda:2")
    assert message == "device='cuda:2': this machine has 2 CUDA GPU(s): cuda:0..cuda:1"
    for name in ("cuda", "cuda:0", "cuda:1"):
        config.validate(cell(tmp_path, f"device={name}"))


# threads


@pytest.mark.parametrize("threads", [0, -2])
def test_threads_below_one_are_refused(tmp_path, threads):
    assert refused(tmp_path, f"threads={threads}") == (
        f"threads={threads}: must be null (SLURM_CPUS_PER_TASK when set, else torch's default) "
        "or an integer >= 1"
    )


def test_threads_null_or_positive_pass(tmp_path):
    config.validate(cell(tmp_path, "threads=null"))
    config.validate(cell(tmp_path, "threads=1"))


# windows


def test_more_windows_than_the_corpus_holds_is_refused_before_loading(tmp_path):
    size = corpus.size_bound({"name": "pydoc", "source": "pydoc"})
    assert size is not None and size > 100_000
    fit = size // (48 + 8 * 2 + 1)
    config.validate(cell(tmp_path, f"dataset.windows={fit}"))
    message = refused(tmp_path, f"dataset.windows={fit + 1}")
    assert message == (
        f"dataset.windows={fit + 1}: corpus 'pydoc' ({size} UTF-8 bytes, so at most {size} tokens) holds "
        f"at most {fit} windows of 65 tokens; more would overlap and score the same tokens again; "
        f"allowed at most {fit} (the model's tokenizer gives the exact number)"
    )


def test_windows_beyond_the_tokenized_corpus_are_refused_with_the_exact_number():
    cfg = OmegaConf.create(dict(name="pydoc", prefill=40, chunk=8, chunks_per_window=3, windows=7))
    with pytest.raises(ConfigError) as info:
        perplexity.windows(list(range(400)), cfg)  # windows of 65 tokens: 6 fit side by side
    assert one_line(str(info.value)) == (
        "dataset.windows=7: corpus 'pydoc' (400 tokens) holds 6 windows of 65 tokens; "
        "more would overlap and score the same tokens again; allowed 1..6"
    )
    cfg.windows = 6
    wins = perplexity.windows(list(range(400)), cfg)
    assert all(a[-1] < b[0] for a, b in zip(wins, wins[1:]))  # side by side: no token scored twice


def test_a_text_file_shorter_than_the_windows_is_refused_at_validation(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 200, encoding="utf-8")
    message = refused(tmp_path, "dataset=text_file", f"dataset.path={path}", "dataset.windows=4")
    assert message.startswith("dataset.windows=4: corpus 'text_file' (200 UTF-8 bytes")
    assert "holds at most 3 windows of 65 tokens" in message


# text files


def test_any_utf8_file_is_read_as_text(tmp_path):
    path = tmp_path / "wiki.test.raw"
    text = ' = Valkyria Chronicles III = \n\n Senjō no Valkyria 3 @-@ {"text": "not a record"}\n' * 40
    path.write_text(text, encoding="utf-8")
    config.validate(cell(tmp_path, "dataset=text_file", f"dataset.path={path}"))
    cfg = {"name": "text_file", "source": "text_file", "path": str(path)}
    assert corpus.load_text(cfg) == text
    for suffix in (".md", ".csv", ""):
        other = path.with_name("corpus" + suffix)
        other.write_text(text, encoding="utf-8")
        assert corpus.load_text({**cfg, "path": str(other)}) == text


def test_json_lines_are_still_parsed_as_records(tmp_path):
    path = tmp_path / "docs.json"
    path.write_text('{"text": "first"}\n{"text": "second"}\n', encoding="utf-8")
    assert corpus.load_text({"name": "d", "source": "text_file", "path": str(path)}) == "first\n\nsecond"


def test_a_file_that_is_not_utf8_is_one_line_naming_its_path(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café\nbien\n".encode("latin-1"))
    corpus.validate({"name": "mine", "source": "text_file", "path": str(path)})  # readable: fine so far
    with pytest.raises(DatasetLoadError) as info:
        corpus.load_text({"name": "mine", "source": "text_file", "path": str(path)})
    assert one_line(str(info.value)) == (
        f"dataset 'mine': '{path}': not UTF-8 text (byte 0xe9 at offset 3); "
        "kvbench reads .jsonl/.json files as JSON lines and any other file as UTF-8 text"
    )


# hub models without a network


HUB = OmegaConf.create(
    {
        "name": "tiny_hub",
        "source": "hub",
        "hf_id": "kvbench-tests/tiny-llama",
        "revision": "main",
        "dtype": "float32",
        "device_map": None,
        "description": "test",
    }
)


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An empty HF cache and a hub that refuses connections; offline mode off."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", UNREACHABLE)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hub"


def test_an_uncached_hub_model_without_network_is_refused_at_once(no_hub):
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        models.validate(HUB)
    assert time.perf_counter() - start < 5
    assert one_line(str(info.value)).startswith(
        f"model.hf_id='kvbench-tests/tiny-llama' (model=tiny_hub): not in the local HF cache and "
        f"{UNREACHABLE} is unreachable (ConnectError: "
    )


def test_a_hub_probe_that_hangs_is_cut_short(monkeypatch):
    """A name lookup that never returns (no resolver) is not bounded by the client's timeout: the
    probe gives up on its own."""
    release = threading.Event()

    class Hanging:
        def head(self, *args, **kwargs):
            release.wait(30)

    monkeypatch.setattr(huggingface_hub, "get_session", lambda: Hanging())
    monkeypatch.setattr(models, "HUB_PROBE_S", 0.2)
    start = time.perf_counter()
    try:
        why = models._probe.__wrapped__("http://hangs.invalid")
    finally:
        release.set()
    assert time.perf_counter() - start < 3
    assert why == "http://hangs.invalid is unreachable (no answer within 1.2 s: name lookup or connection)"


def test_hf_hub_offline_is_honoured(no_hub, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as info:
        models.validate(HUB)
    assert one_line(str(info.value)) == (
        "model.hf_id='kvbench-tests/tiny-llama' (model=tiny_hub): not in the local HF cache and "
        "HF_HUB_OFFLINE is set; unset it, or download it where there is a network "
        "(hf download kvbench-tests/tiny-llama)"
    )


def test_a_cached_hub_model_loads_without_network(no_hub, monkeypatch):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    repo = no_hub / "models--kvbench-tests--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    config_ = LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config_).save_pretrained(snapshot)
    words = WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>")
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), unk_token="<unk>").save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(models, "_LOADED", {})
    start = time.perf_counter()
    models.validate(HUB)
    lm = models.load(HUB, "cpu")
    assert time.perf_counter() - start < 5  # no retries against the unreachable hub
    assert lm.num_layers == 1 and lm.kv_heads == 1
