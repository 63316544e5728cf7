"""LongBench and LongBench-E through a compression stack (and kvbench's own LongBench-format set).

Per example, LongBench's rules (its ``pred.py`` and ``eval.py``) over lm-eval's task definitions:

1. the prompt is lm-eval's ``doc_to_text``; if longer than ``dataset.max_length`` tokens it keeps
   its first and last ``max_length // 2`` tokens (middle truncation);
2. the model's chat template wraps it, except for trec, triviaqa, samsum, lsht, lcc, repobench-p;
3. the prompt is split at the end of the document's ``context``: the part before is prefilled and
   compressed, the rest (question, answer cue) is fed afterwards and never evicted
   (``dataset.query_aware=true`` prefills it with the context instead);
4. greedy decoding up to the task's ``max_gen_toks``; trec, triviaqa, samsum and lsht keep the
   prediction's first line;
5. lm-eval's metric function scores it: the max over the gold answers. A task's score is 100 x
   the mean; categories and the overall score are means over tasks; LongBench-E adds length buckets.
"""

from __future__ import annotations

import importlib.metadata
from collections import defaultdict
from typing import Any

from kvbench import metrics
from kvbench.data import longbench as data
from kvbench.data import longbench_synthetic as synthetic
from kvbench.data import longbench_tasks as tasks
from kvbench.errors import ConfigError
from kvbench.eval import generate
from kvbench.eval.protocol import Dataset, Evaluation, Metrics, Score, check_int, sha256_json
from kvbench.models import LoadedModel
from kvbench.stack import Stack

SUITES = ("longbench", "longbench_e", "synthetic")
_CONTEXT_END = "\u0000KVBENCH_CONTEXT_END\u0000"
HEADROOM = 500  # LongBench's model2maxlen: a model's context less 500 tokens (31500 for 32k)


def task_defs(ds) -> list[tasks.TaskDef]:
    if ds.suite == "synthetic":
        return [synthetic.task(name, ds.passages) for name in ds.tasks]
    return [tasks.load(name, ds.suite == "longbench_e") for name in ds.tasks]


def render(td: tasks.TaskDef, doc: dict) -> tuple[str, int]:
    """The task's prompt for ``doc`` and the character offset where its context ends."""
    from lm_eval.utils import apply_template  # lm-eval's own Jinja rendering of doc_to_text

    text = apply_template(td.template, {**doc, "context": doc["context"] + _CONTEXT_END})
    cut = text.find(_CONTEXT_END)
    if cut < 0:
        raise ConfigError(f"task {td.name}: its prompt template has no {{{{context}}}}")
    return text.replace(_CONTEXT_END, "", 1), cut


def truncate_middle(codec, ids: list[int], split: int, max_length: int) -> tuple[str, int]:
    """LongBench's truncation: the text of the first and last ``max_length // 2`` tokens, and where
    the context's end (token ``split``) lands in it (at the cut when the cut removed it)."""
    half = max_length // 2
    first, last = ids[:half], ids[len(ids) - half :]
    head = codec.decode(first)
    if split <= half:
        return head + codec.decode(last), len(codec.decode(ids[:split]))
    kept_from = len(ids) - half
    cut = len(head) + (len(codec.decode(last[: split - kept_from])) if split > kept_from else 0)
    return head + codec.decode(last), cut


def build(codec, td: tasks.TaskDef, doc: dict, max_length: int) -> tuple[generate.Prompt, int]:
    """The example's prompt (compressed head, protected tail) and its length before truncation."""
    text, cut = render(td, doc)
    before, after = codec.encode_split(text, cut)
    full = len(before) + len(after)
    if full > max_length:
        text, cut = truncate_middle(codec, before + after, len(before), max_length)
    templated = codec.chat(text) if td.chat else None
    prefix: list[int] = []
    if templated is not None:
        text, offset = templated
        cut += offset
    else:
        prefix = codec.special_prefix()
    head, tail = codec.encode_split(text, cut)
    head = prefix + head
    if not tail:  # the next-token logits come from the tail's last token
        head, tail = head[:-1], head[-1:]
    done = (lambda toks: "\n" in codec.decode(toks).lstrip("\n")) if td.first_line else None
    return generate.Prompt(head, tail, td.max_gen_toks, done), full


def build_all(
    codec, items: list[tuple[tasks.TaskDef, dict]], limit: int
) -> list[tuple[generate.Prompt, int]]:
    """:func:`build` for every (task, document); an error when a truncated prompt's text after its
    context does not fit in the kept last half."""
    built = [build(codec, td, doc, limit) for td, doc in items]
    for (td, doc), (p, full) in zip(items, built):
        if full > limit and len(p.tail) > limit // 2:
            raise ConfigError(
                f"dataset.max_length={limit}: task {td.name} example {doc.get('_id')}: the text after its "
                f"context takes {len(p.tail)} tokens, more than the kept last half; raise dataset.max_length"
            )
    return built


def postprocess(td: tasks.TaskDef, prediction: str) -> str:
    return prediction.lstrip("\n").split("\n")[0] if td.first_line else prediction


def max_length(ds, lm: LoadedModel) -> int:
    if ds.max_length is not None:
        return int(ds.max_length)
    context = getattr(lm.model.config, "max_position_embeddings", None)
    if not context:
        raise ConfigError(
            f"dataset.max_length=null: model {lm.info.get('name')} states no context length; set it"
        )
    return int(context) - HEADROOM


def evaluate(
    lm: LoadedModel, stack: Stack, docs: dict[str, list[dict]], ds, baseline
) -> tuple[Metrics, list[dict]]:
    defs = {td.name: td for td in task_defs(ds)}
    items = [(td, doc) for td in defs.values() for doc in docs[td.name]]
    built = build_all(lm.codec, items, max_length(ds, lm))
    gens = generate.generate(
        lm, stack, [p for p, _ in built], ds.batch_size, ds.query_aware, desc=f"{ds.name} examples"
    )
    examples = []
    for (td, doc), (p, full), g in zip(items, built, gens):
        prediction = postprocess(td, lm.codec.decode(g.tokens))
        example = {
            "task": td.name,
            "id": doc.get("_id"),
            "prediction": prediction,
            "answers": doc["answers"],
            "score": float(td.score(doc, [prediction])["score"]),
            "prompt_tokens": full,
            "prompt_tokens_truncated": len(p.head) + len(p.tail),
            "context_tokens": len(p.head),
            "length": doc.get("length"),
            "new_tokens": len(g.tokens),
            **g.accounting(),
        }
        if ds.suite == "longbench_e":
            example["bucket"] = tasks.bucket(int(doc["length"]))
        examples.append(example)
    return summarize(examples, baseline, defs), examples


def _mean_pct(values: list[float]) -> float:
    return 100.0 * sum(values) / len(values)


def summarize(examples: list[dict], baseline: list[dict] | None, defs: dict[str, tasks.TaskDef]) -> Metrics:
    """Scores per task (100 x mean), per category and overall (means over tasks), drops per task."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for e in examples:
        by_task[e["task"]].append(e)
    base_by_task: dict[str, list[dict]] = defaultdict(list)
    for e in baseline or []:
        base_by_task[e["task"]].append(e)
    per_task: dict[str, dict[str, Any]] = {}
    cats: dict[str, list[float]] = defaultdict(list)
    for name, rows in by_task.items():
        score = _mean_pct([r["score"] for r in rows])
        cats[defs[name].category].append(score)
        per_task[name] = {
            "score": score,
            "n": len(rows),
            "metric": defs[name].metric,
            "category": defs[name].category,
        }
        if baseline:
            per_task[name]["drop"] = metrics.accuracy_drop(
                [b["score"] for b in base_by_task[name]], [r["score"] for r in rows]
            )
    overall = sum(e["score"] for e in per_task.values()) / len(per_task)
    extra: dict = {
        "tasks": per_task,
        "categories": {c: sum(v) / len(v) for c, v in cats.items()},
    }
    if any("bucket" in e for e in examples):
        extra["buckets"] = _buckets(by_task)
    drop = None
    if baseline:
        drop = metrics.task_mean_drop(
            {
                t: ([b["score"] for b in base_by_task[t]], [r["score"] for r in rows])
                for t, rows in by_task.items()
            }
        )
    return Metrics(
        score=Score("longbench_score", overall, higher_is_better=True),
        n_examples=len(examples),
        accuracy_drop=drop,
        extra=extra,
        **generate.cache_metrics(examples),
    )


def _buckets(by_task: dict[str, list[dict]]) -> dict[str, dict]:
    """LongBench-E: per length bucket, each task's score and their mean."""
    out: dict[str, dict] = {}
    for label, _, _ in tasks.LENGTH_BUCKETS:
        in_bucket = {t: [r["score"] for r in rows if r["bucket"] == label] for t, rows in by_task.items()}
        scores = {t: _mean_pct(values) for t, values in in_bucket.items() if values}
        if scores:
            out[label] = {"score": sum(scores.values()) / len(scores), "tasks": scores}
    return out


def _fixed_words(template: str) -> int:
    return len(template.replace("{{context}}", " ").replace("{{question}}", " ").split())


class LongBench:
    """``dataset.task: longbench``: LongBench v1, LongBench-E, or kvbench's own synthetic set."""

    task = "longbench"

    def validate(self, cfg, order: int) -> None:
        ds = cfg.dataset
        if ds.suite not in SUITES:
            raise ConfigError(f"dataset.suite={ds.suite!r}: allowed {', '.join(SUITES)}")
        names = list(ds.tasks or [])
        if not names:
            raise ConfigError("dataset.tasks=[]: name at least one task")
        if ds.suite == "synthetic":
            synthetic.check_names(names)
        else:
            tasks.check_names(names, ds.suite == "longbench_e")
        check_int(ds, "limit", 1, nullable=True)
        if ds.max_length is not None:
            for td in task_defs(ds):
                floor = _fixed_words(td.template)
                if not isinstance(ds.max_length, int) or ds.max_length <= floor:
                    raise ConfigError(
                        f"dataset.max_length={ds.max_length!r}: below the fixed text of task {td.name} "
                        f"(at least {floor} tokens); allowed: an integer > {floor}, or null"
                    )
        if ds.path is not None and ds.suite != "synthetic":
            data.check_local(ds.path, names, ds.suite == "longbench_e")

    def load(self, ds) -> Dataset:
        limit = ds.limit
        defs = task_defs(ds)
        if ds.suite == "synthetic":
            docs = {td.name: synthetic.examples(td.name, ds, limit) for td in defs}
        elif ds.path is not None:
            e = ds.suite == "longbench_e"
            docs = {
                td.name: data.read_local(data.task_file(ds.path, td.name, e), ds.name, limit) for td in defs
            }
        else:
            docs = {
                td.name: data.read_hub(ds.name, td.hf_path, td.hf_name, td.split, ds.revision, limit)
                for td in defs
            }
        lm_eval_version = importlib.metadata.version("lm_eval")
        definitions = {
            td.name: {
                "lm_eval_task": td.lm_eval_task,
                "version": td.version,
                "template": td.template,
                "max_gen_toks": td.max_gen_toks,
                "metric": td.metric,
            }
            for td in defs
        }
        source = {
            "sha256": sha256_json({"docs": docs, "tasks": definitions}),
            "suite": ds.suite,
            "path": None if ds.path is None else str(ds.path),
            "revision": ds.revision,
            "lm_eval": lm_eval_version,
            "task_versions": {n: d["version"] for n, d in definitions.items()},
            "n_examples": {n: len(v) for n, v in docs.items()},
        }
        return Dataset(docs, source)

    def evaluate(self, lm: LoadedModel, stack: Stack, docs, ds, baseline) -> Evaluation:
        m, examples = evaluate(lm, stack, docs, ds, baseline)
        stored = generate.recorded(examples)
        return Evaluation(m, stored, baseline=stored)


PROTOCOL = LongBench()
