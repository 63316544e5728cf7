"""Routers: each runs alone and in stacks, reads everything (= the full cache) at top_k = E, stores
exactly the bytes counted by hand (K/V plus its side state), reads exactly its chosen experts plus
the always-read tokens, keeps its own invariant, and gives a padded batch the one-by-one logits."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import decode_with_ops, make_stack, padded_batch_vs_solo, run_chunks, tokens
from kvbench.cache import attention as att
from kvbench.compressors.quantized import QuantizedCompressor
from kvbench.errors import ConfigError
from kvbench.eval import loop
from kvbench.routers.adaptive import AdaptiveRouter, top_p_choice
from kvbench.routers.centroids import COLUMN_ROOM, EXPERT, Centroids, held_columns, one_dist, sq_dist
from kvbench.routers.eplb import (
    EPLBRouter,
    Placement,
    copied_rows,
    device_reads,
    eplb_plan,
    imbalance,
    plan_slots,
    read_counts,
    serve,
    water_fill,
)
from kvbench.routers.expert import (
    ExpertRouter,
    Experts,
    Routing,
    choice_at,
    fill_by_preference,
    no_choice,
    position_blocks,
    top_k_choice,
)
from kvbench.routers.hierarchical import GroupMass, HierarchicalRouter, group_choice
from kvbench.routers.moba import BaseRouter
from kvbench.routers.pikv import PikvRouter, PreviousChoice
from kvbench.routers.topk_balanced import TopKBalancedRouter, first_finite
from kvbench.schedulers.h2o import H2OScheduler

SIZES = [48, 8, 8, 1, 1]  # prefill, two chunks, two decode steps
N = sum(SIZES)
SINKS, WINDOW = 2, 4

# name -> (a router reading a subset, the same router reading every expert)
ROUTERS = {
    "topk_balanced": (lambda: TopKBalancedRouter(top_k=2), lambda: TopKBalancedRouter(top_k=8)),
    "adaptive": (
        lambda: AdaptiveRouter(top_p=0.5, k_max=4),
        lambda: AdaptiveRouter(top_p=1.0, k_max=8),
    ),
    "pikv": (lambda: PikvRouter(top_k=2), lambda: PikvRouter(top_k=8)),
    "eplb": (lambda: EPLBRouter(top_k=2), lambda: EPLBRouter(top_k=8)),
    "hierarchical": (
        lambda: HierarchicalRouter(num_experts=8, num_groups=4, top_groups=2, top_k=2),
        lambda: HierarchicalRouter(num_experts=8, num_groups=4, top_groups=4, top_k=8),
    ),
}
NAMES = list(ROUTERS)
CENTROID_ROUTERS = ("topk_balanced", "pikv", "eplb")


def run(lm, router, sizes=SIZES, **stack):
    budget = dict(sinks=SINKS, window=WINDOW) | stack.pop("budget", {})
    return run_chunks(lm, make_stack(lm, router=router, **stack, **budget), tokens(sum(sizes)), sizes)


@pytest.fixture(scope="module")
def full(tiny_93):
    return run_chunks(tiny_93, make_stack(tiny_93), tokens(N), SIZES)


def always_read_by_hand(store, chunk_start: int) -> torch.Tensor:
    """``(B, H, T)`` sinks and the window before the chunk (and the chunk), B = 1, no protection."""
    pos = store.view().pos
    return store.view().valid & ((pos < SINKS) | (pos >= chunk_start - WINDOW))


def expert_of(router, store, routable: torch.Tensor) -> torch.Tensor:
    """Each token's expert as the router's write defines it: position blocks or the stored assignment."""
    if isinstance(router, (AdaptiveRouter, HierarchicalRouter)):
        return position_blocks(store.view().pos, routable, router.num_experts)
    held = store.state(EXPERT).long() - 1
    return torch.where(routable, held, torch.full_like(held, -1))


# --- runs alone and in stacks; reading everything equals the full cache ----------------------------


@pytest.mark.parametrize("name", NAMES)
def test_acts_and_reading_every_expert_equals_full(tiny_93, full, name):
    full_logits, full_cache = full
    subset, everything = ROUTERS[name]
    logits, cache = run(tiny_93, subset())
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits[-10:], full_logits[-10:], atol=1e-3), f"{name} did not act"
    router = cache.stack.router
    m = router.metrics()
    assert len(m["reads_per_expert"]) == router.num_experts and m["load_imbalance"] >= 1.0
    assert 0 < m["routable_read_fraction"] < 1
    side = sum(side_bytes_by_hand(router, s) for s in cache.stores)
    assert cache.nbytes() == full_cache.nbytes() + side  # every token kept; side state on top
    logits, _ = run(tiny_93, everything())
    torch.testing.assert_close(logits, full_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_double_and_triple_stacks(tiny_93, name):
    budget = dict(budget=0.5, sinks=SINKS, window=WINDOW)
    double, _ = run(tiny_93, ROUTERS[name][0](), scheduler=H2OScheduler(), budget=budget)
    assert torch.isfinite(double).all()
    triple, cache = run(
        tiny_93,
        ROUTERS[name][0](),
        compressor=QuantizedCompressor(bits=4, group_size=8),
        scheduler=H2OScheduler(),
        budget=budget,
    )
    assert torch.isfinite(triple).all() and not torch.allclose(triple, double, atol=1e-4)
    assert all(int(s.row_tokens().max()) == math.ceil(0.5 * N) for s in cache.stores)


# --- stored bytes: K/V plus side state, counted by hand ------------------------------------------


def side_bytes_by_hand(router, store) -> int:
    b, h, e, d = store.batch, store.kv_heads, router.num_experts, store.head_dim
    if isinstance(router, (AdaptiveRouter, HierarchicalRouter)):
        return 0  # position blocks are derived on the fly: nothing stored
    total = b * h * e * d * 4 + b * h * e * 4  # fp32 centroids and running counts
    if isinstance(router, PikvRouter):
        total += b * h * e  # the experts read at the previous step, one byte each
    if isinstance(router, EPLBRouter):
        slots = e + router.replicas  # loads are skewed enough that every extra slot is used
        total += e * 8 + router.num_devices * 8  # fp64 expert and device loads
        total += 2 * slots * 8 + e * 8  # slot -> expert, slot -> device, unreplicated placement
        copies = torch.bincount(store.side(Placement).slot_expert, minlength=e) - 1
        held = store.state(EXPERT).long()[store.view().valid] - 1
        replica_tokens = int(copies[held[held >= 0]].sum())
        assert replica_tokens > 0
        total += replica_tokens * d * 2 * 4  # copies of K and V, fp32
    return total


@pytest.mark.parametrize("name", NAMES)
def test_stored_bytes_equal_count_by_hand(tiny_93, name):
    router = ROUTERS[name][0]()
    _, cache = run(tiny_93, router, scheduler=H2OScheduler(), budget=dict(budget=0.5))
    for store in cache.stores:
        kv = int(store.row_tokens().sum()) * store.head_dim * 2 * 4  # tokens x D x (K, V) x fp32
        assert store.nbytes() == kv + side_bytes_by_hand(router, store)


# --- each query reads exactly its chosen experts plus the always-read tokens ---------------------


@pytest.mark.parametrize("name", NAMES)
def test_reads_exactly_chosen_experts_plus_always_read(tiny_93, name):
    router = ROUTERS[name][0]()
    _, cache = run(tiny_93, router, sizes=SIZES[:3])
    store = cache.stores[1]
    q = 3
    query = torch.randn(1, 9, q, store.head_dim, generator=torch.Generator().manual_seed(0))
    seen = int(store.seen[0])
    qpos = torch.arange(seen, seen + q)[None]
    routing = router.route(1, store, query, qpos)
    mask = router.read_mask(1, store, query, qpos)
    always = always_read_by_hand(store, seen)
    eid = expert_of(router, store, store.view().valid & ~always)
    assert torch.equal(routing.eid, eid)
    for h in range(store.kv_heads):
        for i in range(q):
            picked = set(torch.nonzero(routing.chosen[0, h, i]).flatten().tolist())
            expect = [bool(a) or int(x) in picked for a, x in zip(always[0, h], eid[0, h])]
            assert mask[0, h, i].tolist() == expect
    count = routing.chosen.sum(-1)
    nonempty = (routing.count > 0).sum(-1, keepdim=True)
    if name in ("pikv", "eplb"):
        assert torch.equal(count, nonempty.clamp(max=2).expand_as(count))
    elif name == "topk_balanced":
        assert (count <= 2).all()
    elif name == "adaptive":
        assert (count >= 1).all() and (count <= 4).all()
    else:
        assert (count == 2).all()


@pytest.mark.parametrize("name", ["base", *NAMES])
def test_bytes_read_per_step_count_by_hand(tiny_93, name):
    """One decode step on a float32 cache: every read token costs 2 x head_dim x 4 bytes (K and V)."""
    from kvbench.routers.moba import BaseRouter

    router = BaseRouter(top_k=2) if name == "base" else ROUTERS[name][0]()
    stack = make_stack(tiny_93, router=router, sinks=SINKS, window=WINDOW)
    cache = loop.new_cache(tiny_93, stack)
    ids = tokens(N)
    loop.step(tiny_93, cache, ids[:48])
    router.read_bytes.clear()
    router.read_counts[:] = [0.0, 0.0]
    loop.step(tiny_93, cache, ids[48:49])
    store = cache.stores[0]
    per_token = 2 * store.head_dim * 4
    m = router.metrics()
    assert m["bytes_read_per_step"] == pytest.approx(router.read_counts[0] * per_token)
    stored = sum(int(s.view().valid.sum()) for s in cache.stores)  # every token is visible at decode
    assert router.read_counts[1] == stored
    assert 0 < m["read_fraction"] < 1


# --- topk_balanced: write and read capacities ----------------------------------------------------


def test_fill_by_preference_overflows_to_next_best_within_capacity():
    order = torch.tensor([0, 1, 2, 3]).expand(1, 6, 4)  # six queries, all prefer 0, then 1, ...
    allowed = torch.ones(1, 6, 4, dtype=torch.bool)
    need = torch.full((1, 6), 2)
    room = torch.full((1, 4), 3)  # ceil(1.0 * 2 * 6 / 4)
    chosen = fill_by_preference(order, allowed, need, room)
    assert chosen.sum(-2).tolist() == [[3, 3, 3, 3]]
    assert chosen.sum(-1).tolist() == [[2] * 6]
    assert chosen[0, :3, :2].all() and chosen[0, 3:, 2:].all()  # the first three took the favourites


def test_fill_by_preference_one_item_equals_the_rounds():
    """One item (a decode step) takes what the round-by-round greedy gives it: the same item beside
    a second one that wants nothing (which offers nothing) goes through the rounds."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        e = int(torch.randint(1, 9, (1,), generator=gen))
        order = torch.rand(2, 3, 1, e, generator=gen).argsort(-1)
        allowed = torch.rand(2, 3, 1, e, generator=gen) > 0.3
        need = torch.randint(0, e + 1, (2, 3, 1), generator=gen)
        room = torch.randint(0, 3, (2, 3, e), generator=gen)
        one = fill_by_preference(order, allowed, need, room)
        two = fill_by_preference(
            torch.cat([order, order], -2),
            torch.cat([allowed, allowed], -2),
            torch.cat([need, 0 * need], -1),
            room,
        )
        assert torch.equal(one, two[..., :1, :])


def test_choices_known_finite_equal_the_counted_ones():
    """Where every expert holds a token (every score finite, known on the host), the first ``k`` by
    score and the top ``k`` are taken without testing their scores: the same choice, ties (whole
    scores) included. A decode step's one token takes its nearest expert with room as the
    capacity greedy does."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        e = int(torch.randint(1, 9, (1,), generator=gen))
        k = int(torch.randint(1, e + 1, (1,), generator=gen))
        score = torch.randint(-3, 4, (2, 3, 1, e), generator=gen).float()
        assert torch.equal(first_finite(score, k, True), first_finite(score, k))
        assert torch.equal(top_k_choice(score, k, True), top_k_choice(score, k))
        dist = torch.randint(0, 4, (2, 3, 1, e), generator=gen).float()
        room = torch.randint(-1, 3, (2, 3, e), generator=gen).float()
        room[..., int(torch.randint(0, e, (1,), generator=gen))] = 1  # some expert has room
        want = torch.ones(2, 3, 1, dtype=torch.long)
        assert torch.equal(
            TopKBalancedRouter.take_first(dist, room <= 0), TopKBalancedRouter.take(dist, want, room)
        )


@pytest.mark.parametrize("make", [TopKBalancedRouter, PikvRouter], ids=["running_mean", "ema"])
def test_one_token_forms_agree_with_the_batch_forms(make):
    """A decode step's token takes the expert the batch distances give and moves the centroids as
    the batch update does, at float tolerance (one norm of the differences, one interpolation),
    and a centroid it does not join keeps its value exactly."""
    gen = torch.Generator().manual_seed(1)
    router = make(num_experts=6)
    for _ in range(50):
        cent = torch.randn(2, 3, 6, 16, generator=gen)
        count = torch.randint(1, 40, (2, 3, 6), generator=gen).float()
        key = torch.randn(2, 3, 1, 16, generator=gen) * 2
        dist = one_dist(key, cent)
        assert torch.allclose(dist.square(), sq_dist(key, cent), rtol=1e-5, atol=1e-4)
        assert torch.equal(dist.argmin(-1), sq_dist(key, cent).argmin(-1))  # no near ties here
        eid = dist.argmin(-1)
        moved, total = router.update_one(cent, count, key, eid)
        new = torch.ones(2, 3, 1, dtype=torch.bool)
        batch, batch_total = router.update(cent, count, key, eid, new, torch.zeros(2, 3, 1, dtype=torch.long))
        assert torch.equal(total, batch_total)
        assert torch.allclose(moved, batch, rtol=1e-5, atol=1e-6)
        hit = torch.nn.functional.one_hot(eid[:, :, 0], 6).bool()
        assert torch.equal(moved[~hit], cent[~hit])


def test_put_state_adds_as_it_writes():
    """``put_state(..., add=1)`` writes ``values + 1`` into the stored state in one operation where
    the index is basic, and as a sum and a copy where it is not."""
    from kvbench.cache.store import LayerStore
    from kvbench.eval.stepcost import LaunchCounter

    store = LayerStore(1, 2, 4, torch.float32, torch.device("cpu"))
    store.append(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))
    store.set_state(EXPERT, torch.zeros(1, 2, 5))
    store.state(EXPERT)  # any pending write of the rows made before counting
    placed = torch.tensor([[[2], [0]]])
    with LaunchCounter() as counter:
        store.put_state(EXPERT, (slice(None), slice(None), slice(3, 4)), placed, add=1)
    assert counter.ops == 1
    assert store.state(EXPERT).tolist() == [[[0, 0, 0, 3, 0], [0, 0, 0, 1, 0]]]
    at = (torch.tensor([[0]]), torch.tensor([[0]]), torch.tensor([[1]]))
    store.put_state(EXPERT, at, placed[:, :1].float(), add=1)
    assert store.state(EXPERT)[0, 0, 1] == 3


def test_topk_balanced_never_exceeds_write_or_read_capacity(tiny_93):
    router = TopKBalancedRouter(num_experts=4, top_k=2, capacity_factor=1.0)
    reads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    choose = router.choose

    def spy(layer, store, score, count, qpos):
        chosen = choose(layer, store, score, count, qpos)
        reads.append((chosen, count, qpos))
        return chosen

    router.choose = spy  # type: ignore[method-assign]
    stack = make_stack(tiny_93, router=router, sinks=SINKS, window=WINDOW)
    cache = loop.new_cache(tiny_93, stack)
    ids, at = tokens(N), 0
    for n in [40, 8, 8, 8, 1, 1]:
        loop.step(tiny_93, cache, ids[at : at + n])
        at += n
        for store in cache.stores:
            held = store.state(EXPERT).long()[0] - 1  # (H, T)
            live = torch.stack([(held == e).sum(-1) for e in range(4)], -1)  # (H, E)
            cap = torch.ceil(1.0 * (held >= 0).sum(-1) / 4)
            assert (live <= cap[:, None]).all()
    assert reads and any(int(q.shape[1]) == 8 for _, _, q in reads)
    for chosen, count, qpos in reads:
        nonempty = (count > 0).sum(-1)
        k = nonempty.clamp(max=2)
        cap = torch.ceil(1.0 * k * (qpos >= 0).sum(-1)[:, None] / nonempty)
        assert (chosen.sum(2) <= cap[..., None]).all()
    assert router.metrics()["read_shortfall"] is not None


# --- adaptive: top-p mass, k in range ------------------------------------------------------------


def test_adaptive_chosen_mass_reaches_p_with_k_in_range():
    g = torch.Generator().manual_seed(0)
    score = torch.randn(2, 3, 50, 8, generator=g) * 3
    score[0, 0, :, 5:] = float("-inf")  # three empty experts
    p, tau, k_min, k_max = 0.7, 1.5, 2, 5
    chosen = top_p_choice(score, p, tau, k_min, k_max)
    prob = torch.softmax((score / tau), -1)
    k = chosen.sum(-1)
    n = torch.isfinite(score).sum(-1)
    assert (k >= torch.minimum(torch.tensor(k_min), n)).all() and (k <= k_max).all()
    mass = (prob * chosen).sum(-1)
    assert ((mass >= p - 1e-6) | (k == k_max)).all()
    best_without_last = (
        prob.sort(-1, descending=True).values.cumsum(-1).gather(-1, (k - 2).clamp(min=0)[..., None])
    )
    assert ((best_without_last[..., 0] < p) | (k <= k_min)).all()  # smallest such set
    ranked = prob.sort(-1, descending=True).values
    assert torch.allclose(mass, (ranked * (torch.arange(8) < k[..., None])).sum(-1))  # a prefix by score
    assert top_p_choice(score, 1.0, tau, 1, 8).sum(-1).equal(n)


# --- pikv: the locality bonus --------------------------------------------------------------------


def test_pikv_bonus_changes_the_choice_predictably():
    from kvbench.cache.store import LayerStore

    score = torch.tensor([2.0, 1.6, 0.0, float("-inf")]).view(1, 1, 1, 4)  # logits 1.0, 0.8, 0, empty
    qpos = torch.tensor([[10]])
    picks = {}
    for bonus in (0.0, 0.1, 0.5):
        store = LayerStore(1, 1, 4, torch.float32, torch.device("cpu"))  # head_dim 4: logit = score / 2
        store.set_side(PreviousChoice(torch.tensor([[[False, True, False, True]]])))
        chosen = PikvRouter(num_experts=4, top_k=1, locality_bonus=bonus).choose(0, store, score, None, qpos)
        picks[bonus] = int(chosen[0, 0, 0].nonzero())
        assert torch.equal(
            store.side(PreviousChoice).chosen, chosen[:, :, 0]
        )  # the next step's bonus goes to this choice
    assert picks == {0.0: 0, 0.1: 0, 0.5: 1}  # the bonus wins once it exceeds the logit gap 0.2


def test_pikv_large_bonus_keeps_reading_the_previous_experts(tiny_93):
    router = PikvRouter(top_k=2, locality_bonus=1e4)
    _, cache = run(tiny_93, router, sizes=[48, 8, 1])
    prev = (
        cache.stores[1].side(PreviousChoice).chosen.clone()
    )  # experts read by the last query of the last step
    loop.forward(tiny_93, cache, [5])  # one more decode step, before the write
    chosen = router._last[1][-1].chosen[:, :, -1]  # the last routing held: its last member
    assert torch.equal(chosen, prev)


# --- eplb: replication balances device load; replica bytes are real ------------------------------


def test_eplb_replication_lowers_device_imbalance_on_a_skewed_load():
    load = torch.tensor([100.0, 10, 10, 10, 5, 5, 5, 5], dtype=torch.float64)
    devices, replicas = 4, 4
    base_experts, base_devices = eplb_plan(load, devices, 0)
    slot_expert, slot_device = eplb_plan(load, devices, replicas)
    assert torch.equal(base_experts, torch.arange(8)) and slot_expert.numel() == 8 + replicas
    copies = torch.bincount(slot_expert, minlength=8)
    assert copies[0] == devices and copies[1] == 2  # the hottest expert first, at most one copy per device
    for e in range(8):
        devs = slot_device[slot_expert == e]
        assert devs.unique().numel() == devs.numel()
    assert torch.bincount(slot_device, minlength=devices).max() <= math.ceil(12 / devices)
    zero = torch.zeros(devices, dtype=torch.float64)
    before = device_reads(load, base_experts, base_devices, zero)
    after = device_reads(load, slot_expert, slot_device, zero)
    assert before.sum() == after.sum() == load.sum()
    assert imbalance(after) < imbalance(before)
    assert imbalance(before) == pytest.approx(105 / 37.5)


def plain_plan(loads: list[float], devices: int, replicas: int) -> tuple[list[int], list[int]]:
    """EPLB's plan as the docstring of :mod:`kvbench.routers.eplb` says it, written plainly."""
    reps = [1] * len(loads)
    for _ in range(replicas):
        open_ = [e for e in range(len(loads)) if reps[e] < devices and loads[e] > 0]
        if not open_:
            break
        reps[max(open_, key=lambda e: loads[e] / reps[e])] += 1
    slot_expert = [e for e, r in enumerate(reps) for _ in range(r)]
    per_slot = [loads[e] / reps[e] for e in slot_expert]
    room = math.ceil(len(slot_expert) / devices)
    dev_load, dev_slots, holds = [0.0] * devices, [0] * devices, [set() for _ in range(devices)]
    slot_device = [0] * len(slot_expert)
    for s in sorted(range(len(slot_expert)), key=lambda s: -per_slot[s]):
        e = slot_expert[s]
        apart = [d for d in range(devices) if e not in holds[d]]
        fits = [d for d in apart if dev_slots[d] < room] or apart
        d = min(fits, key=lambda d: (dev_load[d], dev_slots[d], d))
        slot_device[s], dev_load[d], dev_slots[d] = d, dev_load[d] + per_slot[s], dev_slots[d] + 1
        holds[d].add(e)
    return slot_expert, slot_device


def test_eplb_plan_is_the_plain_greedy_plan_ties_included():
    """The host's plan (one pass over the devices a slot, bits for the devices an expert is on) is
    the plain greedy one, on loads with many equal values (ties to the lower expert and device)."""
    rng = torch.Generator().manual_seed(0)
    for _ in range(3000):
        e = int(torch.randint(1, 13, (), generator=rng))
        devices = int(torch.randint(1, e + 1, (), generator=rng))
        replicas = int(torch.randint(0, e * (devices - 1) + 1, (), generator=rng))
        high = int(torch.randint(1, 5000, (), generator=rng)) if _ % 2 else 3
        loads = torch.randint(0, high + 1, (e,), generator=rng).double().tolist()
        assert plan_slots(loads, devices, replicas) == plain_plan(loads, devices, replicas)


def test_eplb_serves_no_reads_to_nothing():
    """An expert without reads adds nothing to its replicas' devices (its water fill is skipped)."""
    slot_expert, slot_device = [0, 0, 1, 1, 2], [0, 1, 2, 3, 0]
    assert serve([0.0, 3.0, 0.0], slot_expert, slot_device, [5.0, 0.0, 1.0, 1.0]) == [0.0, 0.0, 2.0, 1.0]
    assert serve([0.0, 0.0, 0.0], slot_expert, slot_device, [5.0, 0.0, 1.0, 1.0]) == [0.0] * 4


def test_eplb_copies_under_a_changed_plan_are_sent_with_it(tiny_93, monkeypatch):
    """Where a decode step changes the plan, which head-row each copy of the column assigned now is
    of goes to the device with the plan: the replicas are those the device-made rows give, bit for
    bit and in the same order, and most steps take that way."""
    assert copied_rows([2, 0, 1]) == [0, 0, 2]
    sent = []
    grow = EPLBRouter._grow_column

    def spy(self, store, side, col, expert, placed, rows=None):
        sent.append(rows is not None)
        return grow(self, store, side, col, expert, placed, rows)

    sizes = [48] + [1] * 12
    monkeypatch.setattr(EPLBRouter, "_grow_column", spy)
    _, cache = run(tiny_93, EPLBRouter(top_k=2), sizes=sizes)
    monkeypatch.setattr("kvbench.routers.eplb.copied_rows", lambda copies: [])  # rows made on the device
    _, made = run(tiny_93, EPLBRouter(top_k=2), sizes=sizes)
    for a, b in zip(cache.stores, made.stores):
        for name in ("replica_k", "replica_v"):
            assert torch.equal(getattr(a.side(Placement), name), getattr(b.side(Placement), name))
    with_plan = sent[: len(sent) // 2]
    assert sum(with_plan) > len(with_plan) / 2 and not any(sent[len(sent) // 2 :])


def test_eplb_rows_sent_with_one_plan_are_not_read_under_the_next(tiny_93, monkeypatch):
    """Steps that change the plan (send the rows) and steps that keep it (make them on the device)
    alternate; the replicas after every step are the copies of every replicated token, and no
    sent rows outlive their write."""
    real = plan_slots

    def slots(loads, devices, replicas):  # devices as the real plan's only without replication
        slot_expert, slot_device = real(loads, devices, replicas)
        return slot_expert, slot_device if replicas == 0 else [0] * len(slot_expert)

    monkeypatch.setattr("kvbench.routers.eplb.plan_slots", slots)
    sent = []
    grow = EPLBRouter._grow_column

    def spy(self, store, side, col, expert, placed, rows=None):
        sent.append(rows is not None)
        return grow(self, store, side, col, expert, placed, rows)

    monkeypatch.setattr(EPLBRouter, "_grow_column", spy)
    router = EPLBRouter(top_k=2)
    stack = make_stack(tiny_93, router=router, sinks=SINKS, window=WINDOW)
    cache = loop.new_cache(tiny_93, stack)
    ids = tokens(48 + 16)
    loop.step(tiny_93, cache, ids[:48])
    for i in range(48, 48 + 16):
        loop.step(tiny_93, cache, [ids[i]])
        for store in cache.stores:
            side = store.side(Placement)
            assert "rows" not in side.room
            copies = torch.bincount(side.slot_expert, minlength=router.num_experts) - 1
            held = store.state(EXPERT).round().long() - 1
            extra = torch.where(held >= 0, copies[held.clamp(min=0)], torch.zeros_like(held))
            keep = extra > 0
            fresh = store.view().k[keep].repeat_interleave(extra[keep], dim=0)
            assert torch.equal(side.replica_k.sort(0).values, fresh.sort(0).values)
    assert any(sent) and not all(sent)


def test_water_fill_sends_each_read_to_the_least_loaded_replica():
    loads = torch.tensor([0.0, 5.0, 10.0], dtype=torch.float64)
    assert water_fill(loads, 8).tolist() == [7, 1, 0]  # 0→5, then alternate the two lowest
    assert water_fill(loads, 0).tolist() == [0, 0, 0]


@pytest.mark.parametrize("name", CENTROID_ROUTERS)
def test_a_write_with_nothing_routable_stores_no_centroids(tiny_93, name):
    """A write while every token is a sink or in the window assigns nothing and creates no
    centroids (a write can come before any read, and a centroid's bytes are counted)."""
    router = ROUTERS[name][0]()
    make_stack(tiny_93, router=router, sinks=SINKS, window=WINDOW)
    _, cache = run_chunks(tiny_93, make_stack(tiny_93), tokens(SINKS + WINDOW), [SINKS + WINDOW])
    store = cache.stores[0]
    kv = store.nbytes()
    router.write(0, store)
    assert store.side(Centroids) is None
    if name != "eplb":  # EPLB's plan (loads, slots) exists from the first write
        assert store.nbytes() == kv


def test_eplb_replicas_grown_step_by_step_equal_a_fresh_copy(tiny_93):
    """Decode steps under an unchanged plan add only the newly assigned tokens' copies: the replicas
    hold, row for row (in any order), the copies made from scratch of every replicated token."""
    router = EPLBRouter(top_k=2)
    _, cache = run(tiny_93, router, sizes=[48] + [1] * 12)
    grown = 0
    for store in cache.stores:
        side = store.side(Placement)
        copies = torch.bincount(side.slot_expert, minlength=router.num_experts) - 1
        held = store.state(EXPERT).round().long() - 1
        extra = torch.where(held >= 0, copies[held.clamp(min=0)], torch.zeros_like(held))
        keep = extra > 0
        fresh = store.view().k[keep].repeat_interleave(extra[keep], dim=0)
        assert side.replica_k.shape == fresh.shape
        assert torch.equal(side.replica_k.sort(0).values, fresh.sort(0).values)
        grown += side.replica_key is not None
    assert grown == len(cache.stores)


def test_eplb_read_counts_sum_a_decode_choice_on_the_host_as_the_device_sums():
    """A decode step's padded choice (its always-read column left out) and a chunk's sums per
    expert read in one host read give each call's reads per expert, as summing on the device does;
    the values after them are ``extra``'s."""
    gen = torch.Generator().manual_seed(0)
    e = 8
    step = torch.rand(2, 4, 1, e + 1, generator=gen) > 0.5
    step[..., e] = True  # the column always read
    chunk = (torch.rand(2, 4, 5, e, generator=gen) > 0.5).sum((0, 1, 2), dtype=torch.float64)
    counts, rest = read_counts([step, chunk], [torch.tensor([3, 1])], e)
    assert counts[0] == step[..., :e].sum((0, 1, 2), dtype=torch.float64).tolist()
    assert counts[1] == chunk.tolist()
    assert rest == [3, 1]


def test_eplb_device_figures_conserve_reads(tiny_93):
    router = EPLBRouter(top_k=2)
    run(tiny_93, router)
    m = router.metrics()
    assert len(m["device_reads"]) == len(m["device_reads_no_replication"]) == 4
    total = sum(m["reads_per_expert"])
    assert sum(m["device_reads"]) == sum(m["device_reads_no_replication"]) == total
    assert m["device_load_imbalance"] >= 1.0 and m["device_load_imbalance_no_replication"] >= 1.0


# --- hierarchical: reads only inside the chosen groups -------------------------------------------


def test_hierarchical_group_choice_by_hand():
    score = torch.tensor([5.0, 0.0, 1.0, 1.0, 3.0, 2.5, -9.0, float("-inf")]).view(1, 1, 1, 8)
    count = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 0.0]).view(1, 1, 8)
    # group means: (5 + 0)/4 = 1.25, 1.0, 2.75, -9.0 -> groups 2 and 0; inside, experts 0, 4, 5 lead
    chosen = group_choice(score, count, groups=4, top_groups=2, k=2)
    assert torch.nonzero(chosen[0, 0, 0]).flatten().tolist() == [0, 4]


def test_a_group_score_is_one_product_of_the_experts_scores_with_their_shares():
    """Hierarchical version 3: a group's score is its experts' scores weighted by their shares of
    its tokens, one product with :attr:`GroupMass.weights` (zero outside an expert's group): the
    token-weighted mean of its experts' scores at float tolerance, empty groups never chosen."""
    gen = torch.Generator().manual_seed(6)
    for groups, per in [(4, 2), (2, 4), (3, 3)]:
        e = groups * per
        count = torch.randint(0, 5, (2, 3, e), generator=gen).float()
        count[0, 0, :per] = 0  # an empty group
        score = torch.randn(2, 3, 4, e, generator=gen).masked_fill(count[:, :, None, :] == 0, float("-inf"))
        mass = GroupMass.of(count, groups)
        finite = torch.where(count[:, :, None, :] > 0, score, 0.0)
        got = finite @ mass.weights
        want = (finite * count[:, :, None, :]).view(2, 3, 4, groups, per).sum(-1) / mass.divisor
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        assert torch.equal(mass.weights.ne(0).any(-1), count > 0)  # an expert weighs in one group
        chosen = group_choice(score, count, groups, top_groups=1, k=1, mass=mass)
        assert not chosen[0, 0, :, :per].any()  # the empty group is never read
    assert HierarchicalRouter.version >= 3


def test_adaptive_centroids_carry_the_score_scale():
    """Adaptive version 3: its centroids are the blocks' mean keys times ``1 / (√D · τ)`` (the
    scale folded into the step's mean weights), so their scores are the logits over τ."""
    from types import SimpleNamespace

    from kvbench.routers.expert import expert_onehot

    gen = torch.Generator().manual_seed(7)
    e, t, d = 8, 40, 16
    eid = torch.randint(-1, e, (1, 2, t), generator=gen)
    keys = torch.randn(1, 2, t, d, generator=gen)
    store = SimpleNamespace(keys=lambda: keys, head_dim=d)
    onehot = expert_onehot(eid, None, e)
    experts = Experts(onehot.sum(2), eid=eid)
    mean = BaseRouter(num_experts=e).summarize(0, store, experts)
    for tau in (1.0, 0.5):
        router = AdaptiveRouter(num_experts=e, temperature=tau)
        got = router.summarize(0, store, experts)
        torch.testing.assert_close(got, mean / (d**0.5 * tau), rtol=1e-6, atol=1e-7)


def test_a_balanced_write_after_drops_offers_its_tokens_in_arrival_order():
    """`topk_balanced`'s write places a chunk's new tokens greedily under the experts' capacity, in
    arrival order (version 3): after an eviction's drops left one sequence's slots out of position
    order, it places them as a padded batch (rows compacted in order) does."""
    from conftest import tiny_cfg
    from kvbench import models
    from kvbench.schedulers.streaming_llm import StreamingLLMScheduler

    lm = models.load(tiny_cfg("llama", heads=8, num_key_value_heads=2), "cpu")

    def make():
        return make_stack(
            lm, router=TopKBalancedRouter(), scheduler=StreamingLLMScheduler(), budget=0.4, sinks=2, window=8
        )

    padded_batch_vs_solo(lm, make, tokens(64, 1), tokens(45, 2), prefills=(54, 35), chunks=(1, 8, 1))
    assert TopKBalancedRouter.version == 3


def test_a_seed_after_drops_takes_the_earliest_new_tokens():
    """A centroid router's write seeds its undefined experts from its earliest new tokens, in
    position order where drops left the slots out of it (`pikv` 3, `topk_balanced` 3, `eplb` 4):
    one sequence alone seeds as in a padded batch."""
    from conftest import tiny_cfg
    from kvbench import models
    from kvbench.routers.centroids import seed
    from kvbench.schedulers.streaming_llm import StreamingLLMScheduler

    gen = torch.Generator().manual_seed(9)
    keys, pos = torch.randn(1, 1, 6, 4, generator=gen), torch.tensor([[[0, 1, 5, 2, 4, 3]]])
    new = pos >= 2
    cent, defined = torch.zeros(1, 1, 3, 4), torch.tensor([[[True, False, False]]])
    _, _, seeded = seed(keys, pos, new, cent, defined, pos.argsort(-1))
    assert seeded[0, 0].tolist() == [-1, -1, -1, 1, -1, 2]  # positions 2 and 3 seed experts 1 and 2
    lm = models.load(tiny_cfg("llama", heads=8, num_key_value_heads=2), "cpu")
    for router in (TopKBalancedRouter, PikvRouter, EPLBRouter):

        def make(router=router):
            return make_stack(
                lm, router=router(), scheduler=StreamingLLMScheduler(), budget=0.4, sinks=2, window=8
            )

        padded_batch_vs_solo(lm, make, tokens(75, 1), tokens(56, 2), prefills=(54, 35), chunks=(1, 1, 16, 1))
    assert PikvRouter.version == 3 and EPLBRouter.version == 4


def test_hierarchical_reads_only_inside_chosen_groups(tiny_93):
    router = HierarchicalRouter(num_experts=8, num_groups=4, top_groups=2, top_k=3)
    _, cache = run(tiny_93, router, sizes=SIZES[:3])
    store, q = cache.stores[0], 4
    query = torch.randn(1, 9, q, store.head_dim, generator=torch.Generator().manual_seed(1))
    seen = int(store.seen[0])
    qpos = torch.arange(seen, seen + q)[None]
    routing = router.route(0, store, query, qpos)
    mask = router.read_mask(0, store, query, qpos)
    view = store.view()
    group = torch.where(routing.eid >= 0, routing.eid // 2, -1)  # (1, H, T)
    grouped = query.view(1, store.kv_heads, 3, q, -1)
    for h in range(store.kv_heads):
        means = torch.stack([view.k[0, h][group[0, h] == g].mean(0) for g in range(4)])  # (G, D)
        gscore = torch.einsum("gqd,ed->qe", grouped[0, h], means)  # (q, G)
        top = gscore.topk(2, -1).indices
        for i in range(q):
            inside = torch.isin(group[0, h], top[i])
            assert not (mask[0, h, i] & (group[0, h] >= 0) & ~inside).any()
            assert set(torch.nonzero(routing.chosen[0, h, i]).flatten().tolist()) <= set(
                (top[i, :, None] * 2 + torch.arange(2)).flatten().tolist()
            )


# --- centroid write: an assignment is made once and follows the token ----------------------------


@pytest.mark.parametrize("name", CENTROID_ROUTERS)
def test_assignment_is_kept_through_eviction(tiny, name):
    stack = make_stack(
        tiny, router=ROUTERS[name][0](), scheduler=H2OScheduler(), budget=0.5, sinks=2, window=4
    )
    cache = loop.new_cache(tiny, stack)
    ids, at, seen = tokens(N), 0, {}
    for n in SIZES:
        loop.step(tiny, cache, ids[at : at + n])
        at += n
        store = cache.stores[0]
        view, held = store.view(), store.state(EXPERT).long() - 1
        routable = view.valid & ~stack.budget.protected_view(store)
        assert (held[routable] >= 0).all() and (held[~routable & view.valid] < 0).all()
        now = {
            (h, int(p)): int(e)
            for h in range(store.kv_heads)
            for p, e in zip(view.pos[0, h], held[0, h])
            if e >= 0
        }
        assert all(seen[key] == e for key, e in now.items() if key in seen)
        seen.update(now)
    assert isinstance(stack.router, ExpertRouter) and store.side(Centroids).count.sum() > 0


@pytest.mark.parametrize("name", CENTROID_ROUTERS)
def test_the_columns_kept_between_decode_steps_are_the_stored_assignment(tiny_93, name):
    """Decode steps over full rows read each token's column (its expert, ``E`` where none) from a
    copy kept per layer, to which each write adds the column it assigns: after every step, past
    the copy's room too, it equals the columns made afresh from the stored assignment. The copy
    is made once per :data:`COLUMN_ROOM` steps, not at each."""
    router = ROUTERS[name][0]()
    stack = make_stack(tiny_93, router=router, sinks=SINKS, window=WINDOW)
    cache = loop.new_cache(tiny_93, stack)
    ids = tokens(48 + COLUMN_ROOM + 20)
    loop.step(tiny_93, cache, ids[:48])
    copies, checked = set(), 0
    for t in ids[48:]:
        loop.step(tiny_93, cache, [t])
        for layer, store in enumerate(cache.stores):
            kept = router._columns.get(layer)
            if kept is None or kept[0]() is not store.side(Centroids):
                continue
            copies.add((layer, id(kept[1])))
            width = store.columns()
            assert torch.equal(kept[1][..., :width], held_columns(store, router.num_experts))
            assert (kept[1][..., width:] == router.num_experts).all()
            checked += 1
    layers = len(cache.stores)
    assert checked >= layers * (COLUMN_ROOM + 10)
    assert len(copies) <= 3 * layers


# --- padded batch equals one-by-one --------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_equals_one_by_one(tiny_93, name):
    lm = tiny_93

    def stack():
        return make_stack(
            lm, router=ROUTERS[name][0](), scheduler=H2OScheduler(), budget=0.5, sinks=2, window=8
        )

    padded_batch_vs_solo(lm, stack)


# --- knobs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "knob"),
    [
        (lambda: TopKBalancedRouter(capacity_factor=0.5), "capacity_factor"),
        (lambda: TopKBalancedRouter(top_k=9), "top_k"),
        (lambda: AdaptiveRouter(top_p=0.0), "top_p"),
        (lambda: AdaptiveRouter(k_min=3, k_max=2), "k_max"),
        (lambda: AdaptiveRouter(temperature=0), "temperature"),
        (lambda: PikvRouter(centroid_decay=1.0), "centroid_decay"),
        (lambda: PikvRouter(locality_bonus=-1), "locality_bonus"),
        (lambda: EPLBRouter(num_devices=9), "num_devices"),
        (lambda: EPLBRouter(replicas=-1), "replicas"),
        (lambda: HierarchicalRouter(num_groups=3), "num_groups"),
        (lambda: HierarchicalRouter(top_groups=1, top_k=5), "top_k"),
    ],
)
def test_bad_knobs_are_refused(make, knob):
    with pytest.raises(ConfigError, match=rf"^router\.{knob}="):
        make()


@pytest.mark.parametrize("make", [TopKBalancedRouter, PikvRouter, EPLBRouter], ids=lambda c: c.__name__)
def test_routers_write_after_the_rows_grow_inside_inference_mode(tiny_93, make):
    """The rows grow (new tensors) during a forward, under inference mode; the routers' writes after
    it update them in place, so the stack must be applied under inference mode too."""
    _, cache = run(tiny_93, make(), sizes=[48, 96, 1, 1])
    assert cache.stores[0].fp.rows.capacity > 48 + 64  # grown at least once


@pytest.mark.parametrize(
    "make",
    [
        lambda: BaseRouter(num_experts=4, top_k=2),
        ROUTERS["adaptive"][0],
        ROUTERS["hierarchical"][0],
    ],
)
@pytest.mark.parametrize("protect", [None, 30])
def test_position_blocks_shared_by_the_layers_of_a_step(tiny_93, make, protect, monkeypatch):
    """Where every slot holds its own position, the layers of a step share one set of position
    blocks: the logits and read figures are those of blocks derived in every layer."""
    from kvbench.routers.expert import PositionExperts

    def go():
        router = make()
        stack = make_stack(tiny_93, router=router, sinks=SINKS, window=WINDOW)
        logits, _ = run_chunks(tiny_93, stack, tokens(N), SIZES, protect=protect)
        return logits, router.metrics(), router

    shared, m_shared, router = go()
    assert router.__dict__.get("_blocks") is not None  # the shared path ran
    monkeypatch.setattr(PositionExperts, "route_experts", ExpertRouter.route_experts)
    alone, m_alone, _ = go()
    assert torch.equal(shared, alone)
    assert m_shared == m_alone


@pytest.mark.parametrize("shape", [(1, 8, 1, 8), (2, 3, 25, 8), (1, 8, 512, 16)])  # sliced, own, sliced
@pytest.mark.parametrize("host_routed", [True, False])
def test_read_figures_settled_together_equal_each_call_alone(shape, host_routed):
    """A whole call's read figures, made when settled with those of other calls
    (``expert._fill_reads``), are bit for bit those its own operations gave: the routed tokens each
    query reads and the sum of their routable fractions."""
    from kvbench.routers.expert import StepReads, _Call, _fill_reads

    g = torch.Generator().manual_seed(sum(shape))
    b, h, _, e = shape
    calls, alone = [], []
    for i in range(5):
        chosen = torch.rand(shape, generator=g) < 0.4
        count = torch.randint(0, 40, (b, h, e), generator=g).float()
        routed = torch.full((), float(37 + i)) if host_routed else count.sum(-1, keepdim=True).clamp(min=1)
        read = (chosen * count[:, :, None, :]).sum(-1)
        alone.append((read, (read / routed).sum()))
        reads = StepReads(2, None, count, 0, 1)
        call = _Call(0, chosen, reads, None, float(b * h * shape[2]), count, routed)
        calls.append(call)
    _fill_reads(calls)
    for call, (read, fraction) in zip(calls, alone):
        assert torch.equal(call.reads.read, read)
        assert call.fraction is not None and call.fraction.item() == fraction.item()


def test_read_all_reads_values_of_every_dtype_exactly():
    from kvbench.cache.reads import read_all

    wide = torch.tensor(0.1, dtype=torch.float64)
    ts = [torch.tensor(0.1), torch.tensor(2**40), 3.5, torch.tensor(True), wide]
    assert read_all(ts) == [float(torch.tensor(0.1)), float(2**40), 3.5, 1.0, 0.1]


def test_a_choice_is_one_scatter_into_an_empty_choice_it_leaves_empty():
    """:func:`choice_at` scatters into the held empty choice out of place: each choice is what a
    copy of the empty one with the experts set gives, and the held one stays empty."""
    gen = torch.Generator().manual_seed(1)
    for pad in (False, True):
        for _ in range(50):
            e = int(torch.randint(1, 9, (1,), generator=gen))
            k = int(torch.randint(1, e + 1, (1,), generator=gen))
            score = torch.randn(2, 3, int(torch.randint(1, 4, (1,), generator=gen)), e, generator=gen)
            score[score > 1.2] = float("-inf")
            index = score.topk(k, -1).indices
            took = score.topk(k, -1).values.isfinite()
            want = torch.zeros(*score.shape[:-1], e + pad, dtype=torch.bool)
            want[..., e:] = True
            for chosen in (None, took):
                expect = want.clone().scatter_(-1, index, True if chosen is None else chosen)
                assert torch.equal(choice_at(score, index, chosen, pad), expect)
            assert torch.equal(no_choice(score, pad), want)


def test_a_routed_mask_per_query_head_is_the_mask_repeated_over_each_group():
    """:meth:`Routing.head_mask` gathers each KV head's rows once per query head of its group: the
    mask repeated over the group, for one query and a chunk, a padded choice and not."""
    gen = torch.Generator().manual_seed(2)
    for q in (1, 5):
        for pad in (False, True):
            e, t = 8, 40
            score = torch.randn(2, 3, q, e, generator=gen)
            column = torch.randint(0, e + 1, (2, 3, 1, t), generator=gen)
            count = torch.ones(2, 3, e)
            routing = Routing(Experts(count, column=column), top_k_choice(score, 3, True, pad))
            for groups in (1, 4):
                want = routing.mask.repeat_interleave(groups, dim=1)
                assert torch.equal(routing.head_mask(groups), want)
                query = torch.randn(2, 3 * groups, q, 16, generator=gen)
                keys, values = torch.randn(2, 2, 3, t, 16, generator=gen)
                assert torch.equal(
                    att.attend(query, keys, values, routing.head_mask(groups), 0.25),
                    att.attend(query, keys, values, routing.mask, 0.25),
                )


def test_a_routed_decode_step_reads_its_mask_per_query_head_and_repeats_none(tiny):
    """On the torch path a routed decode step takes its selector's mask per query head
    (:meth:`ExpertRouter.read_head_mask`): the step repeats no mask, and its logits are those of a
    read through the mask per KV head."""
    out = {}
    for per_head in (True, False):
        router = BaseRouter(num_experts=8, top_k=2)
        if not per_head:
            router.read_head_mask = None  # the plan then asks read_mask
        stack = make_stack(tiny, router=router, budget=0.5, sinks=SINKS, window=WINDOW)
        logits, ops = decode_with_ops(tiny, stack, tokens(96))
        out[per_head] = (logits, ops.count("repeat_interleave.self_int"))
    assert torch.equal(out[True][0], out[False][0])
    assert out[True][1] == 0 < out[False][1]


def test_a_position_block_mean_is_its_keys_weighted_by_one_over_its_size():
    """Position routers (version 2) take each block's mean key as its keys weighted by one over
    its size, one product, with the weights kept for the step's layers: the sum divided by the
    size within float32 rounding, zero for an empty block."""
    from types import SimpleNamespace

    from kvbench.routers.expert import _Blocks, expert_onehot

    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        e, t = 8, int(torch.randint(4, 60, (1,), generator=gen))
        eid = torch.randint(-1, e - 2, (2, 3, t), generator=gen)  # the last experts empty
        keys = torch.randn(2, 3, t, 16, generator=gen)
        store = SimpleNamespace(keys=lambda keys=keys: keys)
        onehot = expert_onehot(eid, None, e)
        experts = Experts(onehot.sum(2), eid=eid)
        want = (onehot.transpose(-1, -2) @ keys) / onehot.sum(2).clamp(min=1)[..., None]
        router = BaseRouter(num_experts=e, top_k=2)
        for shared in (False, True):
            router._blocks = _Blocks(None, experts, onehot.bool()) if shared else None
            got = router.summarize(0, store, experts)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            # the weights are the one-hot over the sizes, bit for bit (made from the membership)
            assert torch.equal(router.mean_weights(experts), onehot / experts.size.transpose(-1, -2))
            assert torch.equal(got[..., e - 2 :, :], torch.zeros_like(got[..., e - 2 :, :]))
        assert router._blocks.weights is not None  # kept for the other layers
        # bfloat16 keys (version 3): the weights rounded once and the product in the keys' dtype,
        # no float32 copy of the keys; the same means within bfloat16 rounding
        low = SimpleNamespace(keys=lambda keys=keys: keys.bfloat16())
        router._blocks = _Blocks(None, experts, onehot.bool())
        got = router.summarize(0, low, experts)
        weights = (onehot / experts.size.transpose(-1, -2)).bfloat16()
        assert got.dtype == torch.bfloat16 and router._blocks.weights.dtype == torch.bfloat16
        assert torch.equal(got, weights.transpose(-1, -2) @ keys.bfloat16())
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert BaseRouter.version == 3 and AdaptiveRouter.version == HierarchicalRouter.version == 4


def test_a_top_p_choice_of_finite_scores_takes_the_first_of_its_order():
    """Where every score is finite (known on the host), the top-p choice scatters the first ``k``
    of the order into an empty choice: the experts whose rank in the order is below ``k``, ties
    (whole scores) included, padded or not."""
    gen = torch.Generator().manual_seed(4)
    for _ in range(200):
        e = int(torch.randint(1, 9, (1,), generator=gen))
        k_min = int(torch.randint(1, e + 1, (1,), generator=gen))
        k_max = int(torch.randint(k_min, e + 1, (1,), generator=gen))
        p = float(torch.rand(1, generator=gen)) if bool(torch.rand(1, generator=gen) < 0.8) else 1.0
        score = torch.randint(-3, 4, (2, 3, 2, e), generator=gen).float()
        want = top_p_choice(score, p, 1.0, k_min, k_max)
        assert torch.equal(top_p_choice(score, p, 1.0, k_min, k_max, True), want)
        padded = top_p_choice(score, p, 1.0, k_min, k_max, True, pad=True)
        assert torch.equal(padded[..., :e], want) and bool(padded[..., e].all())
        assert torch.equal(top_p_choice(score, p, 1.0, k_min, k_max, pad=True)[..., :e], want)


def test_a_steps_blocks_are_one_division_of_the_held_ranks_padded():
    """A position router's column of blocks for a step (:meth:`PositionExperts.column_blocks`): the
    routed column of rank ``r`` holds block ``r · E // n``, the others ``E``; made by one division of
    the held ``rank · E`` and one pad (two launches a step, not a fill, an arange, a division and a
    copy), whole numbers as the definition gives them."""
    from types import SimpleNamespace

    from kvbench.eval.stepcost import LaunchCounter

    for n, e, lo, extra in [(0, 8, 3, 5), (1, 8, 0, 0), (7, 8, 4, 16), (100, 16, 4, 16), (1001, 8, 2, 1)]:
        width = lo + n + extra
        qpos = torch.zeros(2, 1, dtype=torch.long)
        store = SimpleNamespace(columns=lambda width=width: width, batch=2, kv_heads=3, last_qpos=qpos)
        router = BaseRouter(num_experts=e)
        router.column_blocks(store, lo, lo + n)  # the held ranks made once, when first asked
        with torch.inference_mode(), LaunchCounter() as counter:
            column, none_empty = router.column_blocks(store, lo, lo + n)
        want = torch.full((width,), e)
        want[lo : lo + n] = torch.arange(n) * e // max(n, 1)
        assert torch.equal(column, want.expand(2, 3, 1, width)) and none_empty == (n >= e)
        assert counter.ops == 2, counter.by_op
