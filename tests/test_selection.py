"""Token-selection compressors (snapkv, pyramidkv, chunkkv, fastv, random, pikv): they act on the real
cache, compose in stacks and chains, count bytes exactly, keep batches independent, and keep what
their papers say, checked against attention recomputed independently with eager attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_cfg
from helpers import make_stack, run_chunks, tokens
from kvbench import models
from kvbench.cache.side import TokenState
from kvbench.compressors.chunkkv import ChunkKVCompressor
from kvbench.compressors.fastv import FastVCompressor
from kvbench.compressors.pikv import PiKVCompressor
from kvbench.compressors.pyramidkv import PyramidKVCompressor
from kvbench.compressors.quantized import QuantizedCompressor, QuantSegment
from kvbench.compressors.random_select import RandomCompressor
from kvbench.compressors.snapkv import SnapKVCompressor
from kvbench.errors import ConfigError
from kvbench.eval import loop
from kvbench.roles import keep_top
from kvbench.routers.moba import BaseRouter
from kvbench.schedulers.h2o import H2OScheduler
from kvbench.schedulers.streaming_llm import StreamingLLMScheduler
from kvbench.stack import chain

SIZES = [48, 8, 8, 1, 1]  # prefill, two chunks, two decode steps
N = sum(SIZES)
TIGHT = dict(budget=0.3, sinks=2, window=4)

SELECTIONS = {
    "snapkv": lambda: SnapKVCompressor(),
    "pyramidkv": lambda: PyramidKVCompressor(),
    "chunkkv": lambda: ChunkKVCompressor(chunk_size=4),
    "fastv": lambda: FastVCompressor(layer=1),
    "random": lambda: RandomCompressor(seed=3),
    "pikv": lambda: PiKVCompressor(group_size=8),
}


@pytest.fixture(scope="module")
def tiny4():
    """Four layers, for layer schedules (PyramidKV) and FastV's default K = 2."""
    return models.load(tiny_cfg("llama", num_hidden_layers=4), "cpu")


_FULL: dict[int, torch.Tensor] = {}


def full(lm):
    """Logits of the full cache (computed once per model)."""
    if id(lm) not in _FULL:
        _FULL[id(lm)] = run_chunks(lm, make_stack(lm), tokens(N), SIZES)[0]
    return _FULL[id(lm)]


def fp_bytes(lm, tokens_per_layer: int) -> int:
    """K and V of ``tokens_per_layer`` head-row tokens in float32."""
    return tokens_per_layer * lm.head_dim * 2 * 4


def eager_attention(lm, ids: list[int]) -> list[torch.Tensor]:
    """Independent reference: per layer ``(H_q, q, T)`` attention of one full forward (eager)."""
    lm.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = lm.model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    finally:
        lm.model.set_attn_implementation("kvbench")
    return [a[0].float() for a in out.attentions]


def kept_positions(store, head: int) -> list[int]:
    view = store.view()
    return sorted(view.pos[0, head][view.valid[0, head]].tolist())


def top_unprotected(score: torch.Tensor, protected: torch.Tensor, k: int) -> list[int]:
    """Positions (= indices) of the protected ones plus the ``k`` best other scores, ties to the older."""
    rest = (~protected).nonzero()[:, 0]
    best = rest[score[rest].argsort(descending=True, stable=True)[:k]]
    return sorted(protected.nonzero()[:, 0].tolist() + best.tolist())


# --- every technique: alone, in double and triple stacks, in a chain --------------------------------


@pytest.mark.parametrize("name", SELECTIONS)
def test_runs_alone_and_changes_logits_when_tight(tiny_93, name):
    stack = make_stack(tiny_93, compressor=SELECTIONS[name](), **TIGHT)
    logits, cache = run_chunks(tiny_93, stack, tokens(N), SIZES)
    assert not torch.allclose(logits[-10:], full(tiny_93)[-10:], atol=1e-3)
    assert int(cache.stores[-1].row_tokens().max()) <= math.ceil(TIGHT["budget"] * N)


@pytest.mark.parametrize("name", SELECTIONS)
def test_runs_in_double_and_triple_stacks(tiny_93, name):
    """With a scheduler after it, the scheduler's selection gets budget**2 (docs/methods.md)."""
    lm, make, budget = tiny_93, SELECTIONS[name], dict(budget=0.5, sinks=2, window=4)
    stacks = [
        make_stack(lm, compressor=make(), scheduler=H2OScheduler(), **budget),
        make_stack(
            lm,
            router=BaseRouter(num_experts=4),
            compressor=make(),
            scheduler=StreamingLLMScheduler(),
            **budget,
        ),
    ]
    if name != "pikv":  # a selection chained with KIVI, inside a full stack
        stage = {"name": "fastv", "layer": 1} if name == "fastv" else name
        stages = chain(stage, {"name": "quantized", "bits": 4, "group_size": 8})
        stacks.append(
            make_stack(lm, router=BaseRouter(), compressor=stages, scheduler=H2OScheduler(), **budget)
        )
    for stack in stacks:
        logits, cache = run_chunks(lm, stack, tokens(N), SIZES)
        assert torch.isfinite(logits).all()
        rows = [int(s.row_tokens().max()) for s in cache.stores]
        if name == "pyramidkv":  # the top layer's own capacity is below the scheduler's
            assert rows[0] == math.ceil(0.25 * N) and rows[1] < rows[0]
        else:
            assert rows == [math.ceil(0.25 * N)] * lm.num_layers


@pytest.mark.parametrize("name", [n for n in SELECTIONS if n != "pikv"])
def test_lossless_at_budget_one(tiny_93, name):
    stack = make_stack(tiny_93, compressor=SELECTIONS[name](), budget=1.0, sinks=2, window=4)
    logits, cache = run_chunks(tiny_93, stack, tokens(N), SIZES)
    assert torch.allclose(logits, full(tiny_93), atol=1e-5)
    assert all(bool((s.row_tokens() == N).all()) for s in cache.stores)


@pytest.mark.parametrize(("guard", "bits"), [(0.0, 2), (1.0, 8)])
def test_pikv_at_budget_one_is_kivi(tiny_93, guard, bits):
    """Nothing evicted: guard 0 is KIVI at the low widths, guard 1 is KIVI at 8 bits."""
    pikv = PiKVCompressor(guard=guard, group_size=8, key_bits=2, value_bits=2)
    a, ca = run_chunks(
        tiny_93, make_stack(tiny_93, compressor=pikv, budget=1.0, sinks=2, window=4), tokens(N), SIZES
    )
    kivi = QuantizedCompressor(bits=bits, group_size=8)
    b, cb = run_chunks(
        tiny_93, make_stack(tiny_93, compressor=kivi, budget=1.0, sinks=2, window=4), tokens(N), SIZES
    )
    assert torch.allclose(a, b, atol=1e-5) and ca.nbytes() == cb.nbytes()


def test_chain_of_selections_keeps_budget_squared(tiny):
    stages = chain("chunkkv", "snapkv")
    _, cache = run_chunks(
        tiny, make_stack(tiny, compressor=stages, budget=0.5, sinks=2, window=4), tokens(N), SIZES
    )
    kept = math.ceil(0.25 * N)
    for store in cache.stores:
        assert (store.row_tokens() == kept).all()
        assert store.nbytes() == fp_bytes(tiny, kept) * tiny.kv_heads


def test_chain_pyramidkv_then_fastv_runs(tiny4):
    stages = chain("pyramidkv", "fastv")
    logits, cache = run_chunks(
        tiny4, make_stack(tiny4, compressor=stages, budget=0.5, sinks=2, window=4), tokens(N), SIZES
    )
    assert torch.isfinite(logits).all()
    rows = [int(s.row_tokens().max()) for s in cache.stores]
    assert rows == sorted(rows, reverse=True) and rows[-1] < rows[0]


# --- bytes: an independent count ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["snapkv", "random", "fastv"])
def test_selection_bytes_match_capacity(tiny4, name):
    lm = tiny4
    tech = {"snapkv": SnapKVCompressor(), "random": RandomCompressor(), "fastv": FastVCompressor()}[name]
    _, cache = run_chunks(lm, make_stack(lm, compressor=tech, **TIGHT), tokens(N), SIZES)
    cap = math.ceil(TIGHT["budget"] * N)
    per_layer = [N, N, cap, cap] if name == "fastv" else [cap] * 4  # FastV: layers < K keep all
    assert cache.per_layer_bytes() == [fp_bytes(lm, t) * lm.kv_heads for t in per_layer]


def test_chunkkv_bytes_match_kept_tokens(tiny_93):
    _, cache = run_chunks(
        tiny_93, make_stack(tiny_93, compressor=ChunkKVCompressor(), **TIGHT), tokens(N), SIZES
    )
    for store in cache.stores:
        assert store.nbytes() == fp_bytes(tiny_93, int(store.view().valid.sum()))


def quant_bytes(tokens: int, groups: int, d: int, g: int, kb: int, vb: int) -> int:
    """KIVI storage by hand: packed codes, fp16 value zero/step per token and channel group, fp16 key
    zero/step per group and channel, int16 live count per group."""
    return tokens * d * (kb + vb) // 8 + tokens * math.ceil(d / g) * 4 + groups * (d * 4 + 2)


def test_pikv_bytes_match_hand_count(tiny_93):
    lm = tiny_93
    pikv = PiKVCompressor(key_bits=3, value_bits=2, guard=0.4, group_size=8)
    _, cache = run_chunks(
        lm, make_stack(lm, compressor=pikv, budget=0.5, sinks=2, window=4), tokens(N), SIZES
    )
    d = lm.head_dim
    for store in cache.stores:
        expect = fp_bytes(lm, store.fp.size)
        for seg in store.compressed:
            assert isinstance(seg, QuantSegment) and (seg.key_bits, seg.value_bits) in ((8, 8), (3, 2))
            assert int(seg.gcount.sum()) == seg.size and bool((seg.gcount > 0).all())
            expect += quant_bytes(seg.size, seg.gcount.numel(), d, 8, seg.key_bits, seg.value_bits)
        assert store.nbytes() == expect
        assert int(store.row_tokens().max()) <= math.ceil(0.5 * N)


# --- each technique's own invariant -------------------------------------------------------------------


def test_snapkv_keeps_top_pooled_window_attention(tiny):
    """Kept = sinks + window + the top max-pooled scores of the last 16 queries (eager reference)."""
    ids, sinks, window, budget = tokens(48), 2, 4, 0.4
    stack = make_stack(tiny, compressor=SnapKVCompressor(), budget=budget, sinks=sinks, window=window)
    _, cache = run_chunks(tiny, stack, ids, [48])
    cap = math.ceil(budget * 48)
    pos = torch.arange(48)
    protected = (pos < sinks) | (pos >= 48 - window)
    for layer, attn in enumerate(eager_attention(tiny, ids)):
        grouped = attn[:, -16:].sum(1).view(tiny.kv_heads, -1, 48).sum(1)  # (H_kv, T)
        pooled = torch.stack([F.pad(grouped, (3, 3), value=-1.0)[:, i : i + 48] for i in range(7)]).amax(0)
        for h in range(tiny.kv_heads):
            expect = top_unprotected(pooled[h], protected, cap - int(protected.sum()))
            assert kept_positions(cache.stores[layer], h) == expect


def test_pyramidkv_layer_counts_follow_the_schedule(tiny4):
    """Kept per layer: ceil(budget * w_l * seen), w_l falling arithmetically from 2 - 1/beta to
    1/beta (never below sinks + window); the mean matches the uniform budget."""
    budget, beta = 0.5, 20.0
    stack = make_stack(tiny4, compressor=PyramidKVCompressor(beta=beta), budget=budget, sinks=1, window=1)
    _, cache = run_chunks(tiny4, stack, tokens(N), SIZES)
    counts = [int(s.row_tokens()[0]) for s in cache.stores]
    assert all(bool((s.row_tokens() == c).all()) for s, c in zip(cache.stores, counts))
    assert cache.per_layer_bytes() == [fp_bytes(tiny4, c) * tiny4.kv_heads for c in counts]
    top, bottom = 1 / beta, 2 - 1 / beta
    weights = [bottom - (bottom - top) * i / 3 for i in range(4)]
    assert counts == [max(math.ceil(budget * w * N), 2) for w in weights]
    assert counts == sorted(counts, reverse=True) and len(set(counts)) == 4
    assert abs(sum(counts) / 4 - budget * N) <= 1


def test_pyramidkv_refuses_other_allocations():
    with pytest.raises(ConfigError, match="compressor.allocation=uniform"):
        PyramidKVCompressor(allocation="uniform")


def test_chunkkv_keeps_whole_best_chunks(tiny):
    """On a store scored at budget 1, the tight selection keeps whole position-order chunks of the
    unprotected tokens, best summed window score first, filling the capacity to within a chunk."""
    c = 5
    _, cache = run_chunks(
        tiny,
        make_stack(tiny, compressor=ChunkKVCompressor(chunk_size=c), budget=1.0, sinks=2, window=4),
        tokens(48),
        [48],
    )
    store = cache.stores[1]
    pos = store.view().pos[0].clone()  # (H, T), position order
    score = store.state(TokenState("obs16", (16,))).sum(-1)[0].clone()
    tight = make_stack(tiny, compressor=ChunkKVCompressor(chunk_size=c), budget=0.4, sinks=2, window=4)
    tight.compressor.compress(1, store)
    slots = math.ceil(0.4 * 48) - 6
    for h in range(tiny.kv_heads):
        assert pos[h].tolist() == list(range(48))
        rest = torch.arange(2, 44)  # unprotected positions, in order
        chunks = [rest[i : i + c] for i in range(0, len(rest), c)]
        sums = torch.stack([score[h, ch].sum() for ch in chunks])
        kept, used = [], 0
        for i in sums.argsort(descending=True, stable=True).tolist():
            if used + len(chunks[i]) > slots:
                break
            kept += chunks[i].tolist()
            used += len(chunks[i])
        assert slots - used < c
        assert kept_positions(store, h) == sorted([0, 1, 44, 45, 46, 47, *kept])


def test_chunkkv_reuse_layers_shares_positions(tiny):
    stack = make_stack(tiny, compressor=ChunkKVCompressor(chunk_size=4, reuse_layers=2), **TIGHT)
    _, cache = run_chunks(tiny, stack, tokens(N), SIZES)
    for h in range(tiny.kv_heads):
        assert kept_positions(cache.stores[0], h) == kept_positions(cache.stores[1], h)
    with pytest.raises(ConfigError, match="reuse_layers"):
        ChunkKVCompressor(reuse_layers=2, allocation="pyramid")


def test_fastv_drops_the_same_lowest_ranked_positions_from_layer_k(tiny4):
    """Layers < K keep all; every head of layers >= K keeps sinks + window + the positions the last
    prefill token attended to most at layer K-1, averaged over all query heads (eager reference)."""
    ids, budget = tokens(48), 0.4
    stack = make_stack(tiny4, compressor=FastVCompressor(layer=2), budget=budget, sinks=2, window=4)
    _, cache = run_chunks(tiny4, stack, ids, [48])
    rank = eager_attention(tiny4, ids)[1][:, -1].mean(0)  # (T,) last query, all heads of layer 1
    pos = torch.arange(48)
    protected = (pos < 2) | (pos >= 44)
    expect = top_unprotected(rank, protected, math.ceil(budget * 48) - 6)
    for layer, store in enumerate(cache.stores):
        for h in range(tiny4.kv_heads):
            assert kept_positions(store, h) == (list(range(48)) if layer < 2 else expect)


def test_fastv_decode_steps_read_its_other_layers_as_bare_steps(tiny4, monkeypatch):
    """At a decode step only layer K-1 computes the probabilities FastV reads (once, its output
    taken from them); every other layer reads its rows as a step no technique acts in reads them
    (plain SDPA, no view, no mask), with the logits the masked read gives them."""
    from kvbench.cache import attention as att
    from kvbench.cache import engine

    ids = tokens(40)

    def run(bare: bool):
        observed, plain, masked_reads = [], [], []
        real_observed, real_attend = engine.KVCache._observed_step, att.attend
        real_masked = engine.KVCache._attend_masked

        def spy_observed(self, layer, *args):
            observed.append(layer)
            return real_observed(self, layer, *args)

        def spy_masked(self, layer, *args, **kwargs):
            masked_reads.append(layer)
            return real_masked(self, layer, *args, **kwargs)

        def spy_attend(query, key, value, mask, scaling, bias=None):
            plain.append(mask is None)
            return real_attend(query, key, value, mask, scaling, bias)

        monkeypatch.setattr(engine.KVCache, "_observed_step", spy_observed)
        monkeypatch.setattr(engine.KVCache, "_attend_masked", spy_masked)
        monkeypatch.setattr(att, "attend", spy_attend)
        if not bare:  # the layers no observer reads through the masked read, as before
            real_step = engine.KVCache.attend

            def masked(self, layer, query, scaling, window):
                plan = self.plan(query.shape[2], window)
                if plan.first[layer] < query.shape[2]:
                    return real_step(self, layer, query, scaling, window)
                return spy_masked(self, layer, self.stores[layer], query, scaling, plan)

            monkeypatch.setattr(engine.KVCache, "attend", masked)
        stack = make_stack(tiny4, compressor=FastVCompressor(layer=2), budget=0.4, sinks=2, window=4)
        cache = loop.new_cache(tiny4, stack)
        loop.step(tiny4, cache, ids[:32])
        observed.clear(), plain.clear(), masked_reads.clear()
        logits = torch.stack([loop.step(tiny4, cache, [t])[-1] for t in ids[32:]])
        monkeypatch.undo()
        return logits, observed, plain, masked_reads

    logits, observed, plain, masked_reads = run(bare=True)
    assert observed == [1] * 8  # layer K-1 of each of the 8 steps
    assert plain == [True] * (3 * 8)  # the other three layers: plain SDPA over the rows
    assert masked_reads == []  # and no masked read (its view, its mask's checks)
    masked, _, _, before = run(bare=False)
    assert sorted(set(before)) == [0, 2, 3] and torch.equal(logits, masked)


def test_fastv_layer_is_checked_at_bind(tiny):
    with pytest.raises(ConfigError, match="compressor.layer=2: must be < the model's 2 layers"):
        make_stack(tiny, compressor=FastVCompressor())
    with pytest.raises(ConfigError, match="compressor.layer=0"):
        FastVCompressor(layer=0)


def test_random_keeps_capacity_and_depends_on_seed(tiny):
    def kept(seed):
        stack = make_stack(tiny, compressor=RandomCompressor(seed=seed), **TIGHT)
        _, cache = run_chunks(tiny, stack, tokens(N), SIZES)
        return [[kept_positions(s, h) for h in range(tiny.kv_heads)] for s in cache.stores]

    a, b, a2 = kept(0), kept(1), kept(0)
    cap = math.ceil(TIGHT["budget"] * N)
    for rows in a:
        for row in rows:
            assert len(row) == cap and {0, 1, *range(N - 4, N)} <= set(row)
    assert a == a2 and a != b


def test_pikv_guards_the_most_important_retained_tokens(tiny_93):
    """After one prefill: the retained tokens are the top accumulated attention (eager reference);
    the oldest whole groups of the unprotected ones leave the window, and of those the most
    important round(guard * groups) groups are stored at 8 bits, the rest at the low widths."""
    lm, ids, g, guard, budget = tiny_93, tokens(48), 8, 0.4, 0.8
    pikv = PiKVCompressor(key_bits=2, value_bits=4, guard=guard, group_size=g)
    _, cache = run_chunks(lm, make_stack(lm, compressor=pikv, budget=budget, sinks=2, window=4), ids, [48])
    pos = torch.arange(48)
    protected = (pos < 2) | (pos >= 44)
    cap = math.ceil(budget * 48)
    for layer, attn in enumerate(eager_attention(lm, ids)):
        acc = attn.sum(1).view(lm.kv_heads, -1, 48).sum(1)  # (H_kv, T) accumulated attention
        store = cache.stores[layer]
        segs = {(s.key_bits, s.value_bits): s for s in store.compressed}  # type: ignore[attr-defined]
        for h in range(lm.kv_heads):
            retained = top_unprotected(acc[h], protected, cap - 6)
            assert kept_positions(store, h) == retained
            unprotected = [p for p in retained if not protected[p]]
            leaving = torch.tensor(unprotected[: len(unprotected) // g * g])  # oldest whole groups
            n_high = math.floor(guard * len(leaving) / g + 0.5) * g
            high = sorted(leaving[acc[h, leaving].argsort(descending=True, stable=True)[:n_high]].tolist())
            low = sorted(set(leaving.tolist()) - set(high))
            assert (len(high), len(low)) == (16, 16)
            for bits, members in (((8, 8), high), ((2, 4), low)):
                seg = segs[bits]
                start = int(seg.lens[:h].sum())
                assert sorted(seg.pos[start : start + int(seg.lens[h])].tolist()) == members
    assert pikv.metrics()["guard_share"] == pytest.approx(0.5)


def test_pikv_stored_guard_share_stays_at_guard(tiny_93):
    """Without eviction, each head-row's 8-bit share of its quantized tokens is guard to within half
    a group, at every compression point."""
    g, guard = 8, 0.3
    stack = make_stack(
        tiny_93, compressor=PiKVCompressor(guard=guard, group_size=g), budget=1.0, sinks=2, window=4
    )
    cache = loop.new_cache(tiny_93, stack)
    ids, at = tokens(N), 0
    for n in [24, 8, 8, 8, 8, 1, 1]:
        loop.step(tiny_93, cache, ids[at : at + n])
        at += n
        for store in cache.stores:
            segs = {(s.key_bits, s.value_bits): s.lens for s in store.compressed}  # type: ignore[attr-defined]
            zero = torch.zeros_like(store.fp.lens)
            q8, qlow = segs.get((8, 8), zero), segs.get((2, 2), zero)
            assert bool(((q8 - guard * (q8 + qlow)).abs() <= g / 2).all())


# --- a padded batch equals one-by-one runs ------------------------------------------------------------


def run_batch(lm, make, seqs, prefill, chunks):
    """Padded batch of ``seqs`` (left padding at prefill) with the stack after each forward."""
    cache = loop.new_cache(lm, make(), batch=len(seqs))
    width = max(prefill)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    real = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (seq, p) in enumerate(zip(seqs, prefill)):
        ids[i, width - p :] = torch.tensor(seq[:p])
        real[i, width - p :] = True
    outs = [loop.forward_batch(lm, cache, ids, real)[:, -1]]
    cache.after_forward()
    at = list(prefill)
    for n in chunks:
        ids = torch.tensor([seq[a : a + n] for seq, a in zip(seqs, at)])
        outs.append(loop.forward_batch(lm, cache, ids, torch.ones_like(ids, dtype=torch.bool))[:, -1])
        cache.after_forward()
        at = [a + n for a in at]
    return torch.stack(outs, 1), cache


@pytest.mark.parametrize("name", SELECTIONS)
def test_padded_batch_equals_one_by_one(tiny_93, name):
    lm = tiny_93
    make = lambda: make_stack(lm, compressor=SELECTIONS[name](), budget=0.4, sinks=2, window=4)  # noqa: E731
    seqs, prefill, chunks = [tokens(50, 1), tokens(35, 2)], [40, 25], [8, 1, 1]
    batch, bcache = run_batch(lm, make, seqs, prefill, chunks)
    for i, (seq, p) in enumerate(zip(seqs, prefill)):
        solo, scache = run_batch(lm, make, [seq], [p], chunks)
        assert torch.allclose(batch[i], solo[0], atol=1e-5)
        for bs, ss in zip(bcache.stores, scache.stores):
            rows = bs.row_tokens().view(2, -1)[i]
            assert torch.equal(rows, ss.row_tokens())
            for h in range(lm.kv_heads):
                view, sview = bs.view(), ss.view()
                got = sorted(view.pos[i, h][view.valid[i, h]].tolist())
                assert got == sorted(sview.pos[0, h][sview.valid[0, h]].tolist())


def test_window_scores_of_ragged_rows_in_position_order_equal_the_sorted_pool():
    """Rows of different lengths in position order pool as the position sort would order them."""
    from kvbench.cache.store import LayerStore
    from kvbench.schedulers.adakv import AdaKVScheduler
    from kvbench.select import pool_scores

    gen = torch.Generator().manual_seed(0)
    store = LayerStore(2, 3, 4, torch.float32, torch.device("cpu"))
    store.append(torch.randn(2, 3, 40, 4, generator=gen), torch.randn(2, 3, 40, 4, generator=gen))
    store.keep(torch.rand(2, 3, 40, generator=gen) > 0.3)  # rows keep different numbers
    view = store.view()
    assert store.in_position_order() and not view.dense
    sched = AdaKVScheduler(pool=5)
    ring = torch.rand(*view.valid.shape, sched.obs_window, generator=gen) * view.valid[..., None]
    store.set_state(sched.ring, ring)
    want = pool_scores(ring.sum(-1), view.pos, view.valid, 5)
    assert torch.equal(sched.window_scores(store), want)


def test_an_eviction_breaks_ties_by_position_whatever_the_layout():
    """The lowest scores leave, ties keeping the earlier position, in rows in position order or not:
    the selection does not depend on where the cache put its tokens."""
    from kvbench.select import lowest

    scores = torch.tensor([[[3.0, 1.0, 1.0, 2.0, 1.0, float("inf")]]])
    pos = torch.tensor([[[0, 1, 2, 3, 4, 5]]])
    assert sorted(lowest(scores, None, 3)[0, 0].tolist()) == [1, 2, 4]
    assert sorted(lowest(scores, None, 4)[0, 0].tolist()) == [2, 4]  # ties: the later positions leave
    perm = torch.tensor([4, 0, 5, 2, 1, 3])  # the same tokens, another layout
    shuffled, spos = scores[..., perm], pos[..., perm]
    left = lowest(shuffled, spos.argsort(-1), 4)[0, 0]
    assert sorted(spos[0, 0, left].tolist()) == [2, 4]


def test_a_kept_selection_breaks_ties_by_position_whatever_the_layout():
    """:func:`keep_top` with the columns in position order keeps, among tied scores, the earlier
    positions: in any layout of the same tokens, the same tokens (as :func:`lowest` leaves them)."""
    scores = torch.tensor([[[3.0, 1.0, 1.0, 2.0, 1.0, float("inf")]]])
    pos = torch.tensor([[[0, 1, 2, 3, 4, 5]]])
    want = keep_top(scores, None, 4)  # in position order: ties keep the earlier slot, position 1
    assert want[0, 0].tolist() == [True, True, False, True, False, True]
    gen = torch.Generator().manual_seed(8)
    for _ in range(20):
        perm = torch.randperm(6, generator=gen)
        shuffled, spos = scores[..., perm], pos[..., perm]
        valid = torch.ones_like(shuffled, dtype=torch.bool)
        for v in (None, valid):
            kept = keep_top(shuffled, v, 4, by_pos=spos.argsort(-1))
            assert torch.equal(kept, want[..., perm])


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv"])
def test_a_chunk_after_decode_steps_keeps_what_a_padded_batch_keeps(name):
    """One sequence's one-token evictions move its last tokens into the freed slots (rows out of
    position order); a chunk after them keeps, among pooled scores that tie, the earlier positions,
    as a padded batch (which compacts in order) does: the same logits one by one and in a batch."""
    from helpers import padded_batch_vs_solo

    lm = models.load(tiny_cfg("llama", heads=8, num_key_value_heads=2), "cpu")
    make = lambda: make_stack(lm, compressor=SELECTIONS[name](), budget=0.15, sinks=2, window=8)  # noqa: E731
    padded_batch_vs_solo(lm, make, tokens(68, 1), tokens(49, 2), prefills=(54, 35), chunks=(1, 12, 1))


def test_distinct_scores_leave_in_the_same_order_without_the_position_order():
    """Scores distinct in each row (``distinct_scores``: `lru`'s and `lru_plus`'s keys,
    `streaming_llm`'s positions) leave the same tokens, in the same order, whether or not the rows'
    position order breaks ties: there are none."""
    from kvbench.select import lowest

    gen = torch.Generator().manual_seed(0)
    for t in (6, 50, 300):
        pos = torch.stack([torch.randperm(t, generator=gen) for _ in range(4)]).view(2, 2, t)
        scores = torch.randperm(2 * 2 * t, generator=gen).double().view(2, 2, t)
        for kept in (0, 1, t // 2, t - 1):
            assert torch.equal(lowest(scores, pos.argsort(-1), kept), lowest(scores, None, kept))


def test_one_leaving_of_distinct_scores_is_their_lowest_unsorted():
    """A decode step's eviction of distinct scores (one token leaves each head-row) takes the
    ``argmin`` of the scores with the protected at +inf: the token :func:`lowest` takes by a sort."""
    from kvbench.select import lowest

    gen = torch.Generator().manual_seed(1)
    for t in (2, 9, 300):
        scores = torch.randperm(2 * 3 * t, generator=gen).double().view(2, 3, t)
        scores[..., : t // 3] = float("inf")  # protected
        assert torch.equal(scores.argmin(-1, keepdim=True), lowest(scores, None, t - 1))


@pytest.mark.parametrize("compressor", ["quantized", "pruning"])
@pytest.mark.parametrize("protect", [None, 30])
@pytest.mark.parametrize("sizes", [[40, 1, 1, 1, 1, 1, 1, 1, 1, 1], [7, 9, 1, 1, 1], [33, 8, 1]])
def test_moves_counted_on_the_host_are_those_the_device_counts(
    tiny_93, monkeypatch, protect, sizes, compressor
):
    """Where the host knows how many tokens every head-row moves out (``select.moving_per_row``:
    full rows in position order, nothing protected beyond the sinks and window), that is the
    number the move takes, and the columns it names (``select.leaving_columns``: past the sinks)
    are the tokens the device marks; elsewhere it says it does not know. The logits and bytes are
    those of counting on the device: KIVI's groups (a count, then the mask) and ThinK's tokens one
    at a time (``move_group=1``: the columns, :func:`select.leaving`)."""
    from kvbench import select
    from kvbench.compressors import pruning, quantized

    asked, original = [], select.moving_per_row

    def checked(store, budget, group_size):
        n = original(store, budget, group_size)
        ok = ~budget.protected_fp(store) & store.fp_valid()
        movable = (ok.sum(-1) // group_size) * group_size
        if n is not None:
            assert movable.tolist() == [n] * movable.numel()
            marked = select._oldest(ok, movable)
            cols = torch.zeros_like(marked)
            start = min(budget.sinks, store.seen_host[0])
            cols[:, start : start + n] = True
            assert torch.equal(cols, marked)
        asked.append(n)
        return n

    def run(host: bool):
        for module in (select, quantized, pruning):
            monkeypatch.setattr(module, "moving_per_row", checked if host else lambda *a: None)
        if compressor == "quantized":
            technique = QuantizedCompressor(bits=4, group_size=4)
        else:
            technique = pruning.PruningCompressor(keep_ratio=0.5, move_group=1)
        stack = make_stack(tiny_93, compressor=technique, sinks=2, window=4)
        out, cache = run_chunks(tiny_93, stack, tokens(sum(sizes)), sizes, protect=protect)
        return out, cache.nbytes()

    device = run(False)
    host = run(True)
    assert torch.equal(device[0], host[0]) and device[1] == host[1]
    assert asked and (protect is None) == any(n is not None for n in asked)


def test_keep_top_takes_one_capacity_for_every_sequence_without_an_upload():
    """A capacity given as an int keeps what the same capacity per sequence keeps, protected and
    padding slots included, and makes no tensor from a host value (on a GPU, an upload waits for
    the stream): it is a view of the device's held ``arange``."""

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    for k in (0, 3, 7, 40):
        scores = torch.rand(2, 3, 12, generator=gen)
        scores[torch.rand(2, 3, 12, generator=gen) > 0.8] = float("inf")  # protected
        valid = torch.rand(2, 3, 12, generator=gen) > 0.2
        with Made() as made:
            kept = keep_top(scores, valid, k)
        assert "aten.lift_fresh.default" not in made.ops
        assert torch.equal(kept, keep_top(scores, valid, torch.tensor([k, k])))


@pytest.mark.parametrize("protect", [None, 60], ids=["sinks-window", "protect-from"])
@pytest.mark.parametrize(
    "stacked",
    [
        {"compressor": lambda: PiKVCompressor(group_size=4)},
        {"compressor": lambda: QuantizedCompressor(bits=4, group_size=4), "scheduler": H2OScheduler},
        {"compressor": lambda: QuantizedCompressor(bits=2, group_size=8), "scheduler": StreamingLLMScheduler},
    ],
    ids=["pikv", "quantized-h2o", "quantized-streaming"],
)
def test_an_eviction_keeps_exactly_its_capacity_uncounted_where_the_protected_fit(
    tiny_93, monkeypatch, protect, stacked
):
    """Where one capacity holds for every sequence and no head-row can hold more protected tokens
    (the sinks and the window, or every position from ``protect_from`` on: ``select.protected_most``),
    an eviction over several segments keeps exactly that capacity without counting the protected
    tokens; what it keeps is what counting them keeps."""
    from kvbench import select

    fitted, original = [], select.keep_top

    def checked(scores, valid, k, protected_fit=False, finite=False, by_pos=None):
        kept = original(scores, valid, k, protected_fit=protected_fit, finite=finite, by_pos=by_pos)
        if protected_fit:
            assert torch.equal(kept, original(scores, valid, k, by_pos=by_pos))
            fitted.append(k)
        return kept

    monkeypatch.setattr(select, "keep_top", checked)
    stack = make_stack(tiny_93, **{role: make() for role, make in stacked.items()}, **TIGHT)
    run_chunks(tiny_93, stack, tokens(N), SIZES, protect=protect)
    assert fitted


@pytest.mark.parametrize(
    "make",
    [SnapKVCompressor, PyramidKVCompressor, H2OScheduler, RandomCompressor, lambda: SnapKVCompressor(pool=1)],
    ids=["snapkv", "pyramidkv", "h2o", "random", "snapkv-unpooled"],
)
@pytest.mark.parametrize("sinks, window", [(2, 4), (0, 4), (4, 1), (0, 1)])
def test_an_eviction_ranks_only_the_columns_between_the_protected_ones(
    tiny_93, monkeypatch, make, sinks, window
):
    """Where full rows of one segment protect only the sinks and the window, those are the first and
    the last columns in position order, and an eviction ranks only the columns between them, with
    no mask (``select.leaving_by_position``): the same columns, in the same order, as
    :func:`select.lowest` of the scores with the protected ones at +inf."""
    from kvbench import select

    compared, original = [], select.leaving_by_position

    def checked(store, budget, kept, score, in_order=None):
        cols = original(store, budget, kept, score, in_order)
        if cols is not None:
            masked = score().masked_fill(budget.protected_view(store), float("inf"))
            order = None if store.in_position_order() else store.by_position()
            assert torch.equal(cols, select.lowest(masked, order, kept))
            compared.append(order is None)
        return cols

    monkeypatch.setattr(select, "leaving_by_position", checked)
    technique = make()
    role = "scheduler" if isinstance(technique, H2OScheduler) else "compressor"
    stack = make_stack(tiny_93, **{role: technique}, budget=0.3, sinks=sinks, window=window)
    run_chunks(tiny_93, stack, tokens(N + 12), SIZES + [1] * 12)
    assert False in compared  # rows out of position order after a drop
