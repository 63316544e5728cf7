"""LongBench's task definitions, read from lm-evaluation-harness (``lm_eval/tasks/longbench``).

Prompts (``doc_to_text``), maximum generation lengths, stop strings, metric functions and task
versions are lm-eval's, loaded from its YAMLs; the categories come from its group files. What
lm-eval does not apply and LongBench's own ``pred.py``/``eval.py`` do is kept here as data:
the tasks run without a chat template and the tasks whose prediction is cut to its first line.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from kvbench.errors import ConfigError

# The 16 English and code tasks of LongBench v1 (its default set here).
ENGLISH = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
LENGTH_BUCKETS = (("0-4k", 0, 4000), ("4-8k", 4000, 8000), ("8k+", 8000, None))


@dataclass(frozen=True)
class TaskDef:
    """One generation task: a prompt template over a document, a metric, a generation budget.

    ``name`` is LongBench's (``hotpotqa``); ``lm_eval_task`` lm-eval's (``longbench_hotpotqa_e``).
    ``score`` maps ``(doc, [prediction])`` to ``{"score": s, metric: s}`` with s in 0..1, the max
    over the document's gold answers.
    """

    name: str
    lm_eval_task: str
    template: str
    max_gen_toks: int
    until: tuple[str, ...]
    score: Callable[[dict, list[str]], dict]
    metric: str
    version: float | None
    category: str
    hf_path: str | None = None
    hf_name: str | None = None
    split: str = "test"

    @property
    def chat(self) -> bool:
        return self.name not in NO_CHAT_TEMPLATE

    @property
    def first_line(self) -> bool:
        return self.name in FIRST_LINE


def tasks_dir() -> Path:
    """lm-eval's ``tasks/longbench`` folder, found without importing lm-eval (slow to import)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "dataset.task=longbench needs lm-eval: pip install 'lm-eval[longbench]>=0.4.13,<0.5'"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tasks" / "longbench"


@cache
def available(e: bool) -> tuple[str, ...]:
    """LongBench task names lm-eval defines (LongBench-E's when ``e``)."""
    names = [p.stem for p in tasks_dir().glob("*.yaml") if not p.stem.startswith("_")]
    if e:
        return tuple(sorted(n[: -len("_e")] for n in names if n.endswith("_e")))
    return tuple(sorted(n for n in names if not n.endswith("_e")))


def check_names(names: list[str], e: bool) -> None:
    """Raise one line naming an unknown task and the closest known names."""
    known = available(e)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            which = "LongBench-E" if e else "LongBench"
            raise ConfigError(
                f"dataset.tasks contains {name!r}: not a {which} task{hint}; allowed: {', '.join(known)}"
            )


@cache
def categories() -> dict[str, str]:
    """lm-eval task name -> its group's alias (``Single-Document QA``, ...)."""
    out: dict[str, str] = {}
    for path in sorted(tasks_dir().glob("_longbench_*.yaml")):
        group = yaml.safe_load(path.read_text())
        alias = group.get("group_alias")
        for task in group.get("task", []):
            if alias and isinstance(task, str):
                out[task] = alias.replace(" (LongBench-E)", "")
    return out


@cache
def load(name: str, e: bool) -> TaskDef:
    """The task ``name`` as lm-eval defines it (its YAML, its metric function)."""
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval's own loader resolves !function

    task = f"{name}_e" if e else name
    cfg: dict[str, Any] = load_yaml(tasks_dir() / f"{task}.yaml")
    gen = cfg.get("generation_kwargs", {})
    metrics = [m["metric"] for m in cfg.get("metric_list", []) if m["metric"] != "score"]
    return TaskDef(
        name=name,
        lm_eval_task=cfg["task"],
        template=cfg["doc_to_text"],
        max_gen_toks=int(gen.get("max_gen_toks", 256)),
        until=tuple(gen.get("until", [])),
        score=cfg["process_results"],
        metric=metrics[0] if metrics else "score",
        version=cfg.get("metadata", {}).get("version"),
        category=categories().get(cfg["task"], "Other"),
        hf_path=cfg.get("dataset_path"),
        hf_name=cfg.get("dataset_name"),
        split=cfg.get("test_split", "test"),
    )


def bucket(length: int) -> str:
    """LongBench-E's length bucket of an example's ``length`` field (words)."""
    for label, low, high in LENGTH_BUCKETS:
        if length >= low and (high is None or length < high):
            return label
    raise ValueError(f"length {length} is negative")
