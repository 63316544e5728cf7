"""Needle in a haystack (METHODS.md): a grid of context lengths x depths x haystack offsets over
the embedded corpus; the needle at a sentence boundary; the context compressed before the
question is seen; the question never evicted; kvbench's greedy loop; substring scoring.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from kvbench import metrics
from kvbench.errors import ConfigError
from kvbench.eval import loop, retention
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


def run_case(lm: LoadedModel, stack: Stack, hay_ids: list[int], case: Case, cfg) -> dict:
    """Prefill the context, compress, feed the question (protected), decode greedily.

    With ``query_aware`` the question is prefilled with the context (still protected), so
    score-based techniques see it before compressing.
    """
    context = haystack_with_needle(lm.codec, hay_ids, case, cfg)
    head, question = lm.codec.prompt_parts(context, cfg.question.format(city=case.city))
    cache = loop.new_cache(lm, stack)
    for store in cache.stores:
        store.set_protect_from(len(head))  # the question and the answer are never evicted
    ttft: list[float] = []
    if cfg.query_aware:
        logits = loop.step(lm, cache, head + question, ttft)
        ref, stored = cache.reference_bytes(), cache.nbytes()
    else:
        loop.step(lm, cache, head, ttft)
        ref, stored = cache.reference_bytes(), cache.nbytes()
    needle_ids = lm.codec.encode(cfg.needle.format(city=case.city, code=case.code))
    kept, needle_kept = retention.retention(cache, len(head), retention.needle_span(head, needle_ids))
    if not cfg.query_aware:
        logits = loop.step(lm, cache, question, ttft)
    tpot: list[float] = []
    tokens = loop.greedy(lm, cache, logits[-1], cfg.max_new_tokens, tpot)
    answer = lm.codec.decode(tokens)
    return {
        "length": case.length,
        "depth": case.depth,
        "offset": case.offset,
        "context_tokens": len(head),
        "expected": case.code,
        "answer": answer,
        "correct": float(case.code in answer),
        "ttft": sum(ttft),
        "tpot": tpot,
        "bytes_prefill": stored,
        "reference_prefill": ref,
        "compression_prefill": ref / stored,
        "bytes_end": cache.nbytes(),
        "reference_end": cache.reference_bytes(),
        "compression_end": cache.reference_bytes() / cache.nbytes(),
        "kept_by_layer_head": kept,
        "needle_kept_by_layer_head": needle_kept,
    }


def evaluate(
    lm: LoadedModel, stack: Stack, corpus: str, cfg, baseline: list[dict] | None
) -> tuple[dict, list[dict]]:
    longest = max(cfg.lengths) + (cfg.offsets - 1) * cfg.offset_stride
    hay_ids = lm.codec.encode(corpus[: longest * 12])
    if len(hay_ids) < longest:
        raise ConfigError(
            f"dataset {cfg.name!r}: haystack has {len(hay_ids)} tokens, the grid needs {longest}"
        )
    cases = [
        run_case(lm, stack, hay_ids, c, cfg)
        for c in tqdm(grid(cfg), desc="needle cases", leave=False, disable=None)
    ]
    return summarize(cases, baseline), cases


def _total(cases: list[dict], key: str) -> float:
    return float(sum(c[key] for c in cases))


def summarize(cases: list[dict], baseline: list[dict] | None) -> dict:
    correct = [c["correct"] for c in cases]
    tpot = [t for c in cases for t in c["tpot"]]
    n_ok = int(sum(correct))
    lo, hi = metrics.wilson_interval(n_ok, len(cases))
    gen_time = sum(c["ttft"] + sum(c["tpot"]) for c in cases)
    return {
        "score": {
            "name": "needle_accuracy",
            "value": n_ok / len(cases),
            "higher_is_better": True,
            "ci_low": lo,
            "ci_high": hi,
        },
        "accuracy_drop": metrics.accuracy_drop([b["correct"] for b in baseline], correct)
        if baseline
        else None,
        "delta_nll": None,
        "kl": None,
        "top1_agreement": None,
        "kv_hit": None,
        "kv_hit_excl": None,
        # over cases of several lengths: all reference bytes over all stored bytes, so compression
        # x the mean stored MB is the mean reference MB (a mean of ratios would not be)
        "compression_prefill": _total(cases, "reference_prefill") / _total(cases, "bytes_prefill"),
        "compression_mean": _total(cases, "reference_end") / _total(cases, "bytes_end"),
        "kv_mem_mb_prefill": float(np.mean([c["bytes_prefill"] for c in cases])) / 2**20,
        "kv_mem_mb_peak": max(max(c["bytes_prefill"], c["bytes_end"]) for c in cases) / 2**20,
        "ttft_s": float(np.mean([c["ttft"] for c in cases])),
        "tpot_s": float(np.mean(tpot)) if tpot else None,
        "throughput_tok_s": sum(len(c["tpot"]) + 1 for c in cases) / gen_time,
        "n_examples": len(cases),
    }
