"""LongBench through a stack: lm-eval's metrics on hand-computed cases, LongBench's own rules
(middle truncation, chat-template skip list, first-line cut, the context/question split), the
local loader and its errors, batching, and the embedded engine against plain transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tests.helpers import run_kvbench as kvbench
from tests.test_cli import ROOT

from kvbench import codec, config, run
from kvbench.data import longbench_tasks as tasks
from kvbench.errors import ConfigError
from kvbench.eval import longbench

CONF = ROOT / "conf"


def score(task: str, prediction: str, answers: list[str], **doc) -> float:
    return tasks.load(task, False).score({"answers": answers, **doc}, [prediction])["score"]


def test_qa_f1_normalises_case_punctuation_and_articles():
    # "The Eiffel Tower!" -> "eiffel tower"; against "eiffel tower in paris": P=1, R=2/4, F1=2/3
    assert score("hotpotqa", "The Eiffel Tower!", ["Eiffel Tower in Paris"]) == pytest.approx(2 / 3)
    assert score("hotpotqa", "an answer", ["no", "Answer"]) == 1.0  # the max over gold answers


def test_classification_shares_credit_between_several_matched_classes():
    doc = {"all_classes": ["Location", "Person", "Number"]}
    assert score("trec", "Location", ["Location"], **doc) == 1.0
    assert score("trec", "Location or Person", ["Location"], **doc) == 0.5
    assert score("trec", "Number", ["Location"], **doc) == 0.0


def test_retrieval_and_count_divide_by_every_number_in_the_prediction():
    assert score("passage_retrieval_en", "Paragraph 3", ["Paragraph 3"]) == 1.0
    assert score("passage_retrieval_en", "Paragraph 3 or 12", ["Paragraph 3"]) == 0.5
    assert score("passage_count", "4, not 5 or 6", ["4"]) == pytest.approx(1 / 3)
    assert score("passage_count", "four", ["4"]) == 0.0


def test_code_similarity_reads_the_first_code_line():
    # comment lines are skipped; fuzz.ratio("x = 1", "x = 2") = 80
    assert score("lcc", "# a comment\nx = 1\ny = 2", ["x = 2"]) == pytest.approx(0.8)


def test_rouge_l_of_a_summary():
    # LCS of "a b c d" and "a c d e" is 3 words: P = R = 3/4
    assert score("gov_report", "a b c d", ["a c d e"]) == pytest.approx(0.75, abs=1e-6)


def test_chinese_variants_segment_words():
    assert score("multifieldqa_zh", "北京", ["北京"]) == 1.0
    assert score("passage_retrieval_zh", "段落2", ["段落2"]) == 1.0


def test_middle_truncation_keeps_first_and_last_halves():
    c = codec.ByteCodec()
    ids = c.encode("abcdefghij")
    text, cut = longbench.truncate_middle(c, ids, split=8, max_length=6)
    assert text == "abchij" and text[cut:] == "ij"
    text, cut = longbench.truncate_middle(c, ids, split=2, max_length=6)
    assert text == "abchij" and cut == 2
    text, cut = longbench.truncate_middle(c, ids, split=5, max_length=6)  # the context's end was cut
    assert text[cut:] == "hij"


def test_chat_template_skip_list_and_first_line_cut():
    assert {n for n in tasks.ENGLISH if not tasks.load(n, False).chat} == {
        "trec",
        "triviaqa",
        "samsum",
        "lcc",
        "repobench-p",
    }
    assert not tasks.load("lsht", False).chat
    trec = tasks.load("trec", False)
    assert longbench.postprocess(trec, "\n\nLocation\nQuestion: next") == "Location"
    assert longbench.postprocess(tasks.load("hotpotqa", False), "a\nb") == "a\nb"


@pytest.mark.parametrize("name", tasks.available(False))
def test_context_ends_where_the_template_says(name):
    td = tasks.load(name, False)
    doc = {"context": "CONTEXT-BODY", "question": "QUESTION?", "input": "QUESTION?"}
    text, cut = longbench.render(td, doc)
    assert text[:cut].endswith("CONTEXT-BODY")
    after = td.template.split("{{context}}", 1)[1]
    assert text[cut:] == after.replace("{{question}}", "QUESTION?").replace("{{input}}", "QUESTION?")


def test_categories_come_from_lm_eval_groups():
    assert tasks.load("hotpotqa", False).category == "Multi-Document QA"
    assert tasks.load("lcc", True).category == "Code Completion"
    assert tasks.bucket(3999) == "0-4k" and tasks.bucket(4000) == "4-8k" and tasks.bucket(9000) == "8k+"


def write_longbench(folder: Path, suffix: str = "") -> Path:
    """A LongBench-format folder: hotpotqa and trec, three examples each (its own fields)."""
    folder.mkdir(parents=True, exist_ok=True)
    words = [
        "the",
        "river",
        "runs",
        "past",
        "the",
        "old",
        "mill",
        "and",
        "the",
        "bakery",
        "near",
        "the",
        "square",
    ]
    for task, answers in (("hotpotqa", ["old mill"]), ("trec", ["Location"])):
        with (folder / f"{task}{suffix}.jsonl").open("w") as fh:
            for i in range(3):
                context = " ".join(words[(i + j) % len(words)] for j in range(60 + 25 * i))
                fh.write(
                    json.dumps(
                        {
                            "input": f"Where does the river run {i}?",
                            "context": context,
                            "answers": answers,
                            "length": 3000 + 2500 * i,
                            "dataset": task,
                            "language": "en",
                            "all_classes": ["Location", "Person"] if task == "trec" else None,
                            "_id": f"{task}-{i}",
                        }
                    )
                    + "\n"
                )
    return folder


TINY_LB = ["model=tiny_random", "dataset=longbench", "dataset.tasks=[hotpotqa,trec]", "window=8", "sinks=2"]


def compose_cell(tmp: Path, *extra: str):
    config.register()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=[*TINY_LB, f"results_dir={tmp}", *extra])


def short_generation(monkeypatch):
    """The tiny model's scores mean nothing: cap generation so the tests stay quick."""
    real = tasks.load.__wrapped__

    def capped(name, e):
        td = real(name, e)
        return td.__class__(**{**td.__dict__, "max_gen_toks": 4})

    monkeypatch.setattr(tasks, "load", capped)


def test_local_folder_through_a_double_stack_and_batches_equal_one_by_one(tmp_path, monkeypatch):
    short_generation(monkeypatch)
    folder = write_longbench(tmp_path / "lb")
    common = [f"dataset.path={folder}", "scheduler=h2o", "compressor=quantized", "budget=0.5", "name=lb"]
    one = run.run(compose_cell(tmp_path / "r1", *common))
    eight = run.run(compose_cell(tmp_path / "r8", *common, "dataset.batch_size=8"))
    assert one["status"] == "done", one["error"]
    assert eight["status"] == "done", eight["error"]
    m1, m8 = one["metrics"], eight["metrics"]
    assert set(m1["tasks"]) == {"hotpotqa", "trec"} and m1["n_examples"] == 6
    assert [e["prediction"] for e in one["examples"]] == [e["prediction"] for e in eight["examples"]]
    assert m1["score"]["value"] == pytest.approx(m8["score"]["value"])
    assert m1["compression_prefill"] == pytest.approx(m8["compression_prefill"], rel=1e-9)
    assert m1["kv_mem_mb_prefill"] == pytest.approx(m8["kv_mem_mb_prefill"], rel=1e-9)
    assert m1["compression_prefill"] > 1.0  # the stack acted on the stored cache
    assert m1["accuracy_drop"]["name"] == "score_points"
    assert one["dataset"]["source"]["lm_eval"] and one["dataset"]["source"]["task_versions"]["trec"] == 5.0
    example = one["examples"][0]
    assert {"id", "prediction", "answers", "score", "prompt_tokens", "prompt_tokens_truncated"} <= set(
        example
    )


def test_stack_none_predictions_equal_plain_greedy_generate(tiny, monkeypatch):
    from helpers import make_stack

    short_generation(monkeypatch)
    td = tasks.load("hotpotqa", False)
    doc = {
        "context": "the mill by the river " * 20,
        "question": "Where?",
        "input": "Where?",
        "answers": ["x"],
    }
    prompt, _ = longbench.build(tiny.codec, td, doc, max_length=120)
    (got,) = longbench.generate.generate(tiny, make_stack(tiny), [prompt])
    tiny.model.set_attn_implementation("sdpa")
    try:
        ids = torch.tensor([prompt.head + prompt.tail])
        out = tiny.model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    finally:
        tiny.model.set_attn_implementation("kvbench")
    assert got.tokens == out[0, ids.shape[1] :].tolist()
    assert len(prompt.head) + len(prompt.tail) <= 120  # truncated in the middle


def test_longbench_e_scores_per_length_bucket(tmp_path, monkeypatch):
    short_generation(monkeypatch)
    folder = write_longbench(tmp_path / "lbe", suffix="_e")
    cfg = compose_cell(
        tmp_path / "r", "dataset=longbench_e", "dataset.tasks=[hotpotqa,trec]", f"dataset.path={folder}"
    )
    record = run.run(cfg)
    assert record["status"] == "done", record["error"]
    assert set(record["metrics"]["buckets"]) == {"0-4k", "4-8k", "8k+"}
    assert [e["bucket"] for e in record["examples"][:3]] == ["0-4k", "4-8k", "8k+"]


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "dataset.tasks=[hotpotq]",
            "dataset.tasks contains 'hotpotq': not a LongBench task (did you mean hotpotqa",
        ),
        ("dataset.limit=0", "dataset.limit=0: must be null or an integer >= 1"),
        ("dataset.max_length=10", "dataset.max_length=10: below the fixed text of task hotpotqa"),
        ("dataset.suite=v3", "dataset.suite='v3': allowed longbench, longbench_e, synthetic"),
        ("dataset.batch_size=0", "dataset.batch_size=0: must be an integer >= 1"),
    ],
)
def test_bad_input_fails_in_one_line_before_the_model_loads(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        config.validate(compose_cell(tmp_path, override))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_task_file_names_the_task_and_the_file(tmp_path):
    folder = write_longbench(tmp_path / "lb")
    (folder / "trec.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"dataset.tasks contains 'trec': no file .*trec.jsonl"):
        config.validate(compose_cell(tmp_path, f"dataset.path={folder}"))


def test_a_broken_task_file_is_an_error_naming_the_line(tmp_path):
    folder = write_longbench(tmp_path / "lb")
    (folder / "trec.jsonl").write_text('{"input": "q", "answers": ["a"]}\n')
    out = kvbench(*TINY_LB, f"dataset.path={folder}", tmp=tmp_path)
    assert out.returncode != 0 and "trec.jsonl:1: missing field context" in out.stderr


def test_synthetic_set_is_longbench_format_and_fixed_by_its_seed():
    from kvbench.data import longbench_synthetic as synthetic

    ds = OmegaConf.create({"seed": 0, "size": 3, "passages": 4, "pairs": 8})
    for name in synthetic.NAMES:
        first, again = synthetic.examples(name, ds, None), synthetic.examples(name, ds, None)
        assert first == again and len(first) == 3
        assert set(first[0]) >= {"input", "context", "answers", "length", "dataset", "language", "_id"}
    retrieval = synthetic.examples("passage_retrieval", ds, 1)[0]
    k = int(retrieval["answers"][0].split()[1])
    assert retrieval["input"] in retrieval["context"].split("\n\n")[k - 1]
    assert "Here are 4 paragraphs" in synthetic.task("passage_retrieval", 4).template


def test_synthetic_count_answers_are_distinct_paragraphs_never_the_list_length():
    from kvbench.data import longbench_synthetic as synthetic

    ds = OmegaConf.create({"seed": 0, "size": 40, "passages": 5, "pairs": 8})
    answers = []
    for doc in synthetic.examples("passage_count", ds, None):
        listed = [p.split(": ", 1)[1] for p in doc["context"].split("\n\n")]
        assert int(doc["answers"][0]) == len(set(listed)) < len(listed)
        answers.append(int(doc["answers"][0]))
    assert set(answers) == {2, 3, 4, 5}  # every count from 2 to dataset.passages occurs


def test_example_longbench_folder_reads_in_longbench_layout():
    """examples/longbench_local: every file is a LongBench task with LongBench's fields."""
    from kvbench.data import longbench as data

    folder = ROOT / "examples" / "longbench_local"
    names = ["multifieldqa_en", "passage_retrieval_en", "passage_count"]
    data.check_local(str(folder), names, False)
    for name in names:
        docs = data.read_local(data.task_file(str(folder), name, False), "longbench", None)
        assert len(docs) == 6 and all(d["answers"] and d["context"] for d in docs)
