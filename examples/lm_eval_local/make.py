"""Writes ``pydoc_keyword.jsonl``: which Python statement does a help page describe, its name hidden.

Each document is one statement's page of Python's help (``pydoc_data.topics``, at most 600 words)
with every occurrence of the statement's keyword replaced by ``___``; the choices are the keyword
and three other statements' keywords. Two lm-eval tasks in this folder read it:
``kvbench_pydoc_keyword`` (multiple choice, scored by log-likelihood) and
``kvbench_pydoc_keyword_gen`` (the keyword generated, exact match).

    python examples/lm_eval_local/make.py
    python -m kvbench -m dataset=lm_eval dataset.include_path=examples/lm_eval_local \\
        'dataset.tasks=[kvbench_pydoc_keyword,kvbench_pydoc_keyword_gen]' scheduler=h2o,streaming_llm budget=0.25
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from pydoc_data.topics import topics

HERE = Path(__file__).resolve().parent
KEYWORDS = ["assert", "break", "class", "continue", "del", "for", "global", "if", "import", "nonlocal",
            "pass", "raise", "return", "try", "while", "with", "yield"]  # fmt: skip
MAX_WORDS = 600


def main() -> None:
    rng = random.Random(0)
    rows = []
    for keyword in KEYWORDS:
        page = topics[keyword].strip()
        if len(page.split()) > MAX_WORDS:
            continue
        others = rng.sample([k for k in KEYWORDS if k != keyword], 3)
        choices = [keyword, *others]
        rng.shuffle(choices)
        rows.append(
            {
                "context": re.sub(rf"\b{keyword}\b", "___", page),
                "question": "Which Python statement does this page describe? Its keyword is written ___.",
                "choices": choices,
                "label": choices.index(keyword),
                "answer": keyword,
            }
        )
    (HERE / "pydoc_keyword.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"pydoc_keyword.jsonl: {len(rows)} documents")


if __name__ == "__main__":
    main()
