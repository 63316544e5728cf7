"""The protocol interface: one module per evaluation, looked up by ``dataset.task``.

A protocol validates its dataset config (before any model loads), loads its examples, and
evaluates a stack against an optional full-cache baseline, returning :class:`Metrics` (the keys
every protocol shares, typed once here) and per-example results. ``run.py``, ``config.py`` and
``baseline.py`` look a protocol up with :func:`get` and never branch on the task again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Protocol

from omegaconf import DictConfig

from kvbench.data import corpus
from kvbench.errors import ConfigError

# task name -> module defining ``PROTOCOL``; imported on first use (lm-eval is slow to import)
MODULES = {
    "perplexity": "kvbench.eval.perplexity",
    "needle": "kvbench.eval.needle",
    "longbench": "kvbench.eval.longbench",
    "lm_eval": "kvbench.eval.lm_eval_bridge",
    "longbench_v2": "kvbench.eval.longbench_v2",
}


@dataclass
class Score:
    """The cell's headline number: ``name`` says what it is (perplexity, needle_accuracy, ...)."""

    name: str
    value: float
    higher_is_better: bool
    ci_low: float | None = None
    ci_high: float | None = None


@dataclass
class Metrics:
    """The metric keys every protocol reports; a protocol's own keys go in ``extra``.

    Bytes are aggregated as all reference bytes over all stored bytes (protocol 2), times in
    seconds; a value a protocol cannot measure is None, never a stand-in.
    """

    score: Score
    n_examples: int
    compression_prefill: float
    compression_mean: float
    kv_mem_mb_prefill: float
    kv_mem_mb_peak: float
    kv_resident_mb_peak: float  # every tensor the cache held, views and shadows included
    ttft_s: float
    tpot_s: float | None
    throughput_tok_s: float | None
    accuracy_drop: dict | None = None
    delta_nll: dict | None = None
    kl: float | None = None
    top1_agreement: float | None = None
    kv_hit: float | None = None
    kv_hit_excl: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The record's ``metrics``: shared keys, then the protocol's own."""
        out = asdict(self)
        if self.score.ci_low is None and self.score.ci_high is None:
            out["score"] = {k: v for k, v in out["score"].items() if k not in ("ci_low", "ci_high")}
        extra = out.pop("extra")
        return {**out, **extra}


@dataclass
class Dataset:
    """What a protocol loaded: its data (text or examples) and where it came from (``sha256`` first)."""

    data: Any
    source: dict[str, Any]


@dataclass
class Evaluation:
    """What evaluating one stack gave.

    Attributes:
        metrics: the record's metrics.
        examples: per-example results as stored in the record (JSON).
        baseline: what a later cell of the same model x dataset compares against (any picklable).
        per_layer_bytes: stored bytes per layer at the end of the last prefill.
    """

    metrics: Metrics
    examples: list[dict[str, Any]]
    baseline: Any
    per_layer_bytes: list[int] = field(default_factory=list)


class EvalProtocol(Protocol):
    """What a protocol module's ``PROTOCOL`` object offers."""

    task: ClassVar[str]

    def validate(self, cfg: DictConfig, order: int) -> None:
        """Check ``cfg.dataset`` (and what it needs of the stack-wide keys); reads no data."""

    def load(self, ds: DictConfig) -> Dataset:
        """Load the protocol's data. Raises DatasetLoadError naming the dataset; no fallback."""

    def evaluate(self, lm, stack, data: Any, ds: DictConfig, baseline: Any) -> Evaluation:
        """Run ``stack`` on every example; ``baseline`` is a full-cache Evaluation's ``baseline``."""


def get(task: str) -> EvalProtocol:
    """The protocol of ``dataset.task``; a ConfigError naming the allowed tasks otherwise."""
    if task not in MODULES:
        raise ConfigError(f"dataset.task={task!r}: allowed {', '.join(MODULES)}")
    return importlib.import_module(MODULES[task]).PROTOCOL  # type: ignore[no-any-return]


def check_int(ds: DictConfig, key: str, minimum: int, nullable: bool = False) -> None:
    """``dataset.<key>`` is an integer >= ``minimum``, or null where ``nullable``; else a ConfigError."""
    value = ds[key]
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "null or an integer" if nullable else "an integer"
        raise ConfigError(f"dataset.{key}={value!r}: must be {allowed} >= {minimum}")


def load_corpus(ds: DictConfig) -> Dataset:
    """A corpus protocol's data: the text the dataset config names, and where it came from."""
    text = corpus.load_text(ds)
    return Dataset(text, corpus.describe_source(ds, text))


def sha256_json(value: Any) -> str:
    """sha256 of ``value`` as canonical JSON (sorted keys, UTF-8)."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
