"""LongBench v2 through a compression stack, by v2's own generate-then-extract protocol.

Per example, LongBench v2's rules (its ``pred.py`` and ``result.py``):

1. the 0-shot prompt is lm-eval's ``longbench2`` ``doc_to_text`` with its closing ``Answer:``
   replaced by v2's instruction ``Format your response as follows: "The correct answer is (insert
   answer here)".``; the context and the choices are stripped of surrounding blanks, as v2 does;
2. a prompt longer than ``dataset.max_length`` tokens keeps its first and last halves, then the
   model's chat template wraps it; the context is prefilled and compressed, the question, choices
   and instruction after it are protected (all of this is ``longbench.build``);
3. greedy decoding of up to 128 new tokens;
4. the letter is read by v2's pattern ``The correct answer is (X)`` (then the same without the
   parentheses) once every ``*`` is removed; a prediction it cannot read is wrong, and counted.

Accuracy is 100 x the share answered correctly, overall, per difficulty and per length. lm-eval's
``longbench2`` scores the log-likelihood of each letter after ``Answer:`` instead; docs/methods.md
says why kvbench runs v2's own protocol.
"""

from __future__ import annotations

import importlib.metadata
import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from kvbench import metrics
from kvbench.data import longbench_tasks as tasks
from kvbench.data import longbench_v2 as data
from kvbench.errors import ConfigError
from kvbench.eval import generate, longbench
from kvbench.eval.protocol import Dataset, Evaluation, Metrics, Score, check_int, sha256_json
from kvbench.models import LoadedModel
from kvbench.stack import Stack

MAX_NEW = 128  # v2's max_new_tokens without chain of thought
CUE = "Answer:"
INSTRUCTION = 'Format your response as follows: "The correct answer is (insert answer here)".'
PATTERNS = (re.compile(r"The correct answer is \(([A-D])\)"), re.compile(r"The correct answer is ([A-D])"))


def lm_eval_file() -> Path:
    """lm-eval's shared LongBench v2 task file (its prompt, hub dataset and version)."""
    return tasks.tasks_dir().parent / "longbench2" / "_longbench_common_yaml"


@cache
def lm_eval_task() -> dict[str, Any]:
    path = lm_eval_file()
    if not path.is_file():
        raise ConfigError(f"dataset.task=longbench_v2 needs lm-eval's longbench2 task: no file {path}")
    return yaml.safe_load(path.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def template() -> str:
    """v2's 0-shot prompt as a Jinja template: lm-eval's ``doc_to_text``, v2's instruction for its cue."""
    text = str(lm_eval_task()["doc_to_text"])
    if not text.endswith(CUE):
        raise ConfigError(
            f"lm-eval's LongBench v2 prompt in {lm_eval_file()} no longer ends in {CUE!r}: "
            "kvbench cannot put v2's instruction in its place"
        )
    return text[: -len(CUE)] + INSTRUCTION


def task_def() -> tasks.TaskDef:
    """LongBench v2 as a generation task for ``longbench.build``: chat template on, no first-line cut."""
    return tasks.TaskDef(
        name="longbench_v2",
        lm_eval_task="longbench2",
        template=template(),
        max_gen_toks=MAX_NEW,
        until=(),
        score=score,
        metric="accuracy",
        version=lm_eval_task().get("metadata", {}).get("version"),
        category="LongBench v2",
        hf_path=data.HF_PATH,
        split=data.SPLIT,
    )


def fixed_words(text: str) -> int:
    """Words of a template outside its ``{{...}}`` fields."""
    return len(re.sub(r"\{\{.*?\}\}", " ", text).split())


def fields(doc: dict[str, Any]) -> dict[str, Any]:
    """What the template reads; v2 strips the context and the choices (the template, the question)."""
    return {
        "context": doc["context"].strip(),
        "question": doc["question"],
        "choices": [doc[f"choice_{c}"].strip() for c in data.CHOICES],
        "_id": doc.get("_id"),  # named by errors
    }


def extract(prediction: str) -> str | None:
    """The answered letter by v2's pattern (the first match), or None when it does not parse."""
    text = prediction.replace("*", "")
    for pattern in PATTERNS:
        if found := pattern.search(text):
            return found.group(1)
    return None


def score(doc: dict[str, Any], predictions: list[str]) -> dict[str, float]:
    return {"score": float(extract(predictions[0]) == doc["answer"])}


def evaluate(
    lm: LoadedModel, stack: Stack, docs: list[dict[str, Any]], ds, baseline: list[dict] | None
) -> tuple[Metrics, list[dict]]:
    td = task_def()
    built = longbench.build_all(lm.codec, [(td, fields(doc)) for doc in docs], longbench.max_length(ds, lm))
    gens = generate.generate(
        lm, stack, [p for p, _ in built], ds.batch_size, ds.query_aware, desc=f"{ds.name} examples"
    )
    examples = []
    for doc, (p, full), g in zip(docs, built, gens):
        prediction = lm.codec.decode(g.tokens)
        letter = extract(prediction)
        examples.append(
            {
                "id": doc["_id"],
                "domain": doc["domain"],
                "sub_domain": doc["sub_domain"],
                "difficulty": doc["difficulty"],
                "length": doc["length"],
                "prediction": prediction,
                "extracted": letter,
                "answer": doc["answer"],
                "correct": letter == doc["answer"],
                "prompt_tokens": full,
                "prompt_tokens_truncated": len(p.head) + len(p.tail),
                "context_tokens": len(p.head),
                "new_tokens": len(g.tokens),
                **g.accounting(),
            }
        )
    return summarize(examples, baseline), examples


def _accuracy(rows: list[dict]) -> dict[str, Any]:
    return {"score": 100.0 * sum(r["correct"] for r in rows) / len(rows) if rows else None, "n": len(rows)}


def summarize(examples: list[dict], baseline: list[dict] | None) -> Metrics:
    """Accuracy (Wilson interval) overall, per difficulty and length; the paired drop in points."""
    correct = [float(e["correct"]) for e in examples]
    n_ok = int(sum(correct))
    lo, hi = metrics.wilson_interval(n_ok, len(examples))
    drop = metrics.accuracy_drop([float(b["correct"]) for b in baseline], correct) if baseline else None
    extra = {
        "unparsed": sum(e["extracted"] is None for e in examples),
        "by_difficulty": {
            d: _accuracy([e for e in examples if e["difficulty"] == d]) for d in data.DIFFICULTIES
        },
        "by_length": {n: _accuracy([e for e in examples if e["length"] == n]) for n in data.LENGTHS},
    }
    return Metrics(
        score=Score("longbench_v2_accuracy", 100.0 * n_ok / len(examples), True, 100.0 * lo, 100.0 * hi),
        n_examples=len(examples),
        accuracy_drop=drop,
        extra=extra,
        **generate.cache_metrics(examples),
    )


class LongBenchV2:
    """``dataset.task: longbench_v2``: LongBench v2's multiple-choice questions, generate then extract."""

    task = "longbench_v2"

    def validate(self, cfg, order: int) -> None:
        ds = cfg.dataset
        check_int(ds, "limit", 1, nullable=True)
        if ds.max_length is not None:
            floor = fixed_words(template())
            if (
                isinstance(ds.max_length, bool)
                or not isinstance(ds.max_length, int)
                or ds.max_length <= floor
            ):
                raise ConfigError(
                    f"dataset.max_length={ds.max_length!r}: below the fixed text of LongBench v2's prompt "
                    f"(at least {floor} tokens); allowed: an integer > {floor}, or null"
                )
        if ds.path is not None:
            data.check_local(ds.path)

    def load(self, ds) -> Dataset:
        if ds.path is not None:
            docs = data.read_local(ds.path, ds.name, ds.limit)
        else:
            docs = data.read_hub(ds.name, ds.revision, ds.limit)
        td = task_def()
        prompt = {"template": td.template, "max_new": td.max_gen_toks, "lm_eval_task": td.lm_eval_task}
        source = {
            "sha256": sha256_json({"docs": docs, "prompt": prompt}),
            "path": None if ds.path is None else str(ds.path),
            "hf_path": None if ds.path is not None else data.HF_PATH,
            "revision": ds.revision,
            "lm_eval": importlib.metadata.version("lm_eval"),
            "lm_eval_task_version": td.version,
            **prompt,
            "n_examples": len(docs),
        }
        return Dataset(docs, source)

    def evaluate(self, lm: LoadedModel, stack: Stack, docs, ds, baseline) -> Evaluation:
        m, examples = evaluate(lm, stack, docs, ds, baseline)
        stored = generate.recorded(examples)
        return Evaluation(m, stored, baseline=stored)


PROTOCOL = LongBenchV2()
