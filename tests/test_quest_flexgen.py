"""quest (read selection over pages) and flexgen (tier placement): they act on the real cache,
count stored bytes exactly, compose with other roles and keep their own invariants."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import decode_with_ops, make_stack, padded_batch_vs_solo, run_chunks, tokens
from kvbench.cache import attention as att
from kvbench.cache import engine
from kvbench.cache.attention import page_bounds
from kvbench.compressors.quantized import QuantizedCompressor
from kvbench.errors import ConfigError
from kvbench.eval import loop
from kvbench.routers.moba import BaseRouter
from kvbench.schedulers.flexgen import FlexGenScheduler, visible_counts
from kvbench.schedulers.quest import PageBounds, QuestScheduler

SIZES = [96, 8, 8, 1, 1]  # prefill, two chunks, two decode steps
N = sum(SIZES)
P = 8  # page size used on the tiny models
FP_TOKEN = 16 * 2 * 4  # one token's K and V per head: head_dim 16, float32


def full(lm, sizes=SIZES):
    return run_chunks(lm, make_stack(lm), tokens(sum(sizes)), sizes)[0]


def quest(**kw):
    return QuestScheduler(**{"page_size": P, "dense_layers": 1, **kw})


def quant():
    return QuantizedCompressor(bits=4, group_size=8)


# --- quest ------------------------------------------------------------------------------------


@pytest.mark.parametrize("compressor", [None, quant], ids=["alone", "with_quantized"])
def test_quest_acts_at_tight_budget(tiny_93, compressor):
    lm = tiny_93
    stack = make_stack(
        lm, compressor=compressor and compressor(), scheduler=quest(), budget=0.25, sinks=2, window=4
    )
    logits, cache = run_chunks(lm, stack, tokens(N), SIZES, shadow=True)
    assert not torch.allclose(logits[-10:], full(lm)[-10:], atol=1e-3)
    m = stack.metrics()["scheduler/quest"]
    assert m["sparse_read_fraction"] < 0.5 < m["read_fraction"] < 1  # layer 0 stays dense
    assert all(store.stored_tokens() == N * lm.kv_heads for store in cache.stores)  # nothing evicted


def test_quest_refused_beside_a_router(tiny_93):
    with pytest.raises(
        ConfigError,
        match=r"router/base \+ scheduler/quest: both select reads; a stack may hold one read selector",
    ):
        make_stack(tiny_93, router=BaseRouter(), compressor=quant(), scheduler=quest())


@pytest.mark.parametrize("compressor", [None, quant], ids=["alone", "with_quantized"])
def test_quest_budget_one_reads_everything(tiny_93, compressor):
    lm = tiny_93
    ref = make_stack(lm, compressor=compressor and compressor(), sinks=2, window=4)
    stack = make_stack(
        lm, compressor=compressor and compressor(), scheduler=quest(), budget=1.0, sinks=2, window=4
    )
    logits, _ = run_chunks(lm, stack, tokens(N), SIZES)
    assert torch.allclose(logits, run_chunks(lm, ref, tokens(N), SIZES)[0], atol=1e-5)
    assert stack.scheduler.metrics()["read_fraction"] == 1.0


def test_quest_dense_layers_read_everything(tiny_93):
    stack = make_stack(tiny_93, scheduler=quest(dense_layers=2), budget=0.25, sinks=2, window=4)
    logits, cache = run_chunks(tiny_93, stack, tokens(N), SIZES)
    assert torch.allclose(logits, full(tiny_93), atol=1e-5)
    assert all(s.side(PageBounds) is None for s in cache.stores)  # no metadata for dense layers


def test_quest_counts_page_metadata_bytes(tiny_93):
    lm, h, d = tiny_93, tiny_93.kv_heads, tiny_93.head_dim
    stack = make_stack(lm, scheduler=quest(), budget=0.25, sinks=2, window=4)
    _, cache = run_chunks(lm, stack, tokens(97), [96, 1])
    meta = (97 // P) * h * d * 2 * 4  # full pages x heads x (min, max) x D x float32, layer 1 only
    assert cache.stores[0].nbytes() == 97 * h * FP_TOKEN
    assert cache.stores[1].nbytes() == 97 * h * FP_TOKEN + meta
    m = stack.scheduler.metrics()
    assert m["metadata_bytes"] == meta
    # the one routed step (query at 96): layer 0 reads all 97 tokens, layer 1 ~ceil(0.25 * 97) per
    # head (whole pages: within half a page) and every page's min/max of the 96 tokens before it
    meta_read = (96 // P) * h * d * 2 * 4
    assert m["metadata_bytes_read_per_step"] == meta_read
    layer1 = m["bytes_read_per_step"] - meta_read - 97 * h * FP_TOKEN
    assert layer1 % FP_TOKEN == 0 and abs(layer1 / FP_TOKEN / h - 25) <= P // 2


@pytest.mark.parametrize("compressor", [None, quant])
def test_quest_page_bounds_kept_between_steps_equal_a_full_pass(tiny_93, compressor):
    """Bounds grown page by page over decode steps (and rebuilt after moves into a representation)
    are those a fresh pass over every stored page gives, bit for bit."""
    lm = tiny_93
    stack = make_stack(
        lm, compressor=compressor and compressor(), scheduler=quest(), budget=0.5, sinks=2, window=4
    )
    sizes = [40] + [1] * 20
    cache = loop.new_cache(lm, stack)
    ids, at = tokens(sum(sizes)), 0
    for n in sizes:
        loop.step(lm, cache, ids[at : at + n])
        at += n
        for layer, store in enumerate(cache.stores[1:], start=1):
            kept = store.side(PageBounds)
            QuestScheduler(page_size=P, dense_layers=1).evict(layer, store)  # from scratch
            fresh = store.side(PageBounds)
            assert torch.equal(kept.kmin, fresh.kmin) and torch.equal(kept.kmax, fresh.kmax)
            store.set_side(kept)


def test_quest_with_quantized_counts_bytes(tiny_93):
    lm, h, d = tiny_93, tiny_93.kv_heads, tiny_93.head_dim
    stack = make_stack(lm, compressor=quant(), scheduler=quest(), budget=0.25, sinks=2, window=4)
    _, cache = run_chunks(lm, stack, tokens(N), SIZES)
    for layer, store in enumerate(cache.stores):
        meta = (N // P) * h * d * 2 * 4 if layer else 0
        fp = store.fp.size * FP_TOKEN
        assert store.nbytes() == sum(s.nbytes() for s in store.compressed) + fp + meta


def test_quest_bytes_read_at_budget_one(tiny_93):
    """One decode step at budget 1: every stored K/V is read, plus every page's min/max."""
    lm, h, d = tiny_93, tiny_93.kv_heads, tiny_93.head_dim
    stack = make_stack(lm, scheduler=quest(), budget=1.0, sinks=2, window=4)
    run_chunks(lm, stack, tokens(97), [96, 1])
    m = stack.scheduler.metrics()
    assert m["bytes_read_per_step"] == 2 * 97 * h * FP_TOKEN + (96 // P) * h * d * 2 * 4


def test_quest_bound_is_an_upper_bound():
    g = torch.Generator().manual_seed(0)
    b, h, grp, q, t, d, p = 2, 3, 3, 5, 40, 16, 8
    keys = torch.randn(b, h, t, d, generator=g)
    query = torch.randn(b, h * grp, q, d, generator=g)
    pages = keys.view(b, h, t // p, p, d)
    bound = page_bounds(query, pages.amin(3), pages.amax(3))  # (B, H, g, q, P) per query head
    logits = torch.einsum("bhgqd,bhtd->bhgqt", query.view(b, h, grp, q, d), keys)
    true_max = logits.view(b, h, grp, q, t // p, p).amax(-1)
    assert (bound >= true_max - 1e-5).all()
    assert (bound.amax(2, keepdim=True) >= true_max - 1e-5).all()  # the group's bound too
    single = page_bounds(query, keys, keys)  # one-token pages: the bound is exact
    assert torch.allclose(single, logits, atol=1e-5)


def test_a_page_bound_is_one_product_of_the_query_parts_with_the_paired_keys():
    """Quest version 2: a page's bound is one product of ``[q⁺, q⁻]`` with its maximum and minimum
    keys side by side, ``Σ_i max(q_i·min_i, q_i·max_i)`` at float tolerance; the pages' bounds are
    kept as that one tensor, ``kmin`` and ``kmax`` views of it."""
    g = torch.Generator().manual_seed(5)
    for b, h, grp, q, d in [(1, 2, 3, 1, 16), (2, 1, 4, 3, 8), (1, 4, 1, 2, 32)]:
        t, p = 48, 8
        pages = torch.randn(b, h, t // p, p, d, generator=g)
        query = torch.randn(b, h * grp, q, d, generator=g)
        low, high = pages.amin(3), pages.amax(3)
        q5 = query.view(b, h, grp, q, 1, d)
        want = torch.maximum(q5 * low[:, :, None, None], q5 * high[:, :, None, None]).sum(-1)
        paired = torch.stack((high, low), 3).view(b, h, t // p, 2 * d)
        torch.testing.assert_close(att.paired_page_bounds(query, paired), want, atol=1e-5, rtol=1e-5)
        assert torch.equal(att.page_bounds(query, low, high), att.paired_page_bounds(query, paired))
        grouped = att.paired_page_bounds(query, paired).amax(2)
        assert torch.equal(att.paired_group_bounds(query, paired), grouped)
    stacked = torch.stack((high, low), 3).view(-1, 2, d)
    kept = PageBounds(stacked, stacked)
    assert torch.equal(kept.kmax, high.reshape(-1, d)) and torch.equal(kept.kmin, low.reshape(-1, d))
    assert kept.kmax.data_ptr() == kept.paired.data_ptr() and len(kept.tensors()) == 1
    assert QuestScheduler.version >= 2


class _Recorder(QuestScheduler):
    """Quest that keeps what each read selection saw and chose."""

    def _read(self, layer, store, query, qpos, groups):
        mask = super()._read(layer, store, query, qpos, groups)
        view = store.view()
        self.seen_calls = getattr(self, "seen_calls", [])
        kv_mask = mask if mask.shape[1] == store.kv_heads else mask[:, ::groups]  # per KV head
        self.seen_calls.append((layer, query.clone(), view.k.clone(), view.pos.clone(), kv_mask.clone()))
        return mask


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_quest_decode_reads_the_top_bound_pages(tiny, budget):
    lm, sinks, window = tiny, 2, 4
    stack = make_stack(
        lm, scheduler=_Recorder(page_size=P, dense_layers=1), budget=budget, sinks=sinks, window=window
    )
    run_chunks(lm, stack, tokens(97), [96, 1])
    layer, query, k, pos, mask = stack.scheduler.seen_calls[-1]
    assert layer == 1 and query.shape[2] == 1
    h, grp = k.shape[1], query.shape[1] // k.shape[1]
    cap = math.ceil(budget * 97)
    for head in range(h):
        order = pos[0, head].argsort()
        kk, pp, read = k[0, head][order], pos[0, head][order], mask[0, head, 0][order]
        pages = kk[:96].view(96 // P, P, -1)  # the 96 tokens stored before the step, in position order
        qh = query[0, head * grp : (head + 1) * grp, 0]  # the group's query heads (g, D)
        bound = torch.maximum(qh[:, None] * pages.amin(1), qh[:, None] * pages.amax(1)).sum(-1).amax(0)
        always = (pp < sinks) | (pp >= 96 - window)
        assert read[always].all()
        # version 3: a page holding a token read whatever the bounds is read whole; the others are
        # candidates, read whole or not at all, as many as half a page fits in the budget left
        candidates = ~always[:96].view(-1, P).any(-1)
        page_read = read[:96].view(-1, P)
        assert page_read[~candidates].all()
        chosen = page_read.all(-1) & candidates
        assert not page_read[candidates & ~chosen].any()  # whole pages
        if chosen.any() and (candidates & ~chosen).any():
            assert bound[chosen].min() >= bound[candidates & ~chosen].max()
        extra = cap - (97 - P * int(candidates.sum()))
        want = sum(1 for i in range(int(candidates.sum())) if i * P + P / 2 < extra)
        assert int(chosen.sum()) == want
        assert int(read.sum()) == 97 - P * (int(candidates.sum()) - want)


def test_quest_padded_batch_matches_one_by_one(tiny_93):
    def mk():
        return make_stack(
            tiny_93,
            compressor=quant(),
            scheduler=QuestScheduler(page_size=4, dense_layers=1),
            budget=0.5,
            sinks=2,
            window=4,
        )

    _batch_matches_solo(tiny_93, mk)


# --- flexgen ----------------------------------------------------------------------------------


PARTNERS = {  # flexgen alone, in a double and in a triple stack
    "alone": dict,
    "double": lambda: {"compressor": quant()},
    "triple": lambda: {"compressor": quant(), "router": BaseRouter(num_experts=4, top_k=2)},
}


@pytest.mark.parametrize("partners", PARTNERS)
def test_flexgen_is_lossless_and_splits_the_bytes(tiny_93, partners):
    sizes, budget, make = [48, 8, 1, 1], {"budget": 0.5, "sinks": 2, "window": 4}, PARTNERS[partners]
    ref_logits, ref_cache = run_chunks(tiny_93, make_stack(tiny_93, **make(), **budget), tokens(58), sizes)
    for percent in (0, 30, 100):
        stack = make_stack(tiny_93, **make(), scheduler=FlexGenScheduler(fast_percent=percent), **budget)
        logits, cache = run_chunks(tiny_93, stack, tokens(58), sizes)
        assert torch.equal(logits, ref_logits)  # placement never changes an output
        assert cache.nbytes() == ref_cache.nbytes()
        m = stack.metrics()["scheduler/flexgen"]
        assert m["fast_tier_bytes"] + m["slow_tier_bytes"] == cache.nbytes()
        assert m["slow_tier_attention_ms"] is None  # CPU-only: no tier timing
        if percent == 100:
            assert m["slow_tier_bytes"] == m["bytes_moved_per_step"] == m["bytes_moved_prefill"] == 0
        if percent == 0:
            assert m["fast_tier_bytes"] == 0 and m["fast_attention_share"] == 0


def test_flexgen_counts_tier_bytes_and_moves(tiny_93):
    """3 KV heads at 50%: floor(1.5) = 1 fast head-row, 2 slow; independent counts by hand."""
    lm, grp, d, layers = tiny_93, 3, tiny_93.head_dim, tiny_93.num_layers
    stack = make_stack(lm, scheduler=FlexGenScheduler(fast_percent=50))
    sizes = [96, 1, 1]
    _, cache = run_chunks(lm, stack, tokens(98), sizes)
    m = stack.scheduler.metrics()
    assert m["fast_tier_bytes"] == layers * 1 * 98 * FP_TOKEN
    assert m["slow_tier_bytes"] == layers * 2 * 98 * FP_TOKEN
    qo = grp * (d + d) * 4  # a slow head's query out and output back, per KV head-row and query
    assert m["bytes_moved_per_step"] == layers * 2 * (FP_TOKEN + qo)
    assert m["bytes_moved_per_token"] == layers * 2 * (FP_TOKEN + qo)
    assert m["bytes_moved_prefill"] == layers * 2 * 96 * (FP_TOKEN + qo)
    assert m["fast_attention_share"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("percent", [0, 34, 50, 100])
def test_flexgen_split_attention_equals_one_attention(tiny_93, percent):
    """The engine hook's split attention (fast rows, slow rows on the slow tier) equals one pass."""
    stack = make_stack(
        tiny_93, compressor=quant(), scheduler=FlexGenScheduler(fast_percent=percent), sinks=2, window=4
    )
    cache = loop.new_cache(tiny_93, stack, batch=2)
    ids = torch.tensor([tokens(40, 1), tokens(40, 2)])
    real = torch.ones_like(ids, dtype=torch.bool)
    real[1, :9] = False
    loop.forward_batch(tiny_93, cache, ids, real)
    cache.after_forward()
    store = cache.stores[1]
    view = store.view()
    query = torch.randn(2, 9, 3, tiny_93.head_dim, generator=torch.Generator().manual_seed(0))
    store.last_qpos = torch.tensor([[37, 38, 39], [28, 29, 30]])
    mask = att.read_mask(view.pos, view.valid, store.last_qpos, None)
    ref = att.attend(query, view.k, view.v, mask, 0.25, view.bias)
    assert torch.allclose(stack.scheduler.attend_tiers(1, store, query, mask, 0.25), ref, atol=1e-6)
    # mask None is the engine's plain causal attention, as in att.attend: queries over every slot
    t = view.k.shape[2]
    query = torch.randn(2, 9, t, tiny_93.head_dim, generator=torch.Generator().manual_seed(1))
    store.last_qpos = torch.arange(t).expand(2, t)
    ref = att.attend(query, view.k, view.v, None, 0.25)
    assert torch.equal(stack.scheduler.attend_tiers(1, store, query, None, 0.25), ref)


@pytest.mark.parametrize("compressor", [None, "quantized"])
def test_flexgen_slow_tier_copies_only_the_new_tokens(tiny_93, monkeypatch, compressor):
    """A slow tier in other memory (a GPU's store) keeps its copy of the slow rows between steps:
    a decode step copies its one new token per row, not the cache (found: every slow row copied
    and pinned at every step). Moves into another representation copy it again, once. On one CPU
    the tier is made separate by hand; the logits are the same bits as without it."""
    sizes = [40, 1, 1, 1, 1, 1]

    def run():
        parts = {"compressor": quant()} if compressor else {}
        stack = make_stack(tiny_93, scheduler=FlexGenScheduler(fast_percent=34), sinks=2, window=4, **parts)
        return run_chunks(tiny_93, stack, tokens(sum(sizes)), sizes)

    same, _ = run()
    monkeypatch.setattr(FlexGenScheduler, "separate_tier", lambda self, store: True)
    logits, cache = run()
    assert torch.equal(logits, same)
    tiers = [store.copies["flexgen"] for store in cache.stores]
    if compressor is None:  # the prefill's 40 columns, then one per step
        assert [t.copied for t in tiers] == [40 + 5] * tiny_93.num_layers
    else:  # a move of a group (8 tokens) re-copies what the view then holds
        assert all(45 < t.copied < 45 * 3 for t in tiers)
    held = cache.resident_bytes()
    assert held >= sum(t.k.untyped_storage().nbytes() * 2 for t in tiers)  # resident, not stored


def test_flexgen_visible_counts_equal_the_mask_sum():
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 50, (2, 3, 30), generator=gen)
    valid = torch.rand(2, 3, 30, generator=gen) > 0.2
    qpos = torch.tensor([[40, 41, 42, 43], [-1, -1, 20, 21]])
    mask = att.read_mask(pos, valid, qpos, None) & (qpos >= 0)[:, None, :, None]
    assert torch.equal(visible_counts(pos, valid, qpos), mask.sum((2, 3)))


def test_flexgen_padded_batch_matches_one_by_one(tiny_93):
    def mk():
        return make_stack(
            tiny_93,
            router=BaseRouter(num_experts=4, top_k=2),
            compressor=quant(),
            scheduler=FlexGenScheduler(fast_percent=50),
            budget=0.5,
            sinks=2,
            window=4,
        )

    stack, cache = _batch_matches_solo(tiny_93, mk)
    m = stack.scheduler.metrics()
    assert m["fast_tier_bytes"] + m["slow_tier_bytes"] == cache.nbytes()


@pytest.mark.gpu
def test_flexgen_times_the_slow_tier_on_cuda():
    from conftest import tiny_cfg
    from kvbench import models

    lm = models.load(tiny_cfg("llama", heads=9, num_key_value_heads=3), "cuda")
    stack = make_stack(lm, scheduler=FlexGenScheduler(fast_percent=50))
    _, cache = run_chunks(lm, stack, tokens(40), [40])
    store = cache.stores[0]
    with torch.inference_mode():  # as in a decode step: the slow tier's copy is an inference tensor
        view = store.view()
        query = torch.randn(1, 9, 1, lm.head_dim, device="cuda")
        store.last_qpos = torch.tensor([[39]], device="cuda")
        mask = att.read_mask(view.pos, view.valid, store.last_qpos, None)
        out = stack.scheduler.attend_tiers(0, store, query, mask, 0.25)
        assert torch.allclose(out, att.attend(query, view.k, view.v, mask, 0.25), atol=1e-5)
        stack.scheduler.evict(lm.num_layers - 1, cache.stores[-1])  # closes the step: timings read
    assert stack.scheduler.metrics()["slow_tier_attention_ms"] is not None


def test_knobs_are_validated():
    with pytest.raises(ConfigError, match="scheduler.page_size=0"):
        QuestScheduler(page_size=0)
    with pytest.raises(ConfigError, match="scheduler.dense_layers=-1"):
        QuestScheduler(dense_layers=-1)
    with pytest.raises(ConfigError, match="scheduler.fast_percent=101"):
        FlexGenScheduler(fast_percent=101)


# --- padded batch -----------------------------------------------------------------------------


def _batch_matches_solo(lm, mk):
    """Two sequences of different lengths, padded into one batch, give their one-by-one logits."""
    stack, cache, _ = padded_batch_vs_solo(lm, mk, atol=1e-5)
    return stack, cache


@pytest.mark.parametrize(
    "protect, sinks, window, sizes",
    [
        (None, 2, 4, SIZES),
        (50, 2, 4, SIZES),
        (None, 0, 1, [37, 1, 1, 1, 1, 1, 1, 1, 1, 1]),  # pages fill between decode steps
        (None, 30, 40, [96, 1, 1, 1]),  # sinks beyond the window's start: every page blocked
        (60, 3, 2, [90, 5, 1, 1, 1]),
        (None, 11, 5, [70, 1, 1, 1, 1, 1, 1, 1, 1]),  # the first selectable page cut by the sinks
    ],
)
def test_quest_pages_shared_by_the_layers_of_a_step(tiny_93, protect, sinks, window, sizes, monkeypatch):
    """Where every slot holds its own position, the layers of a step share one page layout, made
    from host figures: the logits and read figures are those of pages derived in every layer from
    the stored positions."""
    from kvbench.cache.store import LayerStore

    def go():
        stack = make_stack(tiny_93, scheduler=quest(), budget=0.25, sinks=sinks, window=window)
        logits, _ = run_chunks(tiny_93, stack, tokens(sum(sizes)), sizes, protect=protect)
        return logits, stack.scheduler.metrics(), stack.scheduler

    shared, m_shared, scheduler = go()
    assert scheduler._shared is not None  # the shared path ran
    monkeypatch.setattr(LayerStore, "position_key", lambda self, qpos: None)
    alone, m_alone, _ = go()
    assert torch.equal(shared, alone)
    assert m_shared == m_alone


@pytest.mark.parametrize("selector", ["quest", "router"])
def test_read_figures_settled_in_small_batches_are_those_settled_once(tiny_93, monkeypatch, selector):
    """Quest and the routers keep their reads in one meter (``kvbench.cache.reads.ReadMeter``):
    settling them every three calls gives the figures that settling them once does."""
    from kvbench.cache import reads

    def go():
        made = (
            dict(scheduler=quest())
            if selector == "quest"
            else dict(router=BaseRouter(num_experts=4, top_k=2))
        )
        stack = make_stack(tiny_93, budget=0.25, sinks=2, window=4, **made)
        logits, _ = run_chunks(tiny_93, stack, tokens(N), SIZES)
        return logits, (stack.scheduler or stack.router).metrics()

    once = go()
    monkeypatch.setattr(reads, "SETTLE_EVERY", 3)  # between chunks, by the loop
    often = go()
    monkeypatch.setattr(reads, "SETTLE_LIMIT", 3)  # inside a call, where no loop settles them
    inside = go()
    assert torch.equal(once[0], often[0]) and once[1] == often[1] and once[1]
    assert torch.equal(once[0], inside[0]) and once[1] == inside[1]


@pytest.mark.parametrize("selector", ["quest", "router"])
def test_read_figures_are_settled_between_chunks_not_inside_a_forward(tiny_93, monkeypatch, selector):
    """The loop settles the read figures before a chunk, outside its timed region: no settle runs
    inside a forward (where a kvbench cache is active) while the loop drives the steps."""
    from kvbench.cache import reads

    monkeypatch.setattr(reads, "SETTLE_EVERY", 3)
    made = dict(scheduler=quest()) if selector == "quest" else dict(router=BaseRouter(num_experts=4, top_k=2))
    stack = make_stack(tiny_93, budget=0.25, sinks=2, window=4, **made)
    tech = stack.scheduler or stack.router
    inside: list[bool] = []
    settle = tech._settle

    def watched():
        inside.append(engine._ACTIVE.get() is not None)
        settle()

    monkeypatch.setattr(tech, "_settle", watched)
    run_chunks(tiny_93, stack, tokens(N), SIZES)
    assert inside and not any(inside)


def test_a_quest_decode_step_reads_its_pages_per_query_head_and_repeats_no_mask(tiny):
    """On the torch path Quest's decode step takes its pages' mask per query head
    (:meth:`QuestScheduler.read_head_mask`, one gather): no mask is repeated, and the logits and
    the read figures are those of the mask per KV head repeated by the read."""
    out = {}
    for per_head in (True, False):
        quest = QuestScheduler(page_size=P, dense_layers=1)
        if not per_head:
            quest.read_head_mask = None  # the plan then asks read_mask
        stack = make_stack(tiny, scheduler=quest, budget=0.25, sinks=2, window=4)
        logits, ops = decode_with_ops(tiny, stack, tokens(97))
        out[per_head] = (logits, ops.count("repeat_interleave.self_int"), stack.metrics())
    assert torch.equal(out[True][0], out[False][0])
    assert out[True][2] == out[False][2]
    assert out[True][1] < out[False][1]  # the dense layer's mask, every token, is still repeated
