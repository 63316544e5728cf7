"""Writes this folder: a small local dataset in LongBench's layout (``<task>.jsonl``, LongBench's fields).

``multifieldqa_en``: questions written for kvbench over Python's help pages (three topics per
context, the answer in one of them). ``passage_retrieval_en`` and ``passage_count``: kvbench's own
synthetic recipes (seed 1, another draw than ``dataset=longbench_synthetic``) under LongBench's task
names, so LongBench's own prompts and metrics score them.

    python examples/longbench_local/make.py
    python -m kvbench dataset=longbench dataset.path=examples/longbench_local \\
        'dataset.tasks=[multifieldqa_en,passage_retrieval_en,passage_count]' scheduler=h2o budget=0.25
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from pydoc_data.topics import topics

from omegaconf import OmegaConf

from kvbench.data import longbench_synthetic as synthetic

HERE = Path(__file__).resolve().parent
QA = [
    (
        "break",
        "What happens to the loop control target when a for loop is terminated by break?",
        ["it keeps its current value"],
    ),
    ("del", "Which exception is raised when a deleted name is unbound?", ["NameError"]),
    ("pass", "What happens when the pass statement is executed?", ["nothing happens"]),
    ("assert", "Which exception does a failing assert statement raise?", ["AssertionError"]),
    (
        "continue",
        "What does the continue statement continue with?",
        ["the next cycle of the nearest enclosing loop"],
    ),
    (
        "global",
        "Which statement makes the listed identifiers be interpreted as globals?",
        ["the global statement"],
    ),
]
FILLERS = ["return", "nonlocal", "yield", "if", "while", "for"]  # short topics: contexts of 300-700 words


def qa_rows() -> list[dict]:
    rng = random.Random(1)
    rows = []
    for i, (topic, question, answers) in enumerate(QA):
        parts = [topics[t] for t in rng.sample(FILLERS, 2)]
        parts.insert(rng.randrange(3), topics[topic])
        context = "\n\n".join(p.strip() for p in parts)
        rows.append(
            {
                "input": question,
                "context": context,
                "answers": answers,
                "length": len(context.split()),
                "dataset": "multifieldqa_en",
                "language": "en",
                "all_classes": None,
                "_id": f"kvbench_local_qa_{i}",
            }
        )
    return rows


def synthetic_rows(name: str, lb_name: str) -> list[dict]:
    ds = OmegaConf.create({"seed": 1, "size": 6, "passages": 4, "pairs": 8})
    rows = synthetic.examples(name, ds, None)
    return [{**r, "dataset": lb_name, "_id": r["_id"].replace("kvbench_", "kvbench_local_")} for r in rows]


def main() -> None:
    files = {
        "multifieldqa_en": qa_rows(),
        "passage_retrieval_en": synthetic_rows("passage_retrieval", "passage_retrieval_en"),
        "passage_count": synthetic_rows("passage_count", "passage_count"),
    }
    for task, rows in files.items():
        text = "".join(json.dumps({k: v for k, v in r.items() if k != "question"}) + "\n" for r in rows)
        (HERE / f"{task}.jsonl").write_text(text, encoding="utf-8")
        print(f"{task}.jsonl: {len(rows)} examples")


if __name__ == "__main__":
    main()
