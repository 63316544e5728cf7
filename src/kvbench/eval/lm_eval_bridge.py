"""Any lm-evaluation-harness task through a compression stack (``dataset.task: lm_eval``).

lm-eval builds the requests, the few-shot contexts, the filters and the metrics; kvbench answers
the requests through its own cache engine (:mod:`kvbench.eval.lm_eval_model`), so every answer
reads the compressed cache:

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

from omegaconf import OmegaConf

from kvbench import metrics
from kvbench.errors import ConfigError, DatasetLoadError
from kvbench.eval import generate
from kvbench.eval.lm_eval_model import bridge_class
from kvbench.eval.protocol import Dataset, Evaluation, Metrics, Score, check_int, sha256_json
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
    metadata = {} if ds.metadata is None else OmegaConf.to_container(ds.metadata, resolve=True)
    meta = json.dumps(metadata, sort_keys=True)
    if include is not None:
        local = task_manager(include, meta, defaults=False)
        if names and all(n in local.all_tasks for n in names):
            return local
    return task_manager(include, meta)


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
        check_int(ds, "limit", 1, nullable=True)
        check_int(ds, "num_fewshot", 0, nullable=True)
        check_int(ds, "chunk", 1)
        check_int(ds, "protected_tail", 0)
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
        leaf = list(results["samples"])
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
