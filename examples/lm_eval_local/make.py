"""Writes ``kv_pairs.jsonl``: find one key's number in a list of key-number lines.

Each document lists ``PAIRS`` keys (English words) with random four-digit numbers, one line each,
and asks for one key's number; the choices are the asked key's number and three other numbers of
the same list. Two lm-eval tasks in this folder read it: ``kvbench_kv_choice`` (multiple choice,
scored by log-likelihood) and ``kvbench_kv_gen`` (the number generated, exact match). The list is
the document's ``context``, so the bridge compresses it and protects the question.

    python examples/lm_eval_local/make.py
    python -m kvbench -m dataset=lm_eval dataset.include_path=examples/lm_eval_local \\
        'dataset.tasks=[kvbench_kv_choice,kvbench_kv_gen]' dataset.apply_chat_template=true \\
        scheduler=h2o,streaming_llm budget=0.25
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvbench.data.longbench_synthetic import KEYS

HERE = Path(__file__).resolve().parent
DOCS = 40
PAIRS = 12


def main() -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(DOCS):
        keys = rng.sample(KEYS, PAIRS)
        values = rng.sample(range(1000, 10000), PAIRS)
        asked = rng.randrange(PAIRS)
        others = rng.sample([v for i, v in enumerate(values) if i != asked], 3)
        choices = [str(values[asked]), *map(str, others)]
        rng.shuffle(choices)
        rows.append(
            {
                "context": "\n".join(f"The number of the key {k} is {v}." for k, v in zip(keys, values)),
                "key": keys[asked],
                "choices": choices,
                "label": choices.index(str(values[asked])),
                "answer": str(values[asked]),
            }
        )
    (HERE / "kv_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"kv_pairs.jsonl: {len(rows)} documents")


if __name__ == "__main__":
    main()
