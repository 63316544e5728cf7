"""The matrix sweeper's plan: expansion by order, exact pairs and triples, presets, legality, merging."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from kvbench import config
from kvbench.errors import ConfigError
from kvbench.report.matrix import render_matrix_report
from kvbench.sweep import matrix
from kvbench.sweep.launcher import groups_of
from kvbench.sweep.plan import build

CONF = Path(__file__).resolve().parents[1] / "conf"
config.register()


def _spec(order, **options):
    return matrix.MatrixSpec(order=order, options={r: options.get(r, []) for r in matrix.ROLES})


def test_orders_expand_to_singles_pairs_of_roles_and_full_stacks():
    spec = _spec([1, 2, 3], router=["base", "pikv"], compressor=["svd"], scheduler=["h2o", "quest", "none"])
    cells = matrix.expand(spec, CONF)
    by_section = {s: [c for c in cells if c.section == s] for s in matrix.SECTIONS}
    assert [c.label for c in by_section["baseline"]] == ["full cache"]
    assert [c.label for c in by_section["single"]] == [
        "router/base",
        "router/pikv",
        "compressor/svd",
        "scheduler/h2o",
        "scheduler/quest",
    ]
    assert len(by_section["double"]) == 2 * 1 + 2 * 2 + 1 * 2
    assert len(by_section["triple"]) == 2 * 1 * 2
    # every cell names all three roles; `none` in a list is the baseline's, not a technique
    assert all(sum(o.split("=")[0] in matrix.ROLES for o in c.overrides) == 3 for c in cells)
    assert matrix.full_counts(spec.options) == {1: 5, 2: 8, 3: 4}


def test_full_catalog_counts():
    options = {
        r: sorted(p.stem for p in (CONF / r).glob("*.yaml") if p.stem not in ("none", "chain"))
        for r in matrix.ROLES
    }
    assert [len(options[r]) for r in matrix.ROLES] == [6, 13, 8]
    assert matrix.full_counts(options) == {1: 27, 2: 6 * 13 + 6 * 8 + 13 * 8, 3: 6 * 13 * 8}


@pytest.mark.parametrize(
    ("entry", "overrides", "label"),
    [
        (
            "router/eplb + scheduler/duo_attention",
            ["router=eplb", "compressor=none", "scheduler=duo_attention"],
            None,
        ),
        (
            "compressor/chain[chunkkv,svd] + scheduler/adakv",
            ["router=none", "compressor=chain", "compressor.stages=[chunkkv,svd]", "scheduler=adakv"],
            "compressor/chain[chunkkv,svd] + scheduler/adakv",
        ),
        (
            {"compressor": "quantized", "compressor.bits": 2},
            ["router=none", "compressor=quantized", "scheduler=none", "compressor.bits=2"],
            "compressor/quantized (compressor.bits=2)",
        ),
    ],
)
def test_entries_parse(entry, overrides, label):
    got, got_label = matrix.parse_entry(entry, "hydra.sweeper.pairs[0]")
    assert got == overrides
    assert got_label == (label or entry)


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ("eplb + duo_attention", "'eplb' must be role/name with role one of router, compressor, scheduler"),
        ("router/base + router/pikv", "router is named twice"),
        (3, "must be 'role/name + role/name' or a mapping"),
    ],
)
def test_bad_entries_name_the_key(entry, needle):
    with pytest.raises(ConfigError, match="hydra.sweeper.pairs\\[2\\]") as err:
        matrix.parse_entry(entry, "hydra.sweeper.pairs[2]")
    assert needle in str(err.value)


def test_a_floor_alone_is_a_matrix_of_its_stacks_and_the_baseline():
    spec = matrix.MatrixSpec(floor=[{"compressor": "random", "compressor.seed": s} for s in (0, 1)])
    cells = matrix.expand(spec, CONF)
    assert spec.is_matrix and [(c.section, c.label) for c in cells] == [
        ("baseline", "full cache"),
        ("floor", "compressor/random (compressor.seed=0)"),
        ("floor", "compressor/random (compressor.seed=1)"),
    ]
    assert cells[2].overrides == ("router=none", "compressor=random", "scheduler=none", "compressor.seed=1")
    with pytest.raises(ConfigError, match=r"hydra.sweeper.floor\[0\]"):
        matrix.expand(matrix.MatrixSpec(floor=["random"]), CONF)


def test_order_must_be_1_2_or_3():
    assert (
        matrix.parse_order("1,3") == [1, 3] and matrix.parse_order(2) == [2] and matrix.parse_order([]) == []
    )
    with pytest.raises(ConfigError, match=r"hydra.sweeper.order=4: allowed any of 1, 2, 3"):
        matrix.parse_order(4)


def test_preset_becomes_overrides_of_its_stack():
    overrides = matrix.preset_overrides("variant_b_balanced", CONF)
    assert overrides[:3] == ["router=pikv", "compressor=quantized", "scheduler=h2o"]
    assert "budget=0.5" in overrides and "router.top_k=2" in overrides and "compressor.bits=2" in overrides
    assert not any(o.startswith("name=") for o in overrides)
    with pytest.raises(ConfigError, match="'variant_z' is not a preset; allowed: .*variant_a_accuracy_first"):
        matrix.preset_overrides("variant_z", CONF)


def _plan(*arguments: str, tmp: Path):
    """Plans as ``python -m kvbench -m ARGS`` would: hydra.* go to the config, the rest to the sweeper."""
    args = [*arguments, f"results_dir={tmp}"]
    parsed = OverridesParser.create().parse_overrides(args)
    fixed = [str(o.input_line) for o in parsed if not o.is_sweep_override()]
    task = [a for a in args if not a.startswith("hydra.")]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        master = compose("config", overrides=fixed, return_hydra_config=True)
        return build(task, master.hydra.sweeper, lambda ov: compose("config", overrides=ov), CONF)


def test_pikv_matrix_has_the_shape_of_pikv_tables(tmp_path):
    plan = _plan("experiment=pikv_matrix", "model=tiny_random", tmp=tmp_path)
    rows = [row for cell in plan.cells for row in cell.rows]
    sections = {s: [r for r in rows if r["section"] == s] for s in matrix.SECTIONS}
    dropped = {d.section: [] for d in plan.dropped}
    for d in plan.dropped:
        dropped[d.section].append(d)
    # PiKV: 25 singles, 21 doubles, 13 triples, variants (A)-(G); illegal ones dropped with the reason
    assert len(sections["single"]) == 25
    assert len(sections["double"]) + len(dropped["double"]) == 21
    assert len(sections["triple"]) + len(dropped["triple"]) == 13
    assert len(sections["variant"]) == 7 and len(sections["baseline"]) == 1
    assert {d.label for d in plan.dropped} == {
        "router/adaptive + scheduler/quest",
        "router/adaptive + compressor/quantized + scheduler/quest",
        "router/topk_balanced + compressor/pikv + scheduler/quest",
    }
    assert all("both select reads; a stack may hold one read selector" in d.reason for d in plan.dropped)
    # a variant equal to another row is one measurement shown twice
    baseline = next(c for c in plan.cells if c.rows[0]["section"] == "baseline")
    assert baseline.rows == [
        {"section": "baseline", "label": "full cache"},
        {"section": "variant", "label": "variant_g_baseline"},
    ]
    # the sanity floor, not in PiKV's tables: random selection over three seeds, three cells
    floor = [f"compressor/random (compressor.seed={i})" for i in range(3)]
    assert [r["label"] for r in sections["floor"]] == floor
    assert plan.merged == 4 and len(plan.cells) == len(rows) - 4 == 63
    assert plan.counts() == {"done": 0, "failed": 0, "interrupted": 0, "pending": 63}


def test_cells_of_one_model_run_together(tmp_path):
    plan = _plan("model.seed=0,1", "model=tiny_random", "scheduler=none,h2o", tmp=tmp_path)
    seeds = [next(o for o in c.overrides if o.startswith("model.seed=")) for c in plan.cells]
    assert seeds == ["model.seed=0", "model.seed=0", "model.seed=1", "model.seed=1"]


def test_unknown_scheduler_in_a_matrix_names_the_options(tmp_path):
    with pytest.raises(ConfigError, match="scheduler='snapkv': unknown option; allowed: adakv"):
        _plan("model=tiny_random", "hydra.sweeper.order=1", "scheduler=h2o,snapkv", tmp=tmp_path)


def test_knob_follows_its_role(tmp_path):
    plan = _plan(
        "model=tiny_random",
        "hydra.sweeper.order=[1,2]",
        "compressor=quantized",
        "scheduler=h2o",
        "compressor.bits=2",
        tmp=tmp_path,
    )
    for cell in plan.cells:
        has_compressor = "compressor=quantized" in cell.overrides
        assert ("compressor.bits=2" in cell.overrides) == has_compressor
    assert len(plan.cells) == 4  # baseline, quantized, h2o, quantized + h2o


def test_groups_are_runs_of_one_model_cut_to_size():
    assert groups_of(["a", "a", "a", "b", "b", "a"], 2) == [[0, 1], [2], [3, 4], [5]]
    assert groups_of(["a"] * 3, 8) == [[0, 1, 2]]


def test_matrix_report_renders_sections_pairs_variants_and_gaps():
    def record(cid, router="none", compressor="none", scheduler="none", status="done"):
        order = sum(x != "none" for x in (router, compressor, scheduler))
        return {
            "cell_id": cid,
            "status": status,
            "error": "boom" if status == "failed" else None,
            "stack": {"router": router, "compressor": compressor, "scheduler": scheduler, "order": order},
            "model": {"name": "m", "dtype": "float32"},
            "dataset": {"name": "d", "task": "perplexity", "sha256": "ab"},
            "metrics": {"score": {"name": "perplexity", "value": 10.0}},
            "device": {"type": "cpu"},
        }

    records = [record("b"), record("s1", scheduler="h2o"), record("p1", router="base", compressor="svd")]
    records.append(record("f1", compressor="svd", scheduler="h2o", status="failed"))
    manifest = {
        "kind": "kvbench-sweep",
        "cells": [
            {
                "cell_id": "b",
                "model": "m",
                "dataset": "d",
                "rows": [{"section": "baseline", "label": "full cache"}],
            },
            {
                "cell_id": "s1",
                "model": "m",
                "dataset": "d",
                "rows": [
                    {"section": "single", "label": "scheduler/h2o"},
                    {"section": "variant", "label": "variant_f_scheduling_only"},
                ],
            },
            {
                "cell_id": "p1",
                "model": "m",
                "dataset": "d",
                "rows": [{"section": "double", "label": "router/base + compressor/svd"}],
            },
            {
                "cell_id": "f1",
                "model": "m",
                "dataset": "d",
                "rows": [{"section": "double", "label": "compressor/svd + scheduler/h2o"}],
            },
            {
                "cell_id": "n1",
                "model": "m",
                "dataset": "d",
                "rows": [{"section": "triple", "label": "router/pikv + compressor/svd + scheduler/h2o"}],
            },
        ],
        "dropped": [
            {"section": "double", "label": "router/base + scheduler/quest", "reason": "both select reads"}
        ],
    }
    text = render_matrix_report(records, manifest, "t")
    for heading in (
        "### Baseline (1)",
        "### Single technique (1)",
        "#### Router + Compressor (1)",
        "#### Compressor + Scheduler (1)",
        "### Triple (1)",
        "### System variants (1)",
        "### Dropped as illegal",
        "## Failed cells",
    ):
        assert heading in text, heading
    assert "| variant_f_scheduling_only | —" in text
    assert "| pikv   | svd        | h2o       |    not run |" in text
    assert "| —      | svd        | h2o       |     failed |" in text
    # each table's provenance names its own cells; tables with no done cell have none
    hashes = "cells (config hashes): "
    footers = [line.rpartition(hashes)[2] for line in text.splitlines() if hashes in line]
    assert footers == ["b", "s1", "p1", "s1"]
    assert "router/base + scheduler/quest: both select reads" in text


def test_swept_settings_label_the_rows_and_product_sweeps_keep_the_usual_report(tmp_path):
    plan = _plan(
        "model=tiny_random", "hydra.sweeper.order=1", "scheduler=h2o", "budget=0.25,0.5", tmp=tmp_path
    )
    labels = [row["label"] for cell in plan.cells for row in cell.rows]
    assert labels == [
        "full cache (budget=0.25)",
        "full cache (budget=0.5)",  # the full cache ignores the budget: one cell, two rows
        "scheduler/h2o (budget=0.25)",
        "scheduler/h2o (budget=0.5)",
    ]
    assert plan.is_matrix and plan.merged == 1
    assert not _plan("model=tiny_random", "scheduler=h2o,lru", tmp=tmp_path).is_matrix
    record = {"cell_id": "a", "status": "done", "stack": {"scheduler": "h2o"}, "model": {"name": "m"}}
    manifest = {
        "cells": [
            {
                "cell_id": "a",
                "model": "m",
                "dataset": "d",
                "rows": [{"section": "single", "label": labels[2]}],
            }
        ]
    }
    text = render_matrix_report([record], manifest, "t")
    assert "| Settings    | Router |" in text and "| budget=0.25 | —      |" in text


def test_matrix_rows_over_seeds_are_one_row_with_the_mean_and_range():
    def record(cid, seed, ppl, drop):
        return {
            "cell_id": cid,
            "status": "done",
            "stack": {"router": "none", "compressor": "none", "scheduler": "h2o", "order": 1},
            "identity": {"stack": {"scheduler": {"name": "h2o"}}, "budget": 0.5, "seed": seed},
            "command": f"scheduler=h2o budget=0.5 seed={seed}",
            "model": {"name": "m", "dtype": "float32"},
            "dataset": {"name": "d", "task": "perplexity", "sha256": "ab"},
            "metrics": {
                "score": {"name": "perplexity", "value": ppl},
                "accuracy_drop": {"name": "delta_ppl_pct", "value": drop, "ci_low": 0.0, "ci_high": 1.0},
                "n_examples": 2,
            },
            "device": {"type": "cpu"},
        }

    records = [record("s0", 0, 10.0, 1.0), record("s1", 1, 11.0, 3.0), record("s2", 2, 12.0, 5.0)]
    cells = [
        {
            "cell_id": f"s{i}",
            "model": "m",
            "dataset": "d",
            "rows": [{"section": "single", "label": f"scheduler/h2o (budget=0.5, seed={i})"}],
        }
        for i in range(3)
    ]
    cells.append(
        {
            "cell_id": "x",
            "model": "m",
            "dataset": "d",
            "rows": [{"section": "single", "label": "scheduler/lru (budget=0.5, seed=0)"}],
        }
    )
    manifest = {"kind": "kvbench-sweep", "command": ["-m", "seed=0,1,2"], "cells": cells}
    text = render_matrix_report(records, manifest, "t")
    rows = [line for line in text.splitlines() if line.startswith("| budget=0.5")]
    assert len(rows) == 2 and "h2o" in rows[0] and "not run" in rows[1]
    assert "11.00" in rows[0] and "+3.00 (range 1.00, 5.00)" in rows[0] and "3×2" in rows[0]
    assert "command `python -m kvbench -m seed=0,1,2` · cells (config hashes): s0, s1, s2" in text
    assert "- `s1`: `python -m kvbench scheduler=h2o budget=0.5 seed=1`" in text
