"""Report plots: the score-compression frontier and needle heatmaps, written next to REPORT.md."""

from __future__ import annotations

from pathlib import Path

from kvbench.report import plots
from kvbench.report.__main__ import write_report
from kvbench.results import write_record


def _record(cell_id: str, scheduler: str, ppl: float, compression: float, **extra) -> dict:
    return {
        "cell_id": cell_id,
        "experiment": "p",
        "status": "done",
        "stack": {
            "router": "none",
            "compressor": "none",
            "scheduler": scheduler,
            "order": int(scheduler != "none"),
        },
        "model": {"name": "m", "dtype": "float32"},
        "dataset": {"name": "d", "task": "perplexity", "sha256": "ab"},
        "metrics": {
            "score": {"name": "perplexity", "value": ppl, "higher_is_better": False},
            "compression_mean": compression,
        },
        "device": {"type": "cpu"},
        **extra,
    }


def test_frontier_keeps_the_points_nothing_beats():
    points = [(1.0, 10.0), (2.0, 11.0), (2.0, 12.0), (4.0, 13.0), (3.0, 14.0)]
    assert plots.pareto_front(points, higher_is_better=False) == [0, 1, 3]
    assert plots.pareto_front([(1.0, 0.9), (2.0, 0.5), (2.0, 0.8)], higher_is_better=True) == [0, 2]


def test_report_writes_a_pareto_plot_and_needle_heatmaps(tmp_path: Path):
    cases = [
        {
            "length": n,
            "depth": d,
            "offset": o,
            "correct": float((n + o) % 3 != 0),
            "context_tokens": n + 20,
            "bytes_prefill": 4096 * n,
        }
        for n in (300, 500)
        for d in (0.1, 0.5, 0.9)
        for o in (0, 1)
    ]
    records = [
        _record("a", "none", 10.0, 1.0),
        _record("b", "h2o", 10.5, 2.0),
        _record("c", "lru", 11.0, 1.8),
        _record("d", "snapkv", 12.0, 2.0),
        {**_record("e", "none", 1.0, 1.0), "dataset": {"name": "n", "task": "needle"}, "examples": cases},
    ]
    for r in records:
        write_record(tmp_path / f"{r['cell_id']}.json", r)
    path = write_report(tmp_path)
    assert path is not None
    text = path.read_text()
    pareto = tmp_path / "pareto-m-d.png"
    heatmap = tmp_path / "needle-e.png"
    memory = tmp_path / "memory-m-n.png"
    assert (
        pareto.stat().st_size > 10_000 and heatmap.stat().st_size > 10_000 and memory.stat().st_size > 10_000
    )
    assert pareto.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![pareto-m-d](pareto-m-d.png)" in text and "[e](needle-e.png)" in text
    lengths, depths, grid = plots.needle_grid(records[-1])
    assert lengths == [300, 500] and depths == [0.1, 0.5, 0.9]
    assert grid[0] == [0.5, 0.5]  # 300 fails at offset 0 (300 % 3 == 0), 500 at offset 1 (501)
    assert plots.pareto(records[:1]) is None  # one stack: nothing to compare


def test_pareto_shows_a_setting_over_seeds_as_one_point_with_its_range():
    def seeded(cell_id: str, seed: int, ppl: float) -> dict:
        ident = {"stack": {"scheduler": {"name": "random", "seed": seed}}, "seed": 0}
        return _record(cell_id, "random", ppl, 2.0, identity=ident)

    records = [_record("a", "none", 10.0, 1.0), seeded("r0", 0, 11.0), seeded("r1", 1, 13.0)]
    fig = plots.pareto(records)
    assert fig is not None
    ax = fig.axes[0]
    points = [tuple(p) for c in ax.collections for p in c.get_offsets() if len(c.get_offsets())]
    assert (2.0, 12.0) in points and (2.0, 11.0) not in points  # the mean, not each seed
    assert "2 stacks" in ax.get_title()
    assert any(t.get_text() == "scheduler/random (2 seeds)" for t in ax.texts)
    bars = [seg for c in ax.collections if hasattr(c, "get_segments") for seg in c.get_segments()]
    assert any(seg[0][1] == 11.0 and seg[1][1] == 13.0 for seg in map(list, bars))  # the seeds' range
    plots.plt.close(fig)


def test_categories_plot_a_series_per_longbench_category():
    def longbench(cell_id: str, scheduler: str, compression: float, qa: float, code: float) -> dict:
        record = _record(cell_id, scheduler, (qa + code) / 2, compression)
        record["dataset"]["task"] = "longbench"
        record["metrics"]["categories"] = {"QA": qa, "Code": code}
        return record

    records = [longbench("a", "none", 1.0, 40.0, 60.0), longbench("b", "h2o", 2.0, 30.0, 55.0)]
    fig = plots.categories(records)
    assert fig is not None
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["QA", "Code"]
    assert [tuple(p) for p in ax.get_lines()[1].get_xydata()] == [(1.0, 60.0), (2.0, 55.0)]
    assert sorted(t.get_text() for t in ax.texts) == ["full cache", "scheduler/h2o"]  # each stack once
    plots.plt.close(fig)
    assert plots.categories(records[:1]) is None  # one stack: nothing to compare
    assert plots.categories([_record("a", "none", 10.0, 1.0), _record("b", "h2o", 11.0, 2.0)]) is None


def test_report_writes_a_categories_plot_for_longbench(tmp_path: Path):
    for i, (scheduler, compression) in enumerate([("none", 1.0), ("h2o", 2.0)]):
        record = _record(f"c{i}", scheduler, 50.0 - i, compression)
        record["metrics"]["categories"] = {"QA": 50.0 - i}
        write_record(tmp_path / f"c{i}.json", record)
    path = write_report(tmp_path)
    assert path is not None and (tmp_path / "categories-m-d.png").stat().st_size > 10_000
    assert "![categories-m-d](categories-m-d.png)" in path.read_text()
