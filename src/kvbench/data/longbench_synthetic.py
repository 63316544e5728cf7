"""kvbench's own LongBench-format set, built offline from the embedded corpus (not LongBench).

Three tasks after LongBench's synthetic recipes, over paragraphs of Python's help pages:

- ``passage_retrieval``: ``dataset.passages`` numbered paragraphs and one sentence taken from one
  of them; the answer is ``Paragraph k``. LongBench's ``passage_retrieval_en`` prompt (with the
  number and the source of the paragraphs made true) and its retrieval score.
- ``passage_count``: 2 to ``dataset.passages`` distinct paragraphs, shuffled with 1 to as many
  repeats; the answer is the number of distinct ones (never the list's length). LongBench's
  ``passage_count`` prompt (source made true) and count score.
- ``kv_retrieval``: ``dataset.pairs`` lines giving keys (English words) distinct four-digit
  numbers; the answer is one key's value, scored by LongBench's count score (numbers in the
  prediction that match).

Examples carry LongBench's fields (``input``, ``context``, ``answers``, ``length``, ``dataset``,
``language``, ``all_classes``, ``_id``) and are fixed by ``dataset.seed``.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace
from functools import cache

from kvbench.data import corpus
from kvbench.data import longbench_tasks as tasks
from kvbench.errors import ConfigError

NAMES = ("passage_retrieval", "passage_count", "kv_retrieval")
KV_TEMPLATE = (
    "Below is a list of keys and their numbers. Find the number of the key asked for.\n\n"
    "{{context}}\n\nWhat is the number of the key {{question}}? Answer with the number only."
)
KEYS = tuple(
    [
        "apple",
        "anchor",
        "basket",
        "candle",
        "copper",
        "desert",
        "falcon",
        "garden",
        "harbor",
        "island",
        "jacket",
        "kettle",
        "lantern",
        "meadow",
        "needle",
        "orchard",
        "pepper",
        "quartz",
        "ribbon",
        "saddle",
        "timber",
        "velvet",
        "walnut",
        "willow",
    ]
)
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def check_names(names: list[str]) -> None:
    for name in names:
        if name not in NAMES:
            raise ConfigError(
                f"dataset.tasks contains {name!r}: allowed for the synthetic set: {', '.join(NAMES)}"
            )


def _lb_template(name: str, old: str, new: str) -> tasks.TaskDef:
    lb = tasks.load(name, False)
    if old not in lb.template:
        raise RuntimeError(f"lm-eval's {name} prompt changed: {old!r} not found in it")
    return replace(lb, template=lb.template.replace(old, new))


@cache
def task(name: str, passages: int = 6) -> tasks.TaskDef:
    """The task's definition: LongBench's prompt and metric where LongBench has the task."""
    category = "Synthetic Tasks"
    if name == "passage_retrieval":
        td = _lb_template(
            "passage_retrieval_en", "Here are 30 paragraphs from Wikipedia", f"Here are {passages} paragraphs"
        )
    elif name == "passage_count":
        td = _lb_template("passage_count", "sourced from Wikipedia", "sourced from Python's documentation")
    else:
        td = replace(tasks.load("passage_count", False), template=KV_TEMPLATE, max_gen_toks=16)
    return replace(td, name=name, lm_eval_task=f"kvbench_{name}", category=category)


@cache
def paragraphs(min_words: int = 40, max_words: int = 90) -> tuple[str, ...]:
    """Prose paragraphs of the embedded corpus (no code listings), each of a modest length."""
    text = corpus.load_text({"name": "pydoc", "source": "pydoc"})
    out = []
    for para in text.split("\n\n"):
        para = " ".join(para.split())
        words = para.split()
        if min_words <= len(words) <= max_words and para[-1:] in ".:" and ">>>" not in para:
            out.append(para)
    return tuple(dict.fromkeys(out))


def _retrieval(rng: random.Random, n: int, i: int) -> dict:
    chosen = rng.sample(paragraphs(), n)
    answer = rng.randrange(n)
    sentences = [s for s in _SENTENCE.split(chosen[answer]) if len(s.split()) >= 6] or [chosen[answer]]
    context = "\n\n".join(f"Paragraph {k + 1}: {p}" for k, p in enumerate(chosen))
    return _doc("passage_retrieval", i, context, max(sentences, key=len), [f"Paragraph {answer + 1}"])


def _count(rng: random.Random, n: int, i: int) -> dict:
    """``n`` distinct paragraphs at most, each listed once or more: the answer is not the list's length."""
    unique = rng.randint(2, max(2, n))
    chosen = rng.sample(paragraphs(), unique)
    listed = chosen + [rng.choice(chosen) for _ in range(rng.randint(1, unique))]
    rng.shuffle(listed)
    context = "\n\n".join(f"Paragraph {k + 1}: {p}" for k, p in enumerate(listed))
    return _doc("passage_count", i, context, "", [str(unique)])


def _kv(rng: random.Random, pairs: int, i: int) -> dict:
    keys = rng.sample(KEYS, min(pairs, len(KEYS)))
    values = [str(v) for v in rng.sample(range(1000, 10000), pairs)]  # distinct, four digits
    asked = rng.randrange(pairs)
    context = "\n".join(f"The number of the key {k} is {v}." for k, v in zip(keys, values))
    return _doc("kv_retrieval", i, context, keys[asked], [values[asked]])


def _doc(name: str, i: int, context: str, question: str, answers: list[str]) -> dict:
    return {
        "input": question,
        "question": question,
        "context": context,
        "answers": answers,
        "length": len(context.split()),
        "dataset": f"kvbench_{name}",
        "language": "en",
        "all_classes": None,
        "_id": f"kvbench_{name}_{i}",
    }


def examples(name: str, ds, limit: int | None) -> list[dict]:
    """``limit`` examples of one task (``dataset.size`` without a limit), fixed by ``dataset.seed``."""
    rng = random.Random(f"{ds.seed}:{name}")
    make = {"passage_retrieval": _retrieval, "passage_count": _count, "kv_retrieval": _kv}[name]
    size = ds.pairs if name == "kv_retrieval" else ds.passages
    return [make(rng, size, i) for i in range(limit if limit is not None else ds.size)]
