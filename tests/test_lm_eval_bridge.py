"""The lm-eval bridge: any lm-evaluation-harness task answered from kvbench's compressed cache.

A tiny random llama with a byte-level transformers tokenizer stands in for a hub model; the tasks
are local ``dataset_path: json`` YAMLs written here, in lm-eval's own format.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from conftest import tiny_cfg
from helpers import make_stack
from kvbench import models, results
from kvbench.cache import engine
from kvbench.codec import HFCodec
from kvbench.compressors.quantized import QuantizedCompressor
from kvbench.errors import ConfigError, DatasetLoadError
from kvbench.eval import lm_eval_bridge
from kvbench.schedulers.streaming_llm import StreamingLLMScheduler

pytest.importorskip("lm_eval")

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "seven",
    "dogs",
    "ran",
    "over",
    "green",
    "hills",
    "near",
    "old",
    "stone",
    "walls",
]


def byte_tokenizer():
    """A transformers tokenizer over UTF-8 bytes (ids 0-255) with BOS 256 and EOS 257."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers import models as tok_models

    # byte-level BPE writes each byte as a printable character: printable bytes as themselves,
    # the others shifted past 255 in byte order
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    vocab = {chr(b if b in printable else next(shifted)): b for b in range(256)}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", name_or_path="byte-tokenizer"
    )


@pytest.fixture(scope="module")
def hf_tiny():
    """(kvbench's loaded model, the same weights as a plain transformers model, the tokenizer)."""
    cfg = tiny_cfg("llama", vocab_size=258, max_position_embeddings=512)
    engine.register()
    model = models._tiny(cfg, torch.float32).eval()
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("eager")
    model.set_attn_implementation(engine.ATTN_NAME)
    tok = byte_tokenizer()
    return models._wrap(cfg, model, HFCodec(tok)), plain, tok


def _sentence(rng, n):
    return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=rng))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Three local tasks: multiple choice (loglikelihood), generation, rolling loglikelihood."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    rng = torch.Generator().manual_seed(0)
    mc, gen, roll = [], [], []
    for i in range(6):
        context = _sentence(rng, 40)
        mc.append(
            {
                "context": context,
                "question": f"which word came {i + 1}?",
                "choices": [WORDS[i], WORDS[i + 3], WORDS[i + 6]],
                "label": i % 3,
            }
        )
        gen.append({"context": context, "question": "repeat the last word", "answer": context.split()[-1]})
        roll.append({"text": _sentence(rng, 30 + 10 * i)})
    for name, rows in (("mc", mc), ("gen", gen), ("roll", roll)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\n"
    (d / "kvb_mc.yaml").write_text(
        common
        + f"task: kvb_mc\ndataset_kwargs:\n  data_files:\n    test: {d / 'mc.jsonl'}\n"
        + "output_type: multiple_choice\n"
        + 'doc_to_text: "{{context}}\\nQuestion: {{question}}\\nAnswer:"\n'
        + 'doc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        + "metric_list:\n  - metric: acc\n"
    )
    (d / "kvb_gen.yaml").write_text(
        common
        + f"task: kvb_gen\ndataset_kwargs:\n  data_files:\n    test: {d / 'gen.jsonl'}\n"
        + "output_type: generate_until\n"
        + 'doc_to_text: "{{context}}\\nQ: {{question}}\\nA:"\ndoc_to_target: answer\n'
        + "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 12\n  do_sample: false\n"
        + "metric_list:\n  - metric: exact_match\n"
    )
    (d / "kvb_roll.yaml").write_text(
        common
        + f"task: kvb_roll\ndataset_kwargs:\n  data_files:\n    test: {d / 'roll.jsonl'}\n"
        + "output_type: loglikelihood_rolling\n"
        + 'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        + "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return d


def ds_cfg(task_dir, tasks, **over):
    base = OmegaConf.load("conf/dataset/lm_eval.yaml")
    base.tasks = tasks
    base.include_path = str(task_dir)
    base.bootstrap_iters = 0
    base.chunk = 16
    for k, v in over.items():
        base[k] = v
    return base


def run_bridge(lm, stack, ds):
    data = lm_eval_bridge.PROTOCOL.load(ds)
    return lm_eval_bridge.PROTOCOL.evaluate(lm, stack, data.data, ds, None)


def run_hflm(plain, tok, ds):
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    hflm = HFLM(pretrained=plain, tokenizer=tok, batch_size=1, max_length=512, device="cpu")
    return simple_evaluate(
        model=hflm,
        tasks=list(ds.tasks),
        limit=ds.limit,
        task_manager=lm_eval_bridge._manager(ds, list(ds.tasks)),
        log_samples=True,
        bootstrap_iters=0,
    )


def test_parity_with_hflm_at_stack_none(hf_tiny, task_dir):
    """Stack none: the bridge's loglikelihoods, generations and metrics equal lm-eval's HFLM."""
    lm, plain, tok = hf_tiny
    ds = ds_cfg(task_dir, ["kvb_mc", "kvb_gen", "kvb_roll"])
    ours = run_bridge(lm, make_stack(lm), ds)
    theirs = run_hflm(plain, tok, ds)
    samples = theirs["samples"]
    by_task = {t: [e for e in ours.examples if e["task"] == t] for t in samples}
    for task, rows in samples.items():
        assert len(rows) == len(by_task[task]) == 6
        for mine, s in zip(by_task[task], rows):
            if task == "kvb_gen":
                assert mine["response"] == s["filtered_resps"]
            else:  # loglikelihoods to float precision
                got = mine["response"]
                want = s["filtered_resps"]
                flat = lambda v: [float(x[0]) if isinstance(x, (list, tuple)) else float(x) for x in v]  # noqa: E731
                mine_v = flat(got) if isinstance(got, list) else [float(got)]
                want_v = flat(want) if isinstance(want, list) else [float(want)]
                assert mine_v == pytest.approx(want_v, abs=1e-3)
    for task in samples:
        for key, value in theirs["results"][task].items():
            if isinstance(value, float) and "stderr" not in key:
                assert ours.metrics.extra["lm_eval"][task][key] == pytest.approx(value, rel=1e-4)
    list(results.json_leaves(ours.examples, "examples"))  # JSON types only: raises on a tuple
    m = ours.metrics
    assert m.score.name == "kvb_mc acc"
    assert m.compression_prefill == pytest.approx(0.5)  # fp32 stored against the 16-bit reference
    assert m.n_examples == 18


def test_double_stack_acts_and_counts(hf_tiny, task_dir):
    """A double stack compresses every kind of request, and the bytes match the store's count."""
    lm, _, _ = hf_tiny
    ds = ds_cfg(task_dir, ["kvb_mc", "kvb_gen", "kvb_roll"])
    full = run_bridge(lm, make_stack(lm), ds)
    stack = make_stack(
        lm,
        scheduler=StreamingLLMScheduler(),
        compressor=QuantizedCompressor(),
        budget=0.25,
        sinks=4,
        window=8,
    )
    tight = run_bridge(lm, stack, ds)
    assert tight.metrics.compression_prefill > 2.0
    assert tight.metrics.kv_mem_mb_prefill < full.metrics.kv_mem_mb_prefill
    roll_full = full.metrics.extra["lm_eval"]["kvb_roll"]["word_perplexity,none"]
    roll_tight = tight.metrics.extra["lm_eval"]["kvb_roll"]["word_perplexity,none"]
    assert roll_tight != pytest.approx(roll_full, rel=1e-6)
    mc = lambda r: [e["response"] for e in r.examples if e["task"] == "kvb_mc"]  # noqa: E731
    assert mc(tight) != mc(full)
    assert tight.metrics.throughput_tok_s is not None and math.isfinite(tight.metrics.throughput_tok_s)
    base = lm_eval_bridge.PROTOCOL.evaluate(
        lm, stack, lm_eval_bridge.PROTOCOL.load(ds).data, ds, full.baseline
    )
    assert base.metrics.accuracy_drop is not None  # paired per document on kvb_mc's acc


def test_generation_batches_equal_one_by_one(hf_tiny, task_dir):
    lm, _, _ = hf_tiny
    stack = make_stack(lm, scheduler=StreamingLLMScheduler(), budget=0.25, sinks=4, window=8)
    one = run_bridge(lm, stack, ds_cfg(task_dir, ["kvb_gen"]))
    three = run_bridge(lm, stack, ds_cfg(task_dir, ["kvb_gen"], batch_size=3))
    assert [e["response"] for e in three.examples] == [e["response"] for e in one.examples]
    assert three.metrics.compression_prefill == pytest.approx(one.metrics.compression_prefill, rel=1e-4)


def test_context_split_protects_the_question(hf_tiny, task_dir):
    """Prompts whose document has a context are compressed up to the context's end only."""
    lm, _, tok = hf_tiny
    ds = ds_cfg(task_dir, ["kvb_gen"])
    bridge = lm_eval_bridge.bridge_class()(lm, make_stack(lm), ds)
    doc = {"context": "alpha beta gamma"}
    ids, cut = bridge._encode_with_cut("alpha beta gamma\nQ: why?\nA:", doc)
    assert ids == tok.encode("alpha beta gamma\nQ: why?\nA:")
    assert tok.decode(ids[:cut], skip_special_tokens=True) == "alpha beta gamma"
    assert bridge._encode_with_cut("no context here", doc)[1] is None
    assert bridge._head_length(100, None) == 100 - ds.protected_tail


def test_validation_before_any_model(task_dir, tmp_path):
    cfg = OmegaConf.create({"dataset": ds_cfg(task_dir, ["kvb_mcc"]), "model": {"source": "gguf"}})
    with pytest.raises(ConfigError, match="unknown lm-eval task 'kvb_mcc'.*kvb_mc"):
        lm_eval_bridge.PROTOCOL.validate(cfg, 1)
    cfg.dataset.tasks = ["kvb_mc"]
    cfg.dataset.limit = 0
    with pytest.raises(ConfigError, match="dataset.limit=0"):
        lm_eval_bridge.PROTOCOL.validate(cfg, 1)
    cfg.dataset.limit = None
    cfg.dataset.include_path = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="dataset.include_path"):
        lm_eval_bridge.PROTOCOL.validate(cfg, 1)


def test_missing_data_names_the_task(tmp_path):
    (tmp_path / "lost.yaml").write_text(
        "task: kvb_lost\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'absent.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{q}}"\ndoc_to_target: a\nmetric_list:\n  - metric: exact_match\n'
    )
    ds = ds_cfg(tmp_path, ["kvb_lost"])
    with pytest.raises(DatasetLoadError, match="lm-eval task kvb_lost"):
        lm_eval_bridge.PROTOCOL.load(ds)


def test_example_task_folder_loads(monkeypatch):
    """examples/lm_eval_local: the shipped local task loads through lm-eval, in the repository root."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    ds = OmegaConf.load(root / "conf/dataset/lm_eval.yaml")
    ds.include_path = str(root / "examples/lm_eval_local")
    ds.tasks = ["kvbench_kv_choice", "kvbench_kv_gen"]
    source = lm_eval_bridge.PROTOCOL.load(ds).source
    assert source["n_examples"] == {"kvbench_kv_choice": 40, "kvbench_kv_gen": 40}


def test_lm_eval_results_and_samples_reach_wandb(hf_tiny, task_dir, tmp_path, monkeypatch):
    """lm-eval's results table lands in the W&B run's summary and its samples in a table."""
    from kvbench import logger
    from wandb_files import run_summary

    lm, _, _ = hf_tiny
    result = run_bridge(lm, make_stack(lm), ds_cfg(task_dir, ["kvb_mc"]))
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = OmegaConf.create(
        {"logger": {"name": "wandb", "project": "kvbench-test", "entity": None, "mode": "offline"}}
    )
    cfg.logger.dir = str(tmp_path / "wandb")
    record = {
        "experiment": "bridge",
        "cell_id": "lmevaltest0001",
        "status": "done",
        "stack": {"order": 0},
        "config": {"dataset": {"task": "lm_eval"}},
        "metrics": result.metrics.as_dict(),
        "examples": result.examples,
    }
    logger.log(cfg, record)
    (path,) = (tmp_path / "wandb").rglob("run-*.wandb")
    summary = run_summary(path)["summary"]
    assert summary["lm_eval/kvb_mc/acc,none"] == pytest.approx(
        result.metrics.extra["lm_eval"]["kvb_mc"]["acc,none"]
    )
    assert summary["score/name"] == "kvb_mc acc"
    assert any(key.startswith("examples") for key in summary)
