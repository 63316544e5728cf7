"""Any lm-evaluation-harness task through a compression stack (``dataset.task: lm_eval``).

lm-eval builds the requests, the few-shot contexts, the filters and the metrics; kvbench answers
the requests through its own cache engine, so every answer reads the compressed cache:

- ``generate_until``: the prompt is prefilled and compressed up to the end of the document's
  ``context`` field when the document has one and the prompt contains it; otherwise everything
  but the last ``dataset.protected_tail`` tokens is. The rest is fed after the compression and
  never evicted; greedy decoding until one of the task's stop strings, cut as lm-eval cuts it.
- ``loglikelihood``: the same split of the context; the context's last token and the
  continuation are fed after the compression, so every continuation token is scored against
  the compressed cache.
- ``loglikelihood_rolling``: lm-eval's own disjoint windows of the model's context length, each
  fed ``dataset.chunk`` tokens at a time with the stack applied after every chunk
  (compression-aware perplexity). lm-eval's HF backend scores each window in one pass, which
  never reads a compressed cache.

With the stack ``none`` the numbers equal lm-eval's ``HFLM`` on the same model and task
(tokenization, truncation and stop handling are lm-eval's or mirror ``HFLM``'s).
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvbench import metrics
from kvbench.errors import ConfigError, DatasetLoadError
from kvbench.eval import generate, loop
from kvbench.eval.protocol import Dataset, Evaluation, Metrics, Score, sha256_json
from kvbench.models import LoadedModel
from kvbench.stack import Stack

_STDERR = "_stderr"


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None, metadata_json: str, defaults: bool = True):
    """lm-eval's task index (the full index takes seconds to build: once per process)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(
        include_path=include_path, include_defaults=defaults, metadata=json.loads(metadata_json) or None
    )


def _manager(ds, names: Sequence[str] = ()):
    """The smallest index that knows every name: the include path alone when it holds them all."""
    include = None if ds.include_path is None else str(ds.include_path)
    meta = json.dumps(_container(ds.metadata), sort_keys=True)
    if include is not None:
        local = task_manager(include, meta, defaults=False)
        if names and all(n in local.all_tasks for n in names):
            return local
    return task_manager(include, meta)


def _container(node) -> dict[str, Any]:
    from omegaconf import OmegaConf

    if node is None:
        return {}
    value = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else node
    assert isinstance(value, dict)
    return {str(k): v for k, v in value.items()}


@functools.cache
def bridge_class():
    """The ``lm_eval.api.model.TemplateLM`` subclass answering requests through a stack."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class Bridge(TemplateLM):
        def __init__(self, lm: LoadedModel, stack: Stack, ds) -> None:
            super().__init__()
            tok = getattr(lm.codec, "tok", None)
            if tok is None:
                raise ConfigError(
                    f"model {lm.info.get('name')}: the lm-eval bridge needs a transformers tokenizer"
                )
            self.lm, self.stack, self.ds, self.tokenizer = lm, stack, ds, tok
            self.accounting: list[dict] = []  # one entry per request (batch numbers unique)
            self._docs: list[dict] = []

        # -- tokenization, as lm-eval's HF backend does it --------------------------------------
        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            bos = self.tokenizer.bos_token_id
            return bos if bos is not None else self.tokenizer.eos_token_id

        @property
        def max_length(self) -> int:
            return int(getattr(self.lm.model.config, "max_position_embeddings", 2048))

        @property
        def tokenizer_name(self) -> str:
            return str(self.tokenizer.name_or_path).replace("/", "__")

        def _special(self, string: str, add_special_tokens: bool | None) -> dict:
            if add_special_tokens is not None:
                return {"add_special_tokens": add_special_tokens}
            if string.startswith(self.tokenizer.decode(self.prefix_token_id)):
                return {"add_special_tokens": False}  # the text carries its BOS already
            return {}

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return self.tokenizer.encode(string, **self._special(string, add_special_tokens))

        def tok_decode(self, tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

        def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
            return self.tokenizer.apply_chat_template(
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
            )

        def _context_end(self, prompt: str, doc: dict) -> int | None:
            """Characters of ``prompt`` up to the end of the document's context, if it has one."""
            context = doc.get("context") if isinstance(doc, dict) else None
            if not isinstance(context, str) or not context or context not in prompt:
                return None
            return prompt.rfind(context) + len(context)

        def _encode_with_cut(self, prompt: str, doc: dict) -> tuple[list[int], int | None]:
            """``tok_encode(prompt)`` and how many of its tokens lie before the context's end."""
            cut = self._context_end(prompt, doc)
            if cut is None:
                return self.tok_encode(prompt), None
            enc = self.tokenizer(prompt, return_offsets_mapping=True, **self._special(prompt, None))
            return list(enc.input_ids), sum(1 for start, _ in enc.offset_mapping if start < cut)

        def _head_length(self, n_prompt: int, context_tokens: int | None) -> int:
            """Tokens of a prompt prefilled and compressed; the rest is protected."""
            if context_tokens is not None:
                return min(context_tokens, n_prompt)
            return max(0, n_prompt - int(self.ds.protected_tail))

        def _next_batch(self) -> int:
            return len({a["batch"] for a in self.accounting})

        # -- loglikelihood ----------------------------------------------------------------------
        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            self._docs = [r.doc for r in requests]
            return super().loglikelihood(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            out = []
            for i, ((context, _), context_enc, continuation_enc) in enumerate(
                tqdm(requests, desc="loglikelihood requests", leave=False, disable=None)
            ):
                whole = (context_enc + continuation_enc)[-(self.max_length + 1) :]
                inputs, n = whole[:-1], len(continuation_enc)
                dropped = len(context_enc) + len(continuation_enc) - len(whole)
                context_tokens = None
                if context:
                    _, cut = self._encode_with_cut(context.rstrip(), self._docs[i])
                    context_tokens = None if cut is None else max(0, cut - dropped)
                n_context = len(inputs) - (n - 1)  # context tokens among the inputs
                # the context's last token goes with the continuation: every continuation token
                # is scored against the compressed cache
                head = self._head_length(n_context - 1, context_tokens)
                logprobs = self._score(inputs, n, head)
                target = torch.tensor(continuation_enc)
                greedy = bool((logprobs.argmax(-1) == target).all())
                out.append((float(logprobs.gather(-1, target[:, None]).sum()), greedy))
            return out

        def _score(
            self, inputs: list[int], n: int, head: int | None, chunk: int | None = None
        ) -> torch.Tensor:
            """Log-probs ``(n, V)`` at the last ``n`` positions of ``inputs``.

            With ``head``, the first ``head`` tokens are prefilled and compressed and the rest is
            fed after, never evicted; without, ``inputs`` go in ``chunk``-token steps, the stack
            applied after each (nothing protected).
            """
            cache = loop.new_cache(self.lm, self.stack)
            size = chunk or len(inputs)
            if head is not None:
                for store in cache.stores:
                    store.set_protect_from(head)
                size = head or len(inputs)
            times: list[float] = []
            pieces = [loop.step(self.lm, cache, inputs[:size], times)]
            ref, stored = cache.reference_bytes(), cache.nbytes()
            step = len(inputs) if head is not None else size
            for at in range(size, len(inputs), step):
                pieces.append(loop.step(self.lm, cache, inputs[at : at + step], times))
            scored = generate.Generated(
                [], self._next_batch(), sum(times), [], stored, ref, cache.nbytes(), cache.reference_bytes()
            )
            self.accounting.append({**scored.accounting(), "generated": False})
            return torch.log_softmax(torch.cat(pieces)[-n:], dim=-1).cpu()

        # -- loglikelihood_rolling: compression-aware perplexity --------------------------------
        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            out = []
            chunk = int(self.ds.chunk)
            for (string,) in tqdm(
                [r.args for r in requests], desc="rolling requests", leave=False, disable=None
            ):
                total = 0.0
                for context, continuation in map(
                    make_disjoint_window,
                    get_rolling_token_windows(
                        token_list=self.tok_encode(string),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    ),
                ):
                    inputs = (context + continuation)[:-1]
                    logprobs = self._score(inputs, len(continuation), None, chunk)
                    target = torch.tensor(continuation)
                    total += float(logprobs.gather(-1, target[:, None]).sum())
                out.append(total)
            return out

        # -- generate_until ---------------------------------------------------------------------
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            eos = self.tokenizer.decode(self.eot_token_id)
            prompts, stops = [], []
            for r in requests:
                prompt, gen_kwargs = r.args
                kwargs = normalize_gen_kwargs(gen_kwargs, 256)
                if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
                    raise ConfigError(
                        f"lm-eval task {r.task_name}: asks for sampling ({gen_kwargs}); the bridge decodes "
                        "greedily; allowed do_sample=false, temperature=0"
                    )
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_new = int(kwargs.pop("max_gen_toks"))
                ids, context_tokens = self._encode_with_cut(prompt, r.doc)
                keep = self.max_length - max_new  # lm-eval's left truncation of the prompt
                if keep <= 0:
                    raise ConfigError(
                        f"lm-eval task {r.task_name}: max_gen_toks={max_new} leaves no room in the model's "
                        f"context ({self.max_length})"
                    )
                dropped = max(0, len(ids) - keep)
                ids = ids[dropped:]
                if context_tokens is not None:
                    context_tokens = max(0, context_tokens - dropped)
                head = min(self._head_length(len(ids), context_tokens), len(ids) - 1)
                done = functools.partial(_stopped, self.tokenizer, until)
                prompts.append(generate.Prompt(ids[:head], ids[head:], max_new, done))
                stops.append(until)
            first = self._next_batch()
            gens = generate.generate(
                self.lm,
                self.stack,
                prompts,
                int(self.ds.batch_size),
                bool(self.ds.query_aware),
                desc="generate_until",
            )
            texts = []
            for g, until in zip(gens, stops):
                account = g.accounting()
                self.accounting.append({**account, "batch": account["batch"] + first, "generated": True})
                texts.append(postprocess_generated_text(self.tok_decode(g.tokens), until, None))
            return texts

    return Bridge


def _stopped(tokenizer, until: list[str], tokens: list[int]) -> bool:
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return any(u and u in text for u in until)


def _headline(results: dict, task: str) -> tuple[str, float, float | None]:
    """The task's first measured metric in its own order (``metric,filter``): key, value, stderr.

    RULER reports -1 for each length it did not run; those are skipped.
    """
    row = results["results"][task]
    names = list(results.get("higher_is_better", {}).get(task, {}))
    found = [
        key
        for name in names
        for key, value in row.items()
        if _metric_key(key) == name and _STDERR not in key and isinstance(value, (int, float))
    ]
    if not found:
        raise DatasetLoadError(f"lm-eval task {task}: reported none of its metrics ({', '.join(names)})")
    key = next((k for k in found if row[k] != -1), found[0])
    stderr = row.get(key.replace(",", _STDERR + ",", 1))
    return key, float(row[key]), stderr if isinstance(stderr, (int, float)) else None


def _metric_key(key: str) -> str:
    return key.split(",", 1)[0]


def _jsonable(value: Any) -> Any:
    """``value`` in JSON's own types (tuples become lists; what JSON cannot hold, its repr)."""
    return json.loads(json.dumps(value, default=repr))


def _examples(samples: dict[str, list[dict]], results: dict) -> list[dict]:
    out = []
    for task, rows in samples.items():
        names = set(results.get("higher_is_better", {}).get(task, {}))
        for s in rows:
            example = {
                "task": task,
                "doc_id": s.get("doc_id"),
                "target": _jsonable(s.get("target")),
                "response": _jsonable(s.get("filtered_resps")),
                "doc_hash": s.get("doc_hash"),
                "prompt_hash": s.get("prompt_hash"),
            }
            example.update({m: _jsonable(s[m]) for m in sorted(names) if m in s})
            out.append(example)
    return out


def _per_example(examples: list[dict], task: str, metric: str) -> list[float] | None:
    values = [e.get(metric) for e in examples if e["task"] == task]
    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    # a corpus-level metric (bleu, perplexity) has no per-example value to pair
    return numbers if values and len(numbers) == len(values) else None


class LmEval:
    """``dataset.task: lm_eval``: lm-evaluation-harness tasks answered through the stack."""

    task = "lm_eval"

    def validate(self, cfg, order: int) -> None:
        ds = cfg.dataset
        names = list(ds.tasks or [])
        if not names or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"dataset.tasks={names!r}: name at least one lm-eval task")
        if ds.limit is not None and (
            isinstance(ds.limit, bool) or not isinstance(ds.limit, int) or ds.limit < 1
        ):
            raise ConfigError(f"dataset.limit={ds.limit!r}: must be null or an integer >= 1")
        if ds.num_fewshot is not None and (not isinstance(ds.num_fewshot, int) or ds.num_fewshot < 0):
            raise ConfigError(f"dataset.num_fewshot={ds.num_fewshot!r}: must be null or an integer >= 0")
        for key in ("chunk", "protected_tail"):
            if not isinstance(ds[key], int) or ds[key] < (1 if key == "chunk" else 0):
                raise ConfigError(
                    f"dataset.{key}={ds[key]!r}: must be an integer >= {1 if key == 'chunk' else 0}"
                )
        if ds.include_path is not None and not Path(str(ds.include_path)).is_dir():
            raise ConfigError(f"dataset.include_path={ds.include_path!r}: not a folder of task YAMLs")
        if cfg.model.source == "tiny":
            raise ConfigError(
                "model.source='tiny': the lm-eval bridge needs a transformers tokenizer (gguf or hub)"
            )
        known = _manager(ds, names).all_tasks
        for name in names:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=3)
                hint = f"; closest: {', '.join(close)}" if close else ""
                raise ConfigError(f"dataset.tasks: unknown lm-eval task {name!r}{hint}")

    def load(self, ds) -> Dataset:
        names = list(ds.tasks)
        manager = _manager(ds, names)
        docs: dict[str, Any] = {}
        configs: dict[str, Any] = {}
        for name in names:
            try:
                loaded = manager.load([name])
            except Exception as err:  # lm-eval raises what datasets or the task's own builder raises
                raise DatasetLoadError(
                    f"lm-eval task {name}: its data did not load: {type(err).__name__}: {err}"
                ) from err
            for task_name, task in loaded["tasks"].items():
                rows = list(task.eval_docs)
                docs[task_name] = [_jsonable(r) for r in rows[: ds.limit]]
                configs[task_name] = _jsonable(task.dump_config())
        source = {
            "sha256": sha256_json({"docs": docs, "configs": configs}),
            "lm_eval": importlib.metadata.version("lm_eval"),
            "tasks": sorted(docs),
            "task_versions": {
                n: c.get("metadata", {}).get("version") if isinstance(c, dict) else None
                for n, c in configs.items()
            },
            "n_examples": {n: len(v) for n, v in docs.items()},
            "include_path": None if ds.include_path is None else str(ds.include_path),
        }
        return Dataset(names, source)

    def evaluate(self, lm: LoadedModel, stack: Stack, names, ds, baseline) -> Evaluation:
        from lm_eval.evaluator import simple_evaluate

        bridge = bridge_class()(lm, stack, ds)
        results = simple_evaluate(
            model=bridge,
            tasks=list(names),
            num_fewshot=ds.num_fewshot,
            limit=ds.limit,
            task_manager=_manager(ds, names),
            log_samples=True,
            bootstrap_iters=int(ds.bootstrap_iters),
            apply_chat_template=bool(ds.apply_chat_template),
            fewshot_as_multiturn=bool(ds.apply_chat_template),
        )
        assert results is not None  # one process, rank 0
        examples = _examples(results["samples"], results)
        leaf = [t for t in results["samples"]]
        first = names[0] if names[0] in results["results"] else leaf[0]
        key, value, stderr = _headline(results, first)
        higher = results.get("higher_is_better", {}).get(first, {}).get(_metric_key(key), True)
        score = Score(
            f"{first} {_metric_key(key)}",
            value,
            higher_is_better=bool(higher),
            ci_low=None if stderr is None else value - 1.96 * stderr,
            ci_high=None if stderr is None else value + 1.96 * stderr,
        )
        table = {
            task: {
                k: v
                for k, v in row.items()
                if _metric_key(k).removesuffix(_STDERR) in results.get("higher_is_better", {}).get(task, {})
                and isinstance(v, (int, float))
            }
            for task, row in results["results"].items()
        }
        extra: dict[str, Any] = {
            "lm_eval": table,
            "lm_eval_n_shot": results.get("n-shot", {}),
            "lm_eval_versions": results.get("versions", {}),
            "requests": len(bridge.accounting),
        }
        drop = None
        if baseline:
            task = first if first in results["samples"] else leaf[0]
            mine = _per_example(examples, task, _metric_key(key))
            base = _per_example(baseline, task, _metric_key(key))
            if mine is not None and base is not None and len(mine) == len(base):
                drop = metrics.accuracy_drop(base, mine) if higher else None
        cache = generate.cache_metrics(bridge.accounting)
        generated = [a for a in bridge.accounting if a["generated"]]
        # tokens per second only where tokens were generated (a scored request generates none)
        cache["throughput_tok_s"] = (
            generate.cache_metrics(generated)["throughput_tok_s"] if generated else None
        )
        m = Metrics(score=score, n_examples=len(examples), accuracy_drop=drop, extra=extra, **cache)
        return Evaluation(m, examples, baseline=examples)


PROTOCOL = LmEval()
