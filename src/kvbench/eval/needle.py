"""Needle in a haystack (docs/methods.md): a grid of context lengths x depths x haystack offsets over
the embedded corpus; the needle at a sentence boundary; the context compressed before the
question is seen; the question never evicted; kvbench's greedy loop; substring scoring.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from kvbench import metrics
from kvbench.data import corpus
from kvbench.errors import ConfigError
from kvbench.eval import generate, retention
from kvbench.eval.protocol import Dataset, Evaluation, Metrics, Score, load_corpus
from kvbench.models import LoadedModel
from kvbench.stack import Stack

CITIES = [
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Lima",
    "Hanoi",
    "Quito",
    "Tallinn",
    "Perth",
    "Dakar",
    "Bergen",
    "Kyoto",
    "Porto",
    "Accra",
    "Cusco",
    "Riga",
    "Malmo",
]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Case:
    length: int
    depth: float
    offset: int
    city: str
    code: str


def grid(cfg) -> list[Case]:
    """Every (length, depth, offset) of the config, each with its own seeded needle."""
    rng = random.Random(cfg.seed)
    cases = []
    for length in cfg.lengths:
        for depth in cfg.depths:
            for offset in range(cfg.offsets):
                cases.append(Case(length, depth, offset, rng.choice(CITIES), str(rng.randint(1000, 9999))))
    return cases


def validate(cfg) -> None:
    for d in cfg.depths:
        if not 0.0 <= d <= 1.0:
            raise ConfigError(f"dataset.depths contains {d}: needle depths must be in 0..1")
    for length in cfg.lengths:
        if length < 64:
            raise ConfigError(f"dataset.lengths contains {length}: context lengths must be >= 64 tokens")
    if cfg.offsets < 1 or cfg.max_new_tokens < 1:
        raise ConfigError(f"dataset.offsets={cfg.offsets}, max_new_tokens={cfg.max_new_tokens}: must be >= 1")


def haystack_with_needle(codec, ids: list[int], case: Case, cfg) -> str:
    """``case.length`` corpus tokens from the case's offset, the needle at the sentence boundary
    nearest the case's depth."""
    start = case.offset * cfg.offset_stride
    text = codec.decode(ids[start : start + case.length])
    needle = cfg.needle.format(city=case.city, code=case.code)
    bounds = [m.end() for m in _SENTENCE_END.finditer(text)] or [len(text)]
    at = min(bounds, key=lambda b: abs(b - case.depth * len(text)))
    return f"{text[:at]}{needle} {text[at:]}"


def prompt(codec, hay_ids: list[int], case: Case, cfg) -> tuple[generate.Prompt, list[int] | None]:
    """The case's prompt (context compressed, question protected) and the needle's span in it."""
    context = haystack_with_needle(codec, hay_ids, case, cfg)
    head, question = codec.prompt_parts(context, cfg.question.format(city=case.city))
    needle_ids = codec.encode(cfg.needle.format(city=case.city, code=case.code))
    return generate.Prompt(head, question, cfg.max_new_tokens), retention.needle_span(head, needle_ids)


def evaluate(
    lm: LoadedModel, stack: Stack, corpus: str, cfg, baseline: list[dict] | None
) -> tuple[Metrics, list[dict]]:
    """Every case of the grid, ``cfg.batch_size`` at a time; returns (metrics, per-case results)."""
    longest = max(cfg.lengths) + (cfg.offsets - 1) * cfg.offset_stride
    hay_ids = lm.codec.encode(corpus[: longest * 12])
    if len(hay_ids) < longest:
        raise ConfigError(
            f"dataset {cfg.name!r}: haystack has {len(hay_ids)} tokens, the grid needs {longest}"
        )
    cases = grid(cfg)
    prompts, spans = zip(*(prompt(lm.codec, hay_ids, c, cfg) for c in cases))
    kept: dict[int, tuple] = {}

    def measure_retention(cache, row: int, index: int) -> None:
        kept[index] = retention.retention(cache, len(prompts[index].head), spans[index], row)

    gens = generate.generate(
        lm, stack, prompts, cfg.get("batch_size", 1), cfg.query_aware, measure_retention, "needle cases"
    )
    results = []
    for i, (case, p, g) in enumerate(zip(cases, prompts, gens)):
        answer = lm.codec.decode(g.tokens)
        results.append(
            {
                "length": case.length,
                "depth": case.depth,
                "offset": case.offset,
                "context_tokens": len(p.head),
                "expected": case.code,
                "answer": answer,
                "correct": float(case.code in answer),
                **g.accounting(),
                "kept_by_layer_head": kept[i][0],
                "needle_kept_by_layer_head": kept[i][1],
            }
        )
    return summarize(results, baseline), results


def summarize(cases: list[dict], baseline: list[dict] | None) -> Metrics:
    correct = [c["correct"] for c in cases]
    n_ok = int(sum(correct))
    lo, hi = metrics.wilson_interval(n_ok, len(cases))
    return Metrics(
        score=Score("needle_accuracy", n_ok / len(cases), True, lo, hi),
        n_examples=len(cases),
        accuracy_drop=metrics.accuracy_drop([b["correct"] for b in baseline], correct) if baseline else None,
        **generate.cache_metrics(cases),
    )


class Needle:
    """``dataset.task: needle``: the needle-in-a-haystack grid over a corpus."""

    task = "needle"

    def validate(self, cfg, order: int) -> None:
        validate(cfg.dataset)
        corpus.validate(cfg.dataset)

    def load(self, ds) -> Dataset:
        return load_corpus(ds)

    def evaluate(self, lm: LoadedModel, stack: Stack, text: str, ds, baseline) -> Evaluation:
        m, cases = evaluate(lm, stack, text, ds, baseline)
        return Evaluation(m, generate.recorded(cases), baseline=cases)


PROTOCOL = Needle()
