"""The report's sanity checks: numbers that cannot be right are refused with the reason."""

from __future__ import annotations

from kvbench.report import sanity
from kvbench.report.document import render_report


def _r(cell_id, scheduler="none", compressor="none", ppl=12.0, comp=1.0, **metrics):
    ref_mb = 10.0
    order = int(scheduler != "none") + int(compressor != "none")
    return {
        "cell_id": cell_id,
        "status": "done",
        "stack": {"router": "none", "compressor": compressor, "scheduler": scheduler, "order": order},
        "model": {"name": "m", "dtype": "float32"},
        "dataset": {"name": "d", "task": "perplexity", "sha256": "ab"},
        "identity": {"dataset": {"name": "d", "windows": 2, "sha256": "ab"}},
        "device": {"type": "cpu"},
        "metrics": {
            "score": {"name": "perplexity", "value": ppl, "higher_is_better": False},
            "accuracy_drop": None if not order else {"name": "delta_ppl_pct", "value": 1.0},
            "compression_prefill": comp,
            "compression_mean": comp,
            "kv_mem_mb_prefill": ref_mb / comp,
            "n_examples": 2,
            "n_scored_tokens": 512,
            **metrics,
        },
    }


def test_consistent_records_pass():
    records = [
        _r("b"),
        _r("h", "h2o", ppl=12.5, comp=2.0),
        _r("q", compressor="quantized", ppl=12.2, comp=3.0),
    ]
    assert sanity.refusals(records) == {} and sanity.flags(records) == {} and sanity.render(records) is None


def test_impossible_numbers_are_refused_with_the_reason():
    records = [
        _r("b"),
        _r("one", "h2o", ppl=1.0, comp=2.0),
        _r("same", "lru", ppl=12.0, comp=2.0),  # the full cache's perplexity, at half the bytes
        _r("bytes", compressor="quantized", ppl=12.2, comp=3.0, kv_mem_mb_prefill=1.0),
        _r("drop", "adakv", ppl=12.4, comp=2.0, n_scored_tokens=256),
    ]
    refused = sanity.refusals(records)
    assert "exactly 1.0" in refused["one"]["score"]
    assert "identical to 12 digits to full cache's (cell b)" in refused["same"]["score"]
    assert "the compression disagrees with the stored bytes" in refused["bytes"]["compression"]
    assert "has n_scored_tokens=512, this cell 256" in refused["drop"]["accuracy_drop"]
    assert "b" not in refused
    text = render_report(records, "t")
    assert "## Sanity checks" in text and "refused score of scheduler/h2o (cell `one`)" in text
    assert "| —      | —          | h2o       |    refused |" in text


def test_a_stack_worse_than_random_at_equal_bytes_is_flagged():
    records = [
        _r("b"),
        _r("rnd", compressor="random", ppl=14.0, comp=2.0),
        _r("bad", "h2o", ppl=15.0, comp=2.1),
        _r("good", "lru", ppl=12.5, comp=2.0),
        _r("far", "adakv", ppl=20.0, comp=4.0),  # other bytes: not comparable
    ]
    flagged = sanity.flags(records)
    assert set(flagged) == {"bad"}
    assert (
        flagged["bad"]
        == "worse than compressor/random at equal bytes (15 vs 14 at 2.10x vs 2.00x compression)"
    )
    text = render_report(records, "t")
    assert "15.00 ⚑" in text and "flagged scheduler/h2o (cell `bad`)" in text


def _seed(cell_id, seed, ppl, scheduler="none", compressor="random"):
    """A cell run with ``seed``: the technique's own seed for random, the run's for the others."""
    record = _r(cell_id, scheduler, compressor, ppl=ppl, comp=2.0)
    knobs = {"compressor": {"name": compressor, "seed": seed}} if compressor == "random" else {}
    record["identity"] = {**record["identity"], "stack": knobs, "seed": 0 if knobs else seed}
    return record


def test_seeds_are_compared_by_their_means():
    records = [_r("b"), _seed("r0", 0, 13.0), _seed("r1", 1, 14.0), _seed("r2", 2, 15.0)]
    records.append(_r("lru", "lru", ppl=13.5, comp=2.0))  # worse than seed 0, better than the mean
    records += [_seed("h0", 0, 14.2, "h2o", "none"), _seed("h1", 1, 14.6, "h2o", "none")]
    flagged = sanity.flags(records)
    assert set(flagged) == {"h0", "h1"}  # 14.4 on average against random's 14.0
    assert flagged["h0"] == (
        "worse than compressor/random at equal bytes (means over seeds) "
        "(14.4 vs 14 at 2.00x vs 2.00x compression)"
    )
    text = render_report(records, "t")
    assert "- flagged scheduler/h2o (cells `h0`, `h1`): worse than" in text
    assert "14.40 ⚑" in text and "13.50 ⚑" not in text
