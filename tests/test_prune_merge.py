"""ThinK key-channel pruning (compressor/pruning) and k-means token merging (compressor/distillation):
lossless at their identity settings, acting when tight, exact byte counts, their invariants, and
padded batches equal to one-by-one runs."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_cfg
from helpers import budget_of, make_stack, moved_in_groups, padded_batch_vs_solo, run_chunks, tokens
from kvbench import models
from kvbench.cache import attention as att
from kvbench.cache import held
from kvbench.cache.engine import HitProbe
from kvbench.cache.segments import FPSegment
from kvbench.cache.store import LayerStore
from kvbench.compressors import distillation
from kvbench.compressors.distillation import DistillationCompressor, MergedSegment
from kvbench.compressors.pruning import KeptChannels, PrunedSegment, PruningCompressor
from kvbench.errors import ConfigError
from kvbench.eval import loop
from kvbench.roles import BindContext
from kvbench.routers.moba import BaseRouter
from kvbench.schedulers.h2o import H2OScheduler
from kvbench.schedulers.streaming_llm import StreamingLLMScheduler
from kvbench.stack import chain

SIZES = [48, 8, 8, 1, 1]  # prefill, two chunks, two decode steps
N = sum(SIZES)
SINKS, WINDOW = 2, 4


def full(lm):
    return run_chunks(lm, make_stack(lm), tokens(N), SIZES)[0]


def counted_bytes(cache, lm, d_keep: int = 0) -> int:
    """Stored bytes counted by hand from the kept tokens and the shapes (float32 model)."""
    d, h, total = lm.head_dim, lm.kv_heads, 0
    for store in cache.stores:
        for seg in store.segments:
            if isinstance(seg, FPSegment):
                total += seg.size * 2 * d * 4  # K and V
            elif isinstance(seg, PrunedSegment):
                total += seg.size * (d_keep + d) * 4  # kept key channels and whole values
            elif isinstance(seg, MergedSegment):
                total += seg.size * (2 * d * 4 + 4)  # centroid K and V, int32 count
            else:
                raise AssertionError(type(seg))
        if store.side(KeptChannels) is not None:
            total += h * store.batch * d_keep * 2  # int16 kept-channel indices per head-row
    return total


def pruning(**kw):
    return PruningCompressor(**kw)


# --- pruning ---------------------------------------------------------------------------------


def test_pruning_lossless_at_keep_ratio_one(tiny_93):
    stack = make_stack(tiny_93, compressor=pruning(keep_ratio=1.0), sinks=SINKS, window=WINDOW)
    logits, cache = run_chunks(tiny_93, stack, tokens(N), SIZES)
    assert torch.allclose(logits, full(tiny_93), atol=1e-5)
    assert isinstance(cache.stores[0].compressed[0], PrunedSegment)


@pytest.mark.parametrize("group", [1, 7, 16])
def test_pruning_acts_and_stores_kept_channels_only(tiny_93, group):
    lm = tiny_93
    stack = make_stack(lm, compressor=pruning(keep_ratio=0.5, move_group=group), sinks=SINKS, window=WINDOW)
    logits, cache = run_chunks(lm, stack, tokens(N), SIZES, shadow=True)
    assert not torch.allclose(logits[-10:], full(lm)[-10:], atol=1e-3)
    d, h, keep = lm.head_dim, lm.kv_heads, lm.head_dim // 2
    pruned = (N - SINKS - WINDOW) // group * group  # the unprotected tokens left in whole groups
    for layer, store in enumerate(cache.stores):
        seg = store.compressed[0]
        assert isinstance(seg, PrunedSegment) and seg.kp.shape == (pruned * h, keep)
        assert store.nbytes() == pruned * h * (keep + d) * 4 + (N - pruned) * h * 2 * d * 4 + h * keep * 2
        # Reads: exact keys on the kept channels, zeros on the others.
        exact = torch.cat(cache.shadow[layer], dim=2)[0]  # (H, S, D) keys this run produced
        k, _ = seg.read(torch.float32)
        kept = store.side(KeptChannels)
        chans = kept.channels.long()
        # The int64 index the reads and moves take: made once, shared with the segment, held (in the
        # resident bytes) and not stored (the int16 channels are).
        assert kept.index.dtype == torch.int64 and torch.equal(kept.index, chans)
        assert seg.index is kept.index and kept.tensors() == [kept.channels]
        storages = {t.untyped_storage().data_ptr() for t in held.tensors(store)}
        assert kept.index.untyped_storage().data_ptr() in storages
        for row in range(h):
            rk = k[row * pruned : (row + 1) * pruned]
            mask = torch.zeros(d, dtype=torch.bool)
            mask[chans[row]] = True
            assert torch.equal(rk[:, mask], exact[row, seg.pos[row * pruned : (row + 1) * pruned]][:, mask])
            assert (rk[:, ~mask] == 0).all()
    assert cache.nbytes() == counted_bytes(cache, lm, keep)


def test_pruning_moves_the_tokens_past_the_window_in_whole_groups(tiny_93):
    """After every forward (a prefill, chunks, one-token steps; one sequence and a left-padded
    batch of two), each head-row's pruned tokens are whole groups of ``move_group`` of its oldest
    unprotected tokens, and fewer than a group of them stay whole past the sinks and the window;
    with ``move_group=1``, every one of them has left."""

    def stack_of(group):
        return make_stack(tiny_93, compressor=pruning(move_group=group), sinks=SINKS, window=WINDOW)

    moved_in_groups(tiny_93, stack_of, SINKS, WINDOW)


def test_pruning_stops_watching_the_queries_once_every_channel_set_is_chosen(tiny_93):
    """Until every head-row of every layer has chosen its kept channels, the read plan hands
    ``pruning`` the queries; after (here, from the prefill's compression point on), a decode step
    reads as if no technique asked for them (the bare read), with the logits the read that hands
    them over gives."""
    lm, ids = tiny_93, tokens(N)

    def run(always: bool):
        comp = pruning(move_group=1)
        if always:  # as before version 4: handed the queries at every forward
            comp.watches_queries = lambda stores: True  # type: ignore[method-assign]
        cache = loop.new_cache(lm, make_stack(lm, compressor=comp, sinks=SINKS, window=WINDOW))
        logits = [loop.step(lm, cache, ids[:40])[-1]]
        plans = [cache.plan(40, None)]  # the forward's own plan, held until the next one starts
        for token in ids[40:46]:
            logits.append(loop.step(lm, cache, [token])[-1])
            plans.append(cache.plan(1, None))
        return comp, torch.stack(logits), plans

    comp, logits, plans = run(always=False)
    assert plans[0].query_observers == (comp,) and not plans[0].bare  # the prefill chooses them
    assert all(p.bare and p.query_observers == () for p in plans[1:])
    _, handed, old = run(always=True)
    assert not any(p.bare for p in old)
    assert torch.equal(logits, handed)


def test_pruning_keeps_top_channels_by_query_key_score(tiny):
    """Kept channels are the top ‖Q_obs[:, j]‖·‖K[:, j]‖ over the group's last 16 queries; fixed after."""
    comp = pruning(keep_ratio=0.5, obs_window=16)
    stack = make_stack(tiny, compressor=comp, sinks=SINKS, window=WINDOW)
    seen: dict[int, torch.Tensor] = {}
    spy_target = comp.observe_queries

    def spy(layer, store, query, qpos):
        seen[layer] = query.clone()
        spy_target(layer, store, query, qpos)

    comp.observe_queries = spy  # type: ignore[method-assign]
    ids = tokens(N)
    cache = loop.new_cache(tiny, stack)
    loop.forward(tiny, cache, ids[:40])
    keys = [s.view().k.clone() for s in cache.stores]
    cache.after_forward()
    h, d = tiny.kv_heads, tiny.head_dim
    first = []
    for layer, store in enumerate(cache.stores):
        q = seen[layer][0, :, -16:].reshape(h, -1, d)  # (H, g * 16, D): the group's window queries
        score = q.pow(2).sum(1).sqrt() * keys[layer][0].pow(2).sum(1).sqrt()  # (H, D)
        chans = store.side(KeptChannels).channels.long()
        for row in range(h):
            kept = torch.zeros(d, dtype=torch.bool)
            kept[chans[row]] = True
            assert int(kept.sum()) == d // 2
            assert score[row][kept].min() >= score[row][~kept].max()
        first.append(chans.clone())
    at = 40
    for n in [8, 8, 1, 1]:
        loop.step(tiny, cache, ids[at : at + n])
        at += n
    for store, chans in zip(cache.stores, first):
        assert torch.equal(
            store.side(KeptChannels).channels.long(), chans
        )  # chosen once, at the first compression point


# --- distillation ----------------------------------------------------------------------------


def test_distillation_lossless_at_budget_one(tiny_93):
    stack = make_stack(tiny_93, compressor=DistillationCompressor(), budget=1.0, sinks=SINKS, window=WINDOW)
    logits, _ = run_chunks(tiny_93, stack, tokens(N), SIZES)
    assert torch.allclose(logits, full(tiny_93), atol=1e-5)


def test_distillation_acts_counts_bytes_and_absorbs_every_old_token(tiny_93):
    lm = tiny_93
    stack = make_stack(lm, compressor=DistillationCompressor(), budget=0.3, sinks=SINKS, window=WINDOW)
    logits, cache = run_chunks(lm, stack, tokens(N), SIZES, shadow=True)
    assert not torch.allclose(logits[-10:], full(lm)[-10:], atol=1e-3)
    cap = math.ceil(0.3 * N)
    old = list(range(SINKS, N - WINDOW))
    for layer, store in enumerate(cache.stores):
        seg = store.compressed[0]
        assert isinstance(seg, MergedSegment)
        assert (store.row_tokens() == cap).all()  # exactly the budget of units per head-row
        assert (seg.lens == cap - SINKS - WINDOW).all()
        mpos, owner = seg.members()
        rows = torch.repeat_interleave(torch.arange(lm.kv_heads), seg.lens)[owner]
        for row in range(lm.kv_heads):
            assert sorted(mpos[rows == row].tolist()) == old  # counts sum to the absorbed tokens
        assert int(seg.count.sum()) == len(old) * lm.kv_heads
        # A unit's position is its latest member's; its key is the mean of its members' keys.
        latest = torch.full((seg.size,), -1).scatter_reduce(0, owner, mpos, reduce="amax")
        assert torch.equal(latest, seg.pos)
        exact = torch.cat(cache.shadow[layer], dim=2)[0]  # (H, S, D) keys this run produced
        mean = torch.zeros_like(seg.k).index_add_(0, owner, exact[rows, mpos]) / seg.count[:, None]
        assert torch.allclose(seg.k, mean, atol=1e-5)
        assert torch.equal(seg.bias(), seg.count.float().log())
    assert cache.nbytes() == counted_bytes(cache, lm)
    assert cache.stack.metrics()["compressor/distillation"]["tokens_per_merged_unit"] > 1


@pytest.mark.parametrize("scheduler", [None, "h2o"])
def test_distillation_merges_in_rectangles_as_in_general(tiny_93, monkeypatch, scheduler):
    """Where every head-row holds the same units (one sequence's chunks and decode steps), a merge
    goes in rectangles from host figures, without the general merge's synchronisations
    (tests/test_catalog.py counts them): the logits, stored bytes, member positions and metrics are
    the general merge's, bit for bit."""

    def run():
        stack = make_stack(
            tiny_93,
            compressor=DistillationCompressor(),
            scheduler=H2OScheduler() if scheduler else None,
            budget=0.3,
            sinks=SINKS,
            window=WINDOW,
        )
        logits, cache = run_chunks(tiny_93, stack, tokens(N), [N - 30, 8, *[1] * 14, 8])
        members = [seg.mpos for store in cache.stores for seg in store.compressed]
        return logits, cache.nbytes(), members, stack.metrics()

    fast = run()
    calls = []
    real = distillation.gather_rows
    monkeypatch.setattr(distillation, "gather_rows", lambda *a: calls.append(1) or real(*a))
    run()
    assert calls  # the rectangles were taken
    monkeypatch.setattr(distillation, "same_everywhere", lambda *a: False)
    general = run()
    assert torch.equal(fast[0], general[0]) and fast[1] == general[1] and fast[3] == general[3]
    assert all(torch.equal(a, b) for a, b in zip(fast[2], general[2], strict=True))


def _hand_store(h: int, d: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> LayerStore:
    """A one-sequence store with the same full-precision tokens ``(T, D)`` in every head-row."""
    store = LayerStore(1, h, d, torch.float32, torch.device("cpu"))
    store.fp.rows.append({"k": k.expand(h, *k.shape), "v": v.expand(h, *v.shape), "pos": pos.expand(h, -1)})
    store.seen = torch.tensor([int(pos.max()) + 1])
    return store


def _merged_pair(c: int = 4, h: int = 2, d: int = 16):
    """The same cache twice: ``c`` identical tokens stored separately, and as one merged unit."""
    g = torch.Generator().manual_seed(0)
    others_k, others_v = torch.randn(5, d, generator=g), torch.randn(5, d, generator=g)
    twin_k, twin_v = torch.randn(1, d, generator=g), torch.randn(1, d, generator=g)
    twin_pos, other_pos = torch.tensor([1, 3, 5, 7]), torch.tensor([0, 2, 4, 6, 8])
    sep = _hand_store(
        h,
        d,
        torch.cat([twin_k.expand(c, d), others_k]),
        torch.cat([twin_v.expand(c, d), others_v]),
        torch.cat([twin_pos, other_pos]),
    )
    merged = _hand_store(h, d, others_k, others_v, other_pos)
    merged.seen = sep.seen.clone()
    unit = MergedSegment(
        lens=torch.ones(h, dtype=torch.long),
        pos=torch.full((h,), 7),
        k=twin_k.repeat(h, 1),
        v=twin_v.repeat(h, 1),
        count=torch.full((h,), c, dtype=torch.int32),
        mpos=twin_pos.repeat(h),
    )
    merged.adopt(unit, {}, first=True)
    query = torch.randn(1, 3 * h, 2, d, generator=g)  # GQA: 3 query heads per KV head
    return sep, merged, query


def test_merged_identical_tokens_attend_like_the_separate_tokens():
    """Proportional attention: one unit of c identical tokens + log(c) == the c tokens."""
    sep, merged, query = _merged_pair()
    outs = []
    for store in (sep, merged):
        view = store.view()
        mask = view.valid[:, :, None, :].expand(-1, -1, query.shape[2], -1)
        outs.append(att.attend(query, view.k, view.v, mask, 0.25, view.bias))
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    assert merged.nbytes() == 5 * 2 * 2 * 16 * 4 + 2 * (2 * 16 * 4 + 4)


def test_compress_merges_identical_keys_without_changing_attention():
    """Old tokens in 3 groups of 4 identical keys (values all different), budget 3 units: k-means
    finds the groups, and proportional attention reproduces the separate tokens exactly."""
    h, d, group = 2, 16, 4
    g = torch.Generator().manual_seed(1)
    distinct = torch.randn(3, d, generator=g) * 4
    keys = torch.cat(
        [torch.randn(1, d, generator=g), distinct.repeat_interleave(group, 0), torch.randn(2, d, generator=g)]
    )
    values = torch.randn(keys.shape[0], d, generator=g)
    store = _hand_store(h, d, keys, values, torch.arange(keys.shape[0]))
    query = torch.randn(1, 3 * h, 5, d, generator=g)

    def attend():
        view = store.view()
        mask = view.valid[:, :, None, :].expand(-1, -1, query.shape[2], -1)
        return att.attend(query, view.k, view.v, mask, 0.25, view.bias)

    before = attend()
    comp = DistillationCompressor()
    comp.bind(
        BindContext(budget=budget_of(budget_tokens=6, sinks=1, window=2), num_layers=1)
    )  # 3 units + 3 protected
    comp.compress(0, store)
    seg = store.compressed[0]
    assert isinstance(seg, MergedSegment) and seg.count.tolist() == [group] * 3 * h
    assert torch.allclose(seg.k, distinct.repeat(h, 1))
    assert torch.allclose(attend(), before, atol=1e-6)


def test_kv_hit_compares_merged_units_with_summed_member_mass():
    sep, merged, query = _merged_pair()

    def probs(store):
        view = store.view()
        mask = view.valid[:, :, None, :].expand(-1, -1, query.shape[2], -1)
        return att.probs(query, view.k, mask, 0.25, view.bias)

    p_full = probs(sep)  # columns: positions 1, 3, 5, 7, 0, 2, 4, 6, 8 -> reorder by position
    order = sep.view().pos[0, 0].argsort()
    p_full = p_full[..., order]
    units = merged.units(9)
    assert (units[0, :, [1, 3, 5, 7]] == units[0, :, 7:8]).all()  # the unit owns every member
    hit, _ = att.kv_hit(probs(merged), units, p_full, torch.zeros(9, dtype=torch.bool))
    assert torch.allclose(hit, torch.ones_like(hit), atol=1e-6)


def _probe(lm, **parts) -> float:
    cache = loop.new_cache(lm, make_stack(lm, **parts, sinks=SINKS, window=WINDOW), shadow=True)
    cache.probe = HitProbe()
    ids, at = tokens(N), 0
    for n in SIZES:
        loop.step(lm, cache, ids[at : at + n])
        at += n
    if "compressor" in parts:  # merging absorbs every position into a unit, never drops one
        assert all(bool((store.units(N) >= 0).all()) for store in cache.stores)
    hit = cache.probe.result()[0]
    assert hit is not None
    return hit


def test_distillation_kv_hit_probe(tiny):
    """Engine probe: lossless at budget 1; when tight, merged units recover more of the full-cache
    mass than evicting to the same number of units."""
    assert _probe(tiny, compressor=DistillationCompressor(), budget=1.0) == pytest.approx(1.0, abs=1e-5)
    merged = _probe(tiny, compressor=DistillationCompressor(), budget=0.3)
    evicted = _probe(tiny, scheduler=StreamingLLMScheduler(), budget=0.3)
    assert evicted < merged < 1.0


# --- stacks and batches ------------------------------------------------------------------------


def _chain():
    return chain("pruning", "distillation")


STACKS = {  # name: (parts, budget fraction of the last token selection)
    "pruning+streaming": (lambda: dict(compressor=pruning(), scheduler=StreamingLLMScheduler()), 0.5),
    "pruning+h2o+base": (lambda: dict(compressor=pruning(), scheduler=H2OScheduler(), router=_router()), 0.5),
    "distillation+streaming": (
        lambda: dict(compressor=DistillationCompressor(), scheduler=StreamingLLMScheduler()),
        0.25,
    ),
    "distillation+h2o+base": (
        lambda: dict(compressor=DistillationCompressor(), scheduler=H2OScheduler(), router=_router()),
        0.25,
    ),
    "chain[pruning,distillation]": (lambda: dict(compressor=_chain()), 0.5),
    "chain[pruning,distillation]+h2o+base": (
        lambda: dict(compressor=_chain(), scheduler=H2OScheduler(), router=_router()),
        0.25,
    ),
}


def _router():
    return BaseRouter(num_experts=4, top_k=2)


@pytest.mark.parametrize("name", list(STACKS))
def test_stacks_run_and_count_bytes(tiny_93, name):
    lm = tiny_93
    parts, kept = STACKS[name]
    logits, cache = run_chunks(
        lm, make_stack(lm, **parts(), budget=0.5, sinks=SINKS, window=WINDOW), tokens(N), SIZES, shadow=True
    )
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits[-10:], full(lm)[-10:], atol=1e-3)
    assert cache.nbytes() == counted_bytes(cache, lm, lm.head_dim // 2)
    for store in cache.stores:  # selections compose multiplicatively: 0.5, then 0.5 again
        assert int(store.row_tokens().max()) == math.ceil(kept * N)
        for seg in store.compressed:
            if isinstance(seg, MergedSegment):  # evicted units take their members with them
                mpos, owner = seg.members()
                assert int(seg.count.sum()) == mpos.numel() and torch.equal(
                    owner.unique(), torch.arange(seg.size)
                )


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gpt_neox"])
def test_identity_settings_lossless_across_families(family):
    """Sliding window (mistral), biases (qwen2), partial rotary (gpt_neox)."""
    lm = models.load(tiny_cfg(family), "cpu")
    stages = chain({"name": "pruning", "keep_ratio": 1.0}, "distillation")
    stack = make_stack(
        lm, compressor=stages, scheduler=H2OScheduler(), budget=1.0, sinks=SINKS, window=WINDOW
    )
    logits, cache = run_chunks(lm, stack, tokens(N), SIZES)
    assert torch.allclose(logits, full(lm), atol=1e-5)
    assert isinstance(cache.stores[0].compressed[-1], PrunedSegment)


def test_chain_lossless_at_identity_settings(tiny_93):
    stages = chain({"name": "pruning", "keep_ratio": 1.0}, "distillation")
    logits, _ = run_chunks(tiny_93, make_stack(tiny_93, compressor=stages, budget=1.0), tokens(N), SIZES)
    assert torch.allclose(logits, full(tiny_93), atol=1e-5)


BATCHED = {
    "pruning": lambda: dict(compressor=pruning()),
    "distillation": lambda: dict(compressor=DistillationCompressor()),
    "chain+h2o+base": lambda: dict(compressor=_chain(), scheduler=H2OScheduler(), router=_router()),
}


@pytest.mark.parametrize("name", list(BATCHED))
def test_padded_batch_equals_one_by_one(tiny_93, name):
    lm = tiny_93

    def mk():
        return make_stack(lm, **BATCHED[name](), budget=0.5, sinks=SINKS, window=WINDOW)

    _, cache, (ca, cb) = padded_batch_vs_solo(lm, mk, atol=1e-5)
    assert cache.nbytes() == ca.nbytes() + cb.nbytes()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PruningCompressor(keep_ratio=0.0), "compressor.keep_ratio=0.0"),
        (lambda: PruningCompressor(keep_ratio=1.5), "compressor.keep_ratio=1.5"),
        (lambda: PruningCompressor(obs_window=0), "compressor.obs_window=0"),
        (lambda: PruningCompressor(move_group=0), "compressor.move_group=0"),
        (lambda: DistillationCompressor(iters=-1), "compressor.iters=-1"),
    ],
)
def test_knobs_are_validated(make, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        make()
