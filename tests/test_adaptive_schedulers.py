"""The adaptive schedulers ``lru``, ``lru_plus``, ``adakv`` and ``duo_attention``: each acts on the
real cache, alone and stacked; stored bytes match an independent count; a padded batch equals
one-by-one runs; and each one's own invariant holds."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from helpers import budget_of, make_stack, padded_batch_vs_solo, run_chunks, tokens
from kvbench.cache.store import LayerStore
from kvbench.compressors.quantized import QuantizedCompressor
from kvbench.compressors.snapkv import SnapKVCompressor
from kvbench.errors import ConfigError
from kvbench.eval import loop
from kvbench.roles import BindContext
from kvbench.routers.moba import BaseRouter
from kvbench.schedulers.adakv import AdaKVScheduler
from kvbench.schedulers.duo_attention import DuoAttentionScheduler
from kvbench.schedulers.lru import POSITION_SPAN, LRUScheduler, ranked, used
from kvbench.schedulers.lru_plus import KEY_SPAN, LRUPlusScheduler
from kvbench.stack import Stack

SIZES = [48, 8, 8, 1, 1]  # prefill, two chunks, two decode steps
N = sum(SIZES)
NAMES = ["lru", "lru_plus", "adakv", "duo_attention"]
FAST_FIT = dict(samples=2, length=64, steps=3)  # a few-step gate fit on the tiny model


def gates_for(lm, seed: int = 0) -> torch.Tensor:
    return torch.rand(lm.num_layers, lm.kv_heads, generator=torch.Generator().manual_seed(seed))


def make(name: str, lm, **knobs):
    """A scheduler by name; duo_attention gets hand-made gates (the fit is tested on its own)."""
    if name == "duo_attention":
        sched = DuoAttentionScheduler(**knobs)
        sched.inject_gates(gates_for(lm))
        return sched
    return {"lru": LRUScheduler, "lru_plus": LRUPlusScheduler, "adakv": AdaKVScheduler}[name](**knobs)


def full(lm):
    return run_chunks(lm, make_stack(lm), tokens(N), SIZES)[0]


def fp_bytes(lm, tokens_per_layer: int) -> int:
    """K and V of ``tokens_per_layer`` head-row tokens in float32."""
    return tokens_per_layer * lm.head_dim * 2 * 4


def row_positions(store: LayerStore) -> list[list[int]]:
    view = store.view()
    return [sorted(p[v].tolist()) for p, v in zip(view.pos.flatten(0, 1), view.valid.flatten(0, 1))]


# --- every technique -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_runs_alone_double_and_triple(tiny_93, name):
    lm = tiny_93
    reference = lm.num_layers * fp_bytes(lm, N * lm.kv_heads)
    stacks = [
        dict(scheduler=make(name, lm)),
        dict(compressor=QuantizedCompressor(bits=4, group_size=8), scheduler=make(name, lm)),
        dict(
            router=BaseRouter(num_experts=4, top_k=2),
            compressor=QuantizedCompressor(bits=4, group_size=8),
            scheduler=make(name, lm),
        ),
    ]
    for parts in stacks:
        logits, cache = run_chunks(
            lm, make_stack(lm, **parts, budget=0.25, sinks=2, window=4), tokens(N), SIZES
        )
        assert torch.isfinite(logits).all()
        assert 0 < cache.nbytes() < reference


@pytest.mark.parametrize("name", NAMES)
def test_tight_budget_differs_and_budget_one_is_lossless(tiny_93, name):
    lm, ref = tiny_93, full(tiny_93)
    tight, _ = run_chunks(
        lm, make_stack(lm, scheduler=make(name, lm), budget=0.25, sinks=2, window=4), tokens(N), SIZES
    )
    assert not torch.allclose(tight[-10:], ref[-10:], atol=1e-3)
    one, _ = run_chunks(
        lm, make_stack(lm, scheduler=make(name, lm), budget=1.0, sinks=2, window=4), tokens(N), SIZES
    )
    torch.testing.assert_close(one, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_stored_bytes_match_a_count_by_hand(tiny_93, name):
    lm, sinks, window = tiny_93, 2, 4
    sched = make(name, lm)
    _, cache = run_chunks(
        lm, make_stack(lm, scheduler=sched, budget=0.25, sinks=sinks, window=window), tokens(N), SIZES
    )
    cap, h = math.ceil(0.25 * N), lm.kv_heads
    for layer, store in enumerate(cache.stores):
        if name in ("lru", "lru_plus"):
            assert (store.fp.lens == cap).all()
            expect = fp_bytes(lm, cap * h)
        elif name == "adakv":
            assert int(store.fp.lens.sum()) == cap * h  # the layer's budget, spread unevenly
            expect = fp_bytes(lm, cap * h)
        else:
            full_heads = int(sched.retrieval[layer].sum())
            expect = fp_bytes(lm, full_heads * N + (h - full_heads) * (sinks + window))
        assert store.nbytes() == expect


@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_equals_one_by_one(tiny_93, name):
    lm = tiny_93

    def stack():
        return make_stack(lm, scheduler=make(name, lm), budget=0.5, sinks=2, window=8)

    padded_batch_vs_solo(lm, stack)


@pytest.mark.parametrize(
    ("cls", "knobs", "key"),
    [
        (LRUScheduler, {"tau": 0.0}, "scheduler.tau"),
        (LRUPlusScheduler, {"decay": 1.5}, "scheduler.decay"),
        (LRUPlusScheduler, {"tau": 2.0}, "scheduler.tau"),
        (AdaKVScheduler, {"alpha": -0.1}, "scheduler.alpha"),
        (AdaKVScheduler, {"pool": 4}, "scheduler.pool"),
        (DuoAttentionScheduler, {"retrieval_ratio": 0.5, "threshold": 0.5}, "scheduler.threshold"),
        (DuoAttentionScheduler, {"retrieval_ratio": 1.5}, "scheduler.retrieval_ratio"),
        (DuoAttentionScheduler, {"steps": -1}, "scheduler.steps"),
    ],
)
def test_bad_knobs_are_refused(cls, knobs, key):
    with pytest.raises(ConfigError, match=f"^{key}="):
        cls(**knobs)


# --- lru -------------------------------------------------------------------------------------------


def hand_store(pos_count: int, heads: int = 2) -> LayerStore:
    store = LayerStore(1, heads, 4, torch.float32, torch.device("cpu"))
    store.append(torch.randn(1, heads, pos_count, 4), torch.randn(1, heads, pos_count, 4))
    return store


def test_lru_use_is_any_query_head_above_tau():
    """Hand-made probabilities: last use = latest query where some head of the group gave >= tau."""
    store = hand_store(5)
    sched = LRUScheduler(tau=0.1)
    probs = torch.zeros(1, 2, 2, 2, 5)  # (B, H, g, q, T): queries at positions 3 and 4
    probs[0, 0, 1, 0, 1] = 0.1  # KV head 0, its second query head, query 3 -> token 1 used at 3
    probs[0, 0, 0, 1, 1] = 0.09  # below tau: not a use
    probs[0, 1, 0, 1, 0] = 0.5  # KV head 1, query 4 -> token 0 used at 4
    probs[0, 1, 1, 0, 2] = 0.2  # KV head 1, query 3 -> token 2 used at 3 (arrival 2)
    sched.observe(0, store, probs, torch.tensor([[3, 4]]))
    assert store.state(LRUScheduler.LAST)[0].tolist() == [[0, 3, 2, 3, 4], [4, 1, 3, 3, 4]]


def test_lru_score_orders_as_last_use_then_arrival():
    """LRU's one float64 key orders a head-row's tokens as ranking them by last use and then by
    position does (:func:`ranked`), its values distinct, wherever the slots hold their positions."""
    gen = torch.Generator().manual_seed(0)
    for t in (7, 300, 4096):
        pos = torch.stack([torch.randperm(1 << 23, generator=gen)[:t] for _ in range(6)]).view(2, 3, t)
        last = torch.maximum(torch.randint(0, 1 << 24, (2, 3, t), generator=gen).float(), pos)
        last[..., : t // 2] = float(1 << 23)  # used by one query: ties of the last use, by position
        key = torch.add(pos, last.double(), alpha=POSITION_SPAN)
        rank = ranked(last, pos.argsort(-1))
        assert torch.equal(key.argsort(-1), rank.argsort(-1))
        assert all(len(set(row)) == t for row in key.view(-1, t).tolist())


def test_lru_keeps_the_most_recently_used(tiny):
    lm, sinks, window = tiny, 2, 4
    _, cache = run_chunks(
        lm, make_stack(lm, scheduler=LRUScheduler(), budget=1.0, sinks=sinks, window=window), tokens(N), SIZES
    )
    store = cache.stores[1]
    last, pos = store.state(LRUScheduler.LAST).clone(), store.view().pos.clone()
    tight = make_stack(lm, scheduler=LRUScheduler(), budget=0.3, sinks=sinks, window=window)
    tight.scheduler.evict(1, store)
    cap = math.ceil(0.3 * N)
    for row in range(pos.shape[1]):
        p, t = pos[0, row].tolist(), last[0, row].tolist()
        protected = [i for i in range(N) if p[i] < sinks or p[i] >= N - window]
        rest = sorted((i for i in range(N) if i not in protected), key=lambda i: (-t[i], -p[i]))
        keep = rest[: cap - len(protected)]
        assert row_positions(store)[row] == sorted(p[i] for i in protected + keep)
        evicted = rest[cap - len(protected) :]
        assert min(t[i] for i in keep) >= max(t[i] for i in evicted)  # the most recently used stay


# --- lru_plus -------------------------------------------------------------------------------------


class RecordingLRUPlus(LRUPlusScheduler):
    """Records every use (layer, row, token position, query position) next to the real update."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.uses: list[tuple[int, int, int, int]] = []

    def observe(self, layer, store, probs, qpos):
        hit = used(probs, qpos, self.tau)  # (B, H, q, T)
        pos = store.view().pos
        for b, h, q, t in hit.nonzero().tolist():
            self.uses.append((layer, b * store.kv_heads + h, int(pos[b, h, t]), int(qpos[b, q])))
        super().observe(layer, store, probs, qpos)


@pytest.mark.parametrize("decay", [0.8, 1.0])
def test_lru_plus_incremental_score_equals_closed_form(tiny_93, decay):
    lm = tiny_93
    sched = RecordingLRUPlus(decay=decay, tau=0.05)
    _, cache = run_chunks(
        lm, make_stack(lm, scheduler=sched, budget=0.5, sinks=2, window=4), tokens(N), SIZES
    )
    now = N - 1
    for layer, store in enumerate(cache.stores):
        closed: dict[tuple[int, int], float] = {}
        for lyr, row, p, t in sched.uses:
            if lyr == layer:
                closed[(row, p)] = closed.get((row, p), 0.0) + decay ** (now - t)
        score = sched.log_scores(store).exp().flatten(0, 1)
        view = store.view()
        for row, (ps, vs) in enumerate(zip(view.pos.flatten(0, 1), view.valid.flatten(0, 1))):
            for col in vs.nonzero()[:, 0].tolist():
                want = closed.get((row, int(ps[col])), 0.0)
                assert float(score[row, col]) == pytest.approx(want, rel=1e-4, abs=1e-30)
    assert sched.uses  # the test saw uses


def test_lru_plus_score_orders_as_decayed_use_then_arrival():
    """LRU+'s float64 key orders a head-row's tokens as ranking them by log score and then by
    position does (:func:`ranked`, two sorts), its values distinct: zeros of either sign tie, -inf
    (never used) ranks lowest, and every float32 keeps its order. Past ``KEY_SPAN`` positions, the
    score is those ranks."""
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([float("-inf"), -0.0, 0.0, -1.5, 2.0, 1e-38, -1e-38, 3.4e38, -3.4e38])
    for t in (5, 300, 4096):
        pos = torch.stack([torch.randperm(KEY_SPAN, generator=gen)[:t] for _ in range(6)]).view(2, 3, t)
        log = torch.randn(2, 3, t, generator=gen) * 20
        some = torch.rand(2, 3, t, generator=gen) < 0.5
        log[some] = special[torch.randint(0, len(special), (int(some.sum()),), generator=gen)]
        view = SimpleNamespace(pos=pos)
        store = SimpleNamespace(
            seen_max=int(pos.max()) + 1, view=lambda view=view: view, by_position=pos.argsort
        )
        sched = LRUPlusScheduler()
        sched.log_scores = lambda store, log=log: log
        key = sched.score(0, store)
        rank = ranked(log, pos.argsort(-1))
        assert key.dtype == torch.float64 and torch.equal(key.argsort(-1), rank.argsort(-1))
        assert all(len(set(row)) == t for row in key.view(-1, t).tolist())
        store.seen_max = KEY_SPAN
        assert torch.equal(sched.score(0, store), rank)


@pytest.mark.parametrize("name", ["lru", "lru_plus"])
def test_a_decode_step_evicts_by_argmin_what_the_sort_evicts(tiny, monkeypatch, name):
    """Decode steps of one token each past the capacity (rows out of position order after their
    drops) evict, by the argmin of distinct scores, the tokens the sort of ``lowest`` evicts: the
    same logits and the same stored positions after every step."""
    from kvbench import select

    sizes = [40, 8, *[1] * 24, 3, *[1] * 6]
    runs, sorts, lowest = [], [], select.lowest

    def counted(*args):
        sorts[-1] += 1
        return lowest(*args)

    monkeypatch.setattr(select, "lowest", counted)
    for span in (select.DISTINCT_SPAN, -1):  # -1: every eviction through ``lowest``
        monkeypatch.setattr(select, "DISTINCT_SPAN", span)
        sorts.append(0)
        stack = make_stack(tiny, scheduler=make(name, tiny), budget=0.4, sinks=2, window=4)
        cache, at, seen = loop.new_cache(tiny, stack), 0, []
        ids = tokens(sum(sizes))
        for n in sizes:
            seen.append((loop.step(tiny, cache, ids[at : at + n]), [row_positions(s) for s in cache.stores]))
            at += n
        runs.append(seen)
    assert not all(s.in_position_order() for s in cache.stores)  # the drops left rows out of order
    assert sorts[0] < sorts[1]  # the one-token evictions took the argmin
    for (a, pa), (b, pb) in zip(*runs):
        assert torch.equal(a, b) and pa == pb


def test_lru_plus_evicts_the_lowest_scores(tiny):
    lm, sinks, window = tiny, 2, 4
    _, cache = run_chunks(
        lm,
        make_stack(lm, scheduler=LRUPlusScheduler(), budget=1.0, sinks=sinks, window=window),
        tokens(N),
        SIZES,
    )
    store = cache.stores[0]
    tight = make_stack(lm, scheduler=LRUPlusScheduler(), budget=0.3, sinks=sinks, window=window)
    score, pos = tight.scheduler.log_scores(store).clone(), store.view().pos.clone()
    tight.scheduler.evict(0, store)
    cap = math.ceil(0.3 * N)
    for row in range(pos.shape[1]):
        p, s = pos[0, row].tolist(), score[0, row].tolist()
        protected = [i for i in range(N) if p[i] < sinks or p[i] >= N - window]
        rest = sorted((i for i in range(N) if i not in protected), key=lambda i: (-s[i], -p[i]))
        assert row_positions(store)[row] == sorted(p[i] for i in protected + rest[: cap - len(protected)])


# --- adakv ----------------------------------------------------------------------------------------


def test_adakv_keeps_safeguard_plus_layer_wide_top(tiny_93):
    lm, sinks, window, budget, alpha = tiny_93, 2, 4, 0.3, 0.2
    _, cache = run_chunks(
        lm,
        make_stack(lm, scheduler=AdaKVScheduler(), budget=1.0, sinks=sinks, window=window),
        tokens(N),
        SIZES,
    )
    store = cache.stores[1]
    tight = make_stack(lm, scheduler=AdaKVScheduler(alpha=alpha), budget=budget, sinks=sinks, window=window)
    score, pos = tight.scheduler.window_scores(store).clone(), store.view().pos.clone()
    tight.scheduler.evict(1, store)
    h, cap = lm.kv_heads, math.ceil(budget * N)
    expect: list[list[int]] = []
    pool: list[tuple[float, int, int]] = []  # (-score, head, column) of tokens beyond the safeguards
    spare = 0
    for head in range(h):
        p, s = pos[0, head].tolist(), score[0, head].tolist()
        protected = [i for i in range(N) if p[i] < sinks or p[i] >= N - window]
        free = cap - len(protected)
        ranked = sorted((i for i in range(N) if i not in protected), key=lambda i: (-s[i], i))
        safe = ranked[: math.floor(alpha * free)]
        expect.append(protected + safe)
        spare += free - len(safe)
        pool += [(-s[i], head, i) for i in ranked[len(safe) :]]
    for _, head, i in sorted(pool)[:spare]:
        expect[head].append(i)
    got = row_positions(store)
    assert got == [sorted(pos[0, head, e].tolist()) for head, e in enumerate(expect)]
    counts = [len(g) for g in got]
    assert sum(counts) == h * cap and len(set(counts)) > 1  # the layer's budget, heads uneven


@pytest.mark.parametrize("alpha", [0.0, 0.2, 1 / 3, 0.5, 0.7, 0.9, 1.0])
def test_adakv_safeguards_from_a_table_are_the_float64_floor(alpha):
    """Each head's safeguard, ``floor(free * alpha + 1e-9)``, is looked up in a table the host made
    by the same float64 arithmetic: the device's own result for every count, the table grown past
    the largest asked for."""
    from kvbench.schedulers.adakv import safeguards

    free = torch.arange(5000).view(50, 100)
    want = torch.floor(free.double() * alpha + 1e-9).long()
    assert torch.equal(safeguards(free[:10], alpha, 999), want[:10])
    assert torch.equal(safeguards(free, alpha, 4999), want)


@pytest.mark.parametrize(
    "stacked",
    [
        {},
        {"compressor": lambda: SnapKVCompressor()},
        {"router": lambda: BaseRouter(num_experts=4)},
        {"compressor": lambda: QuantizedCompressor(group_size=8)},  # two segments: counted on the device
    ],
    ids=["alone", "snapkv", "router", "quantized"],
)
@pytest.mark.parametrize("alpha", [0.0, 0.2, 1.0])
def test_adakv_shares_from_host_figures_are_the_device_counts(tiny_93, monkeypatch, stacked, alpha):
    """Where the store is one segment, each head-row's safeguard and each sequence's selectable
    slots come from host figures (every head-row holds each protected position), each with the
    protected tokens it holds; they are the device's counts, the safeguard clamped to the
    head-row's candidates. Without the padding mask,
    the pooled scores of every token are the masked ones. A padded batch, whose ragged appends leave
    the rows' lengths on the device (counted there), keeps what each of its sequences keeps alone
    (from host figures)."""
    lm, asked = tiny_93, []
    original = AdaKVScheduler._host_shares

    def checked(self, store, held):
        shares = original(self, store, held)
        if shares is None:
            return None
        view, b, h = store.view(), store.batch, store.kv_heads
        prot = self.budget.protected_view(store) & view.valid
        cand = view.valid & ~prot
        cap = torch.tensor([self.budget.capacity_host(n) for n in store.seen_host])[:, None]
        free = (cap - prot.sum(-1)).clamp(min=0)
        safe = torch.minimum(torch.floor(free.double() * self.alpha + 1e-9).long(), cand.sum(-1))
        per_row, total = (torch.as_tensor(x).expand(*shape) for x, shape in zip(shares, [(b, h), (b,)]))
        held = prot.sum(-1)  # each counted with the protected tokens it holds
        assert torch.equal(per_row, safe + held) and torch.equal(total, (free + held).sum(-1))
        pooled, masked = self.window_scores(store, padding=False), self.window_scores(store)
        assert torch.equal(pooled[view.valid], masked[view.valid])
        asked.append(b)
        return shares

    monkeypatch.setattr(AdaKVScheduler, "_host_shares", checked)

    def make():
        extra = {role: build() for role, build in stacked.items()}
        return make_stack(lm, scheduler=AdaKVScheduler(alpha=alpha), budget=0.3, sinks=2, window=4, **extra)

    run_chunks(lm, make(), tokens(N), SIZES)
    padded_batch_vs_solo(lm, make)
    if "compressor" in stacked and isinstance(stacked["compressor"](), QuantizedCompressor):
        assert not asked  # several segments: every count on the device
    else:
        assert asked


def test_adakv_alpha_one_is_per_head_uniform(tiny_93):
    _, cache = run_chunks(
        tiny_93,
        make_stack(tiny_93, scheduler=AdaKVScheduler(alpha=1.0), budget=0.25, sinks=2, window=4),
        tokens(N),
        SIZES,
    )
    for store in cache.stores:
        assert (store.fp.lens == math.ceil(0.25 * N)).all()


# --- duo_attention --------------------------------------------------------------------------------


def test_duo_streaming_heads_hold_sinks_window_and_protected(tiny_93):
    lm, sinks, window = tiny_93, 2, 4
    sched = make("duo_attention", lm)
    stack = make_stack(lm, scheduler=sched, budget=0.5, sinks=sinks, window=window)
    gates = gates_for(lm).flatten()
    k = math.ceil(0.5 * gates.numel())
    assert set(torch.nonzero(sched.retrieval.flatten())[:, 0].tolist()) == set(gates.topk(k).indices.tolist())
    cache, ids, seen = loop.new_cache(lm, stack), tokens(N), 0
    for n in SIZES:
        loop.step(lm, cache, ids[seen : seen + n])
        seen += n
        if seen == SIZES[0]:
            for store in cache.stores:
                store.set_protect_from(50)  # e.g. a question: never evicted
        for layer, store in enumerate(cache.stores):
            prot = set(range(sinks)) | set(range(seen - window, seen))
            if seen > SIZES[0]:
                prot |= set(range(50, seen))
            for head, got in enumerate(row_positions(store)):
                want = list(range(seen)) if sched.retrieval[layer, head] else sorted(prot)
                assert got == want
    assert sched.metrics()["retrieval_fraction"] == k / gates.numel()


def test_duo_closes_the_leaving_column_as_its_keep_would(tiny_93, monkeypatch):
    """Decode steps where the host knows each streaming head-row holds its sinks and window: the
    column that leaves is closed in place (Rows.close_column), not a keep of every row, with the
    same logits bit for bit, the same positions in every head-row and the same stored bytes."""
    lm, ids = tiny_93, tokens(64)
    closed = []
    close = LayerStore.close_column
    monkeypatch.setattr(LayerStore, "close_column", lambda s, *a: closed.append(a) or close(s, *a))

    class Forgetful(dict):  # the layout never known: every eviction a keep
        def __setitem__(self, key, value):
            pass

    runs = []
    for forget in (False, True):
        sched = make("duo_attention", lm)
        if forget:
            sched._known = Forgetful()
        cache = loop.new_cache(lm, make_stack(lm, scheduler=sched, budget=0.5, sinks=2, window=4))
        out = [loop.step(lm, cache, ids[:40], keep=1)]
        out += [loop.step(lm, cache, ids[i : i + 1], keep=1) for i in range(40, 64)]
        runs.append((torch.cat(out), [row_positions(s) for s in cache.stores], cache.nbytes()))
    (logits, pos, nbytes), (want_logits, want_pos, want_nbytes) = runs
    assert len(closed) > 20 and any(not all(heads) for _, _, heads in closed)  # ragged layers among them
    assert torch.equal(logits, want_logits) and pos == want_pos and nbytes == want_nbytes


def test_duo_threshold_picks_gates_above_it(tiny_93):
    sched = make("duo_attention", tiny_93, threshold=0.6)
    make_stack(tiny_93, scheduler=sched, budget=0.25)
    assert torch.equal(sched.retrieval, gates_for(tiny_93) > 0.6)


def test_duo_needs_a_ratio_with_budget_tokens(tiny_93):
    with pytest.raises(ConfigError, match="retrieval_ratio"):
        make_stack(tiny_93, scheduler=make("duo_attention", tiny_93), budget_tokens=20)


def test_duo_fits_gates_once_and_records_them(tiny, tmp_path, monkeypatch):
    from kvbench.calibration import artifacts

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    calls = []
    fit = artifacts.duo_gates
    monkeypatch.setattr(artifacts, "duo_gates", lambda *a, **k: calls.append(1) or fit(*a, **k))
    binds = []
    for _ in range(2):
        sched = DuoAttentionScheduler(retrieval_ratio=0.5, **FAST_FIT)
        stack = Stack(scheduler=sched, budget=budget_of(budget=0.3, sinks=2, window=4))
        ctx = stack.bind(BindContext.for_model(tiny))
        binds.append((sched.gates, ctx.calibrations))
    assert len(calls) == 1  # the second bind read the artifact
    (g1, rec1), (g2, rec2) = binds
    assert g1.shape == (tiny.num_layers, tiny.kv_heads) and ((g1 >= 0) & (g1 <= 1)).all()
    assert torch.equal(g1, g2) and rec1 == rec2 and rec1[0]["kind"] == "duo"
    assert rec1[0]["settings"]["steps"] == FAST_FIT["steps"] and rec1[0]["settings"]["window"] == 4
    top = set(g1.flatten().argsort(descending=True, stable=True)[:2].tolist())
    assert set(torch.nonzero(sched.retrieval.flatten())[:, 0].tolist()) == top
    logits, cache = run_chunks(tiny, stack, tokens(N), SIZES)
    assert torch.isfinite(logits).all() and cache.nbytes() < len(cache.stores) * fp_bytes(
        tiny, N * tiny.kv_heads
    )


def test_lru_plus_is_the_same_over_any_split_of_query_blocks():
    """The engine may hand a long forward's probabilities over in several blocks of queries."""
    torch.manual_seed(0)
    stores = [LayerStore(2, 2, 4, torch.float32, torch.device("cpu")) for _ in range(2)]
    real = torch.ones(2, 9, dtype=torch.bool)
    real[1, :3] = False  # the second sequence is left-padded
    for store in stores:
        store.append(torch.randn(2, 2, 9, 4), torch.randn(2, 2, 9, 4), real)
    probs = torch.rand(2, 2, 3, 9, 9).pow(4) * real[:, None, None, :, None]  # (B, H, g, q, T)
    qpos = stores[0].last_qpos
    sched = LRUPlusScheduler(decay=0.7, tau=0.05)
    sched.observe(0, stores[0], probs, qpos)
    for start, stop in [(0, 2), (2, 7), (7, 9)]:
        sched.observe(0, stores[1], probs[:, :, :, start:stop], qpos[:, start:stop])
    one, split = sched.log_scores(stores[0]), sched.log_scores(stores[1])
    assert torch.equal(torch.isinf(one), torch.isinf(split))
    torch.testing.assert_close(one[torch.isfinite(one)], split[torch.isfinite(split)])
