"""LongBench v2 through a stack: v2's answer pattern on hand cases, its 0-shot prompt built from
lm-eval's template, the local loader and its errors, the summary's groups, and a double stack run
end to end on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvbench import codec, config, run
from kvbench.data import longbench_v2 as data
from kvbench.errors import ConfigError, DatasetLoadError
from kvbench.eval import longbench, longbench_v2

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize(
    "prediction, letter",
    [
        ("The correct answer is (B).", "B"),
        ("The correct answer is C", "C"),
        ("**The correct answer is (D)**", "D"),
        ("The correct answer is **(A)**", "A"),
        ("the correct answer is (A)", None),  # case matters
        ("The answer is (A)", None),
        ("The correct answer is (E)", None),
        ("The correct answer is (C). Or: The correct answer is (A).", "C"),  # the first match
        ("The correct answer is B, no: The correct answer is (D)", "D"),  # the parenthesised form first
        ("", None),
    ],
)
def test_extraction_follows_v2s_pattern(prediction, letter):
    assert longbench_v2.extract(prediction) == letter


DOC = {
    "_id": "x",
    "domain": "Single-Document QA",
    "sub_domain": "Legal",
    "difficulty": "easy",
    "length": "short",
    "question": " Which river? ",
    "choice_A": " the Seine ",
    "choice_B": "the Rhine",
    "choice_C": "the Loire",
    "choice_D": "the Rhone",
    "answer": "A",
    "context": "\nThe mill stands by the Seine.  \n",
}


def test_prompt_is_v2s_zero_shot_prompt_split_at_the_context_end():
    td = longbench_v2.task_def()
    text, cut = longbench.render(td, longbench_v2.fields(DOC))
    assert text.startswith("Please read the following text and answer the question below.\n\n<text>\n")
    assert text[:cut].endswith("<text>\nThe mill stands by the Seine.")  # stripped, as v2 does
    assert text[cut:] == (
        "\n</text>\n\nWhat is the correct answer to this question: Which river?\nChoices:\n"
        "(A) the Seine\n(B) the Rhine\n(C) the Loire\n(D) the Rhone\n\n" + longbench_v2.INSTRUCTION
    )
    assert "Answer:" not in text and td.chat and not td.first_line and td.max_gen_toks == 128


class ChatBytes(codec.ByteCodec):
    """A byte codec with a chat template around the user's turn."""

    def chat(self, user: str) -> tuple[str, int] | None:
        return "<user>" + user + "</user><assistant>", len("<user>")


def test_chat_template_wraps_the_prompt_and_the_tail_is_protected():
    c = ChatBytes()
    prompt, full = longbench.build(c, longbench_v2.task_def(), longbench_v2.fields(DOC), max_length=4000)
    head, tail = c.decode(prompt.head), c.decode(prompt.tail)
    assert head.startswith("<user>Please read") and head.endswith("by the Seine.")
    assert tail.startswith("\n</text>") and tail.endswith(longbench_v2.INSTRUCTION + "</user><assistant>")
    assert full == len(prompt.head) + len(prompt.tail) - len("<user></user><assistant>")


def test_a_template_without_the_answer_cue_is_an_error(monkeypatch):
    monkeypatch.setattr(longbench_v2, "lm_eval_task", lambda: {"doc_to_text": "{{context}} Reply:"})
    with pytest.raises(ConfigError, match="no longer ends in 'Answer:'"):
        longbench_v2.template()


def write_v2(path: Path, n: int = 4, **changes) -> Path:
    """A v2-format .jsonl: short contexts, difficulties and lengths mixed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    groups = [("easy", "short"), ("hard", "medium"), ("hard", "long"), ("easy", "long")]
    words = ["the", "river", "runs", "past", "the", "old", "mill", "by", "the", "bakery", "near", "a"]
    with path.open("w") as fh:
        for i in range(n):
            difficulty, length = groups[i % len(groups)]
            context = " ".join(words[(i + j) % len(words)] for j in range(40 + 30 * i))
            doc = {
                **DOC,
                "_id": f"v2-{i}",
                "difficulty": difficulty,
                "length": length,
                "answer": "ABCD"[i % 4],
                "context": context,
                **changes,
            }
            fh.write(json.dumps(doc) + "\n")
    return path


def test_local_jsonl_and_json_array_read_v2s_fields(tmp_path):
    path = write_v2(tmp_path / "v2.jsonl")
    docs = data.read_local(path, "longbench_v2", None)
    assert [d["_id"] for d in docs] == ["v2-0", "v2-1", "v2-2", "v2-3"]
    assert data.read_local(path, "longbench_v2", 2) == docs[:2]
    array = tmp_path / "data.json"
    array.write_text(json.dumps([{**d, "extra": 1} for d in docs]))
    assert data.read_local(array, "longbench_v2", 3) == docs[:3]  # unknown fields are dropped


@pytest.mark.parametrize(
    "line, message",
    [
        ({k: v for k, v in DOC.items() if k != "choice_C"}, r"v2.jsonl:1: missing field choice_C"),
        ({**DOC, "answer": "E"}, r"v2.jsonl:1: field answer='E': allowed A, B, C, D"),
        ({**DOC, "length": "huge"}, r"v2.jsonl:1: field length='huge': allowed short, medium, long"),
        ({**DOC, "context": None}, r"v2.jsonl:1: field context is NoneType, not a string"),
    ],
)
def test_a_broken_example_names_the_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "v2.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(DatasetLoadError, match=message) as err:
        data.read_local(path, "longbench_v2", None)
    assert "dataset 'longbench_v2'" in str(err.value) and "\n" not in str(err.value)


def test_unreadable_and_empty_files_are_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DatasetLoadError, match=r"bad.jsonl:1: not JSON"):
        data.read_local(tmp_path / "bad.jsonl", "longbench_v2", None)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetLoadError, match=r"empty.jsonl holds no examples"):
        data.read_local(tmp_path / "empty.jsonl", "longbench_v2", None)
    with pytest.raises(DatasetLoadError, match=r"gone.jsonl: cannot be read"):
        data.read_local(tmp_path / "gone.jsonl", "longbench_v2", None)


def row(difficulty, length, extracted, answer="A", **extra):
    return {
        "difficulty": difficulty,
        "length": length,
        "extracted": extracted,
        "correct": extracted == answer,
        "batch": extra.get("batch", 0),
        "ttft": 1.0,
        "tpot": [0.1],
        "bytes_prefill": 100,
        "reference_prefill": 200,
        "bytes_end": 100,
        "reference_end": 200,
        "resident_peak": 300,
    }


def test_summary_counts_unparsed_as_wrong_and_groups_add_up():
    rows = [
        row("easy", "short", "A"),
        row("easy", "long", None),
        row("hard", "medium", "B"),
        row("hard", "long", "A"),
    ]
    base = [
        row("easy", "short", "A"),
        row("easy", "long", "A"),
        row("hard", "medium", "A"),
        row("hard", "long", "A"),
    ]
    m = longbench_v2.summarize(rows, base)
    assert m.score.name == "longbench_v2_accuracy" and m.score.value == 50.0
    assert m.score.ci_low < 50.0 < m.score.ci_high
    assert m.extra["unparsed"] == 1
    assert m.extra["by_difficulty"] == {"easy": {"score": 50.0, "n": 2}, "hard": {"score": 50.0, "n": 2}}
    assert m.extra["by_length"] == {
        "short": {"score": 100.0, "n": 1},
        "medium": {"score": 0.0, "n": 1},
        "long": {"score": 50.0, "n": 2},
    }
    assert m.accuracy_drop["name"] == "accuracy_points" and m.accuracy_drop["value"] == pytest.approx(50.0)


TINY_V2 = ["model=tiny_random", "dataset=longbench_v2", "window=8", "sinks=2"]


def compose_cell(tmp: Path, *extra: str):
    config.register()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=[*TINY_V2, f"results_dir={tmp}", *extra])


def test_a_double_stack_runs_the_protocol_on_a_local_file_and_batches_equal_one_by_one(tmp_path, monkeypatch):
    monkeypatch.setattr(longbench_v2, "MAX_NEW", 4)  # the tiny model's answers mean nothing
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    path = write_v2(tmp_path / "v2.jsonl")
    record = run.run(compose_cell(tmp_path / "r", *cfg_overrides(path)))
    assert record["status"] == "done", record["error"]
    m, examples = record["metrics"], record["examples"]
    assert m["n_examples"] == 4 and m["score"]["name"] == "longbench_v2_accuracy"
    assert m["compression_prefill"] > 1.0 and m["accuracy_drop"]["name"] == "accuracy_points"
    for groups in (m["by_difficulty"], m["by_length"]):
        assert sum(g["n"] for g in groups.values()) == 4
        total = sum(g["score"] * g["n"] for g in groups.values() if g["n"])
        assert total / 4 == pytest.approx(m["score"]["value"])
    assert m["unparsed"] == sum(e["extracted"] is None for e in examples)
    assert all(not e["correct"] for e in examples if e["extracted"] is None)
    keys = {"id", "domain", "difficulty", "length", "prediction", "extracted", "answer", "correct"}
    keys |= {"prompt_tokens", "prompt_tokens_truncated", "context_tokens", "compression_prefill", "batch"}
    assert keys <= set(examples[0])
    assert [e["id"] for e in examples] == ["v2-0", "v2-1", "v2-2", "v2-3"]
    last = examples[-1]  # its context pushes it past max_length: cut in the middle
    assert last["prompt_tokens"] > 400 >= last["prompt_tokens_truncated"]
    source = record["dataset"]["source"]
    assert source["template"].endswith(longbench_v2.INSTRUCTION) and source["max_new"] == 4
    batched = run.run(compose_cell(tmp_path / "r", *cfg_overrides(path), "dataset.batch_size=3"))
    assert batched["status"] == "done", batched["error"]
    assert [e["prediction"] for e in batched["examples"]] == [e["prediction"] for e in examples]
    for key in ("compression_prefill", "kv_mem_mb_prefill"):
        assert batched["metrics"][key] == pytest.approx(m[key], rel=1e-4)


def cfg_overrides(path) -> list[str]:
    return [
        f"dataset.path={path}",
        "dataset.max_length=400",
        "scheduler=h2o",
        "compressor=quantized",
        "budget=0.5",
        "name=v2",
    ]


@pytest.mark.parametrize(
    "override, message",
    [
        ("dataset.limit=0", "dataset.limit=0: must be null or an integer >= 1"),
        ("dataset.max_length=10", "dataset.max_length=10: below the fixed text of LongBench v2's prompt"),
        ("dataset.path=/nowhere/v2.jsonl", "dataset.path='/nowhere/v2.jsonl': no such file"),
        ("dataset.batch_size=0", "dataset.batch_size=0: must be an integer >= 1"),
    ],
)
def test_bad_input_fails_in_one_line_before_the_model_loads(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        config.validate(compose_cell(tmp_path, override))
    assert message in str(err.value) and "\n" not in str(err.value)
