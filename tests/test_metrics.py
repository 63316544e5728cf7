"""Metric functions against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench import metrics
from kvbench.cache.attention import kv_hit


def test_kl_and_top1_by_hand():
    p = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    q = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]]))
    kl, agree = metrics.kl_and_top1(p, q)
    expect = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl[0].item() == pytest.approx(expect, abs=1e-6) and kl[1].item() == pytest.approx(0.0, abs=1e-6)
    assert agree.tolist() == [False, True]  # the tie in row 0 resolves to index 0; q picks 1


def test_wilson_interval_by_hand():
    lo, hi = metrics.wilson_interval(7, 10)
    assert lo == pytest.approx(0.3968, abs=1e-3) and hi == pytest.approx(0.8922, abs=1e-3)


def test_accuracy_drop_and_null_baseline():
    drop = metrics.accuracy_drop([1, 1, 1, 0], [1, 0, 1, 0])
    assert drop["value"] == pytest.approx(25.0) and drop["ci_low"] <= 25.0 <= drop["ci_high"]
    assert metrics.accuracy_drop([0, 0], [0, 1])["value"] is None


def test_perplexity_drop_by_hand():
    d_ppl, d_nll = metrics.perplexity_drop([2.0, 2.0], [2.1, 2.1])
    assert d_nll["value"] == pytest.approx(0.1)
    assert d_ppl["value"] == pytest.approx(100 * (math.exp(0.1) - 1))


def test_kv_hit_by_hand():
    # Full attention over positions 0..3; the stack kept positions 0 and 2 (renormalized).
    p_full = torch.tensor([0.1, 0.2, 0.3, 0.4]).view(1, 1, 1, 1, 4)
    p_stack = torch.tensor([0.25, 0.75]).view(1, 1, 1, 1, 2)
    units = torch.tensor([0, -1, 1, -1]).view(1, 1, 4)  # position -> stored unit (-1: evicted)
    exclude = torch.tensor([True, False, False, False])
    hit, hit_excl = kv_hit(p_stack, units, p_full, exclude)
    assert hit.item() == pytest.approx(0.1 + 0.3)
    assert hit_excl.item() == pytest.approx(0.3 / 0.9)


def test_kv_hit_merged_units_compare_summed_mass():
    # Unit 1 merged positions 1..3 (mass 0.9 under full attention); the stack gives it 0.75.
    p_full = torch.tensor([0.1, 0.2, 0.3, 0.4]).view(1, 1, 1, 1, 4)
    p_stack = torch.tensor([0.25, 0.75]).view(1, 1, 1, 1, 2)
    units = torch.tensor([0, 1, 1, 1]).view(1, 1, 4)
    hit, hit_excl = kv_hit(p_stack, units, p_full, torch.tensor([True, False, False, False]))
    assert hit.item() == pytest.approx(0.1 + 0.75)
    assert hit_excl.item() == pytest.approx(0.75 / 0.9)


def test_needle_compression_over_cases_of_several_lengths_is_bytes_over_bytes():
    from kvbench.eval import needle

    # a representation compressor whose ratio grows with length (a full-precision window of 64 tokens)
    def case(tokens: int) -> dict:
        ref, stored = 1024 * tokens, 1024 * 64 + 256 * (tokens - 64)
        stored_bytes = {"bytes_prefill": stored, "bytes_end": stored, "resident_peak": 2 * stored}
        reference = {"reference_prefill": ref, "reference_end": ref}
        return {"correct": 1.0, "tpot": [0.01], "ttft": 0.1, "batch": tokens, **stored_bytes, **reference}

    cases = [case(n) for n in (300, 500, 700)]
    m = needle.summarize(cases, None).as_dict()
    mean_reference_mb = sum(c["reference_prefill"] for c in cases) / 3 / 2**20
    assert m["compression_prefill"] * m["kv_mem_mb_prefill"] == pytest.approx(mean_reference_mb, rel=1e-12)
    assert m["compression_prefill"] == pytest.approx(1024 * 1500 / sum(c["bytes_prefill"] for c in cases))
