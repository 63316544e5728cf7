"""Each technique acts on the real cache: outputs change at a tight budget, stored bytes match an
independent count, and its own invariant holds."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import make_stack, run_chunks, tokens
from kvbench.cache import quant
from kvbench.compressors.quantized import QuantizedCompressor, QuantSegment
from kvbench.eval.stepcost import LaunchCounter
from kvbench.routers.expert import position_blocks
from kvbench.routers.moba import BaseRouter
from kvbench.schedulers.h2o import SCORE, H2OScheduler
from kvbench.schedulers.streaming_llm import StreamingLLMScheduler

SIZES = [48, 8, 8, 1, 1]  # prefill, two chunks, two decode steps
N = sum(SIZES)


def full(lm):
    return run_chunks(lm, make_stack(lm), tokens(N), SIZES)[0]


def fp_bytes(lm, tokens_per_head: int) -> int:
    return tokens_per_head * lm.kv_heads * lm.head_dim * 2 * 4  # K and V, float32


@pytest.mark.parametrize("sched", [StreamingLLMScheduler, H2OScheduler])
def test_eviction_acts_and_counts_bytes(tiny_93, sched):
    lm = tiny_93
    logits, cache = run_chunks(
        lm, make_stack(lm, scheduler=sched(), budget=0.25, sinks=2, window=4), tokens(N), SIZES
    )
    assert not torch.allclose(logits[-10:], full(lm)[-10:], atol=1e-3)
    kept = math.ceil(0.25 * N)
    for store in cache.stores:
        assert (store.fp.lens == kept).all()
        assert store.nbytes() == fp_bytes(lm, kept)  # independent count: tokens x heads x D x (K,V) x 4 B


@pytest.mark.parametrize("sched", [StreamingLLMScheduler, H2OScheduler])
def test_eviction_lossless_at_budget_one(tiny_93, sched):
    logits, _ = run_chunks(tiny_93, make_stack(tiny_93, scheduler=sched(), budget=1.0), tokens(N), SIZES)
    assert torch.allclose(logits, full(tiny_93), atol=1e-5)


def test_streaming_keeps_sinks_and_most_recent(tiny):
    _, cache = run_chunks(
        tiny,
        make_stack(tiny, scheduler=StreamingLLMScheduler(), budget=0.25, sinks=3, window=4),
        tokens(N),
        SIZES,
    )
    kept = math.ceil(0.25 * N)
    expect = sorted([0, 1, 2, *range(N - (kept - 3), N)])
    for row in cache.stores[1].view().pos.reshape(-1, kept):
        assert sorted(row.tolist()) == expect


def test_h2o_keeps_heavy_hitters_plus_window(tiny):
    """Before eviction, the kept set is the window and sinks plus the top accumulated scores."""
    lm = tiny
    stack = make_stack(lm, scheduler=H2OScheduler(), budget=0.3, sinks=2, window=4)
    _, cache = run_chunks(
        lm, make_stack(lm, scheduler=H2OScheduler(), budget=1.0, sinks=2, window=4), tokens(40), [40]
    )  # accumulate scores without evicting
    store = cache.stores[0]
    acc, pos = store.state(SCORE).clone(), store.view().pos.clone()
    stack.scheduler.evict(0, store)
    cap = math.ceil(0.3 * 40)
    for b_h in range(pos.shape[1]):
        p, a = pos[0, b_h], acc[0, b_h]
        protected = (p < 2) | (p >= 36)
        rest = (~protected).nonzero()[:, 0]
        top = rest[a[rest].argsort(descending=True)[: cap - int(protected.sum())]]
        expect = sorted(p[protected].tolist() + p[top].tolist())
        assert sorted(store.view().pos[0, b_h].tolist()) == expect


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_acts_and_counts_packed_bytes(tiny_93, bits):
    lm = tiny_93
    g, window, sinks = 16, 4, 2
    stack = make_stack(
        lm, compressor=QuantizedCompressor(bits=bits, group_size=g), sinks=sinks, window=window
    )
    logits, cache = run_chunks(lm, stack, tokens(N), SIZES)
    if bits == 2:
        assert not torch.allclose(logits[-10:], full(lm)[-10:], atol=1e-3)
    d, h = lm.head_dim, lm.kv_heads
    quantized = ((N - sinks - window) // g) * g  # whole groups that left the window, per head
    for store in cache.stores:
        seg = store.compressed[0]
        assert isinstance(seg, QuantSegment)
        codes = quantized * h * (d * bits // 8) * 2  # packed K and V codes
        vparams = quantized * h * math.ceil(d / g) * 2 * 2  # per-token value zero+step, fp16
        kparams = (quantized // g) * h * d * 2 * 2 + (
            quantized // g
        ) * h * 2  # per-group key zero+step, counts
        assert seg.nbytes() == codes + vparams + kparams
        assert store.nbytes() == seg.nbytes() + fp_bytes(lm, N - quantized)


def test_kivi_error_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(64, 80) * 3  # head_dim 80, as pythia
    for bits in quant.SUPPORTED_BITS:
        codes, zero, step = quant.quantize(x.view(-1, 32, 80), bits, dim=1)  # keys: per channel over tokens
        rec = quant.dequantize(codes, zero, step, torch.float32).view(64, 80)
        assert ((rec - x).abs().view(-1, 32, 80) <= step.float() / 2 + 1e-6).all()
        packed = quant.pack(codes.view(-1, 80), bits)
        assert packed.shape[-1] == 80 * bits // 8
        assert torch.equal(quant.unpack(packed, bits), codes.view(-1, 80))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kivi_decode_is_one_pass_rounding_as_a_product_then_a_sum(dtype):
    """The decode writes one decoded copy (one ``addcmul``) and gives what ``codes * step`` rounded
    and then ``+ zero`` rounded give: a code times a float16 step is exact in float32."""
    torch.manual_seed(0)
    x = torch.randn(96, 128) * torch.logspace(-3, 3, 96)[:, None]  # steps of many magnitudes
    for bits in quant.SUPPORTED_BITS:
        packed, zero, step = quant.quantize_keys(x, bits, 32)
        out = torch.empty(96, 128, dtype=dtype)
        counter = LaunchCounter()
        with counter:
            quant.dequantize_keys(packed, zero, step, bits, dtype, per_group=32, out=out)
        assert counter.by_op.get("addcmul") == 1 and "add_" not in counter.by_op, counter.by_op
        codes = quant.unpack(packed, bits).view(-1, 32, 128)
        two = (codes * step.float()[:, None]).add_(zero.float()[:, None]).view(96, 128).to(dtype)
        assert torch.equal(out, two)
        vals, vzero, vstep = quant.quantize_values(x, bits, 32)
        got = quant.dequantize_values(vals, vzero, vstep, bits, 128, 32, dtype)
        codes = quant.unpack(vals, bits).view(96, 4, 32)
        two = (codes * vstep.float()[..., None]).add_(vzero.float()[..., None]).view(96, 128).to(dtype)
        assert torch.equal(got, two)


@pytest.mark.parametrize("head_dim, group", [(16, 32), (16, 16), (24, 32), (48, 32)])
def test_kivi_values_in_one_group_per_token_decode_in_one_pass(head_dim, group):
    """A value group as wide as the head or wider (one group a token, ``head_dim <= group``, as a
    thin model's) is decoded as groups that tile the head are: the codes left in place, one
    ``addcmul``, no repeated parameters; where groups do not tile the head (the last one shorter),
    the parameters are repeated per channel. Both give ``codes * step + zero`` rounded as a product
    and then a sum."""
    torch.manual_seed(0)
    x = torch.randn(40, head_dim) * torch.logspace(-2, 2, 40)[:, None]
    for bits in quant.SUPPORTED_BITS:
        if head_dim * bits % 8 or (bits == 3 and head_dim % 8):
            continue
        vals, vzero, vstep = quant.quantize_values(x, bits, group)
        counter = LaunchCounter()
        with counter:
            got = quant.dequantize_values(vals, vzero, vstep, bits, head_dim, group, torch.float32)
        tiled = head_dim <= group or head_dim % group == 0
        assert ("clone" in counter.by_op) == (not tiled), counter.by_op  # parameters repeated
        assert counter.by_op.get("addcmul") == 1, counter.by_op
        steps, zeros = (p.float().repeat_interleave(group, dim=1)[:, :head_dim] for p in (vstep, vzero))
        want = (quant.unpack(vals, bits) * steps).add_(zeros)
        assert torch.equal(got, want)


def test_kivi_then_eviction_frees_codes(tiny):
    """H2O evicting quantized tokens frees their codes; key groups go with their last token."""
    stack = make_stack(
        tiny,
        compressor=QuantizedCompressor(bits=2, group_size=8),
        scheduler=H2OScheduler(),
        budget=0.3,
        sinks=2,
        window=4,
    )
    _, cache = run_chunks(tiny, stack, tokens(N), SIZES)
    for store in cache.stores:
        assert int(store.view().valid.sum(-1).max()) == math.ceil(0.3 * N)
        seg = store.compressed[0]
        assert int(seg.gcount.sum()) == seg.size and (seg.gcount > 0).all()


def test_router_acts_and_reads_top_k(tiny_93):
    lm = tiny_93
    logits, cache = run_chunks(
        lm, make_stack(lm, router=BaseRouter(num_experts=8, top_k=2), sinks=2, window=4), tokens(N), SIZES
    )
    assert not torch.allclose(logits[-10:], full(lm)[-10:], atol=1e-3)
    m = cache.stack.router.metrics()
    assert m["routable_read_fraction"] == pytest.approx(0.25, abs=0.05)  # 2 of 8 equal blocks
    assert len(m["reads_per_expert"]) == 8 and m["load_imbalance"] >= 1.0
    assert cache.nbytes() == sum(fp_bytes(lm, N) for _ in cache.stores)  # routing stores nothing extra


def test_router_lossless_when_reading_every_expert(tiny_93):
    logits, _ = run_chunks(
        tiny_93, make_stack(tiny_93, router=BaseRouter(num_experts=4, top_k=4)), tokens(N), SIZES
    )
    assert torch.allclose(logits, full(tiny_93), atol=1e-5)


def test_position_blocks_are_contiguous():
    pos = torch.tensor([[[5, 0, 3, 1, 2, 4, 7, 6]]])
    eid = position_blocks(pos, torch.ones_like(pos, dtype=torch.bool), 4)
    by_pos = eid[0, 0][pos[0, 0].argsort()]
    assert by_pos.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_stack_of_three_runs(tiny_93):
    stack = make_stack(
        tiny_93,
        router=BaseRouter(),
        compressor=QuantizedCompressor(bits=4, group_size=8),
        scheduler=H2OScheduler(),
        budget=0.5,
        sinks=2,
        window=4,
    )
    logits, cache = run_chunks(tiny_93, stack, tokens(N), SIZES, shadow=True)
    assert torch.isfinite(logits).all()
    assert cache.nbytes() < sum(fp_bytes(tiny_93, N) for _ in cache.stores)
