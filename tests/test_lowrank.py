"""Representation compressors pyramid, svd, lora and lora_plus_plus: they act on the real cache,
their stored bytes match an independent count, and each keeps its own invariant."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import tiny_cfg
from helpers import budget_of, make_stack, moved_in_groups, run_chunks, tokens
from kvbench import models
from kvbench.cache.quant import SUPPORTED_BITS
from kvbench.cache.rotary import Rotary
from kvbench.cache.store import LayerStore
from kvbench.compressors.lora import LoraCompressor
from kvbench.compressors.lora_plus_plus import LoraPlusPlusCompressor
from kvbench.compressors.lowrank import LatentSegment
from kvbench.compressors.pyramid import PyramidCompressor, layer_bits
from kvbench.compressors.quantized import QuantizedCompressor, QuantSegment
from kvbench.compressors.svd import SVDCompressor, SVDSegment
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
CAL = 256  # calibration tokens on the tiny models


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    """Calibration artifacts of this module go to a fresh directory (fitted once per setting)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVBENCH_CACHE", str(tmp_path_factory.mktemp("kvbench_cache")))
        yield


@pytest.fixture(scope="module")
def neox():
    return models.load(tiny_cfg("gpt_neox"), "cpu")  # partial rotary (25% of head_dim)


@pytest.fixture(scope="module")
def deep():
    return models.load(tiny_cfg("llama", heads=9, num_key_value_heads=3, num_hidden_layers=4), "cpu")


def make(name: str, **knobs):
    defaults = {
        "pyramid": (PyramidCompressor, {"group_size": 8}),
        "svd": (SVDCompressor, {"key_rank": 4, "value_rank": 8, "block_size": 16}),
        "lora": (LoraCompressor, {"key_rank": 4, "value_rank": 8, "calibration_tokens": CAL}),
        "lora_plus_plus": (
            LoraPlusPlusCompressor,
            {"key_rank": 4, "value_rank": 8, "latent_bits": 4, "calibration_tokens": CAL},
        ),
    }
    cls, base = defaults[name]
    return cls(**{**base, **knobs})


NAMES = ["pyramid", "svd", "lora", "lora_plus_plus"]
FULL_RANK = {
    "svd": {"key_rank": 16, "value_rank": 16},
    "lora": {"key_rank": 16, "value_rank": 16},
}


_FULL: dict[int, tuple] = {}


def full(lm):
    """Logits and cache of the full cache (computed once per model)."""
    if id(lm) not in _FULL:
        _FULL[id(lm)] = run_chunks(lm, make_stack(lm), tokens(N), SIZES)
    return _FULL[id(lm)]


def fp_bytes(lm, tokens_per_head: int) -> int:
    return tokens_per_head * lm.kv_heads * lm.head_dim * 2 * 4  # K and V, float32


def compressed_per_head(group: int) -> int:
    """Tokens per head-row that left the window in whole groups (no eviction)."""
    return ((N - SINKS - WINDOW) // group) * group


# --- every technique: acts, lossless where it can be, stacks, batches ------------------------


@pytest.mark.parametrize("name", NAMES)
def test_tight_setting_changes_logits(tiny_93, name):
    stack = make_stack(tiny_93, compressor=make(name), sinks=SINKS, window=WINDOW)
    logits, cache = run_chunks(tiny_93, stack, tokens(N), SIZES)
    assert not torch.allclose(logits[-10:], full(tiny_93)[0][-10:], atol=1e-3)
    assert all(store.compressed for store in cache.stores)
    assert cache.nbytes() < sum(fp_bytes(tiny_93, N) for _ in cache.stores)


@pytest.mark.parametrize("name", ["svd", "lora"])
@pytest.mark.parametrize("model", ["tiny_93", "neox"])
def test_full_rank_equals_full_cache(request, name, model):
    """Rank = head_dim rebuilds every key (re-rotated, partial rotary too) and value exactly."""
    lm = request.getfixturevalue(model)
    stack = make_stack(lm, compressor=make(name, **FULL_RANK[name]), sinks=SINKS, window=WINDOW)
    logits, cache = run_chunks(lm, stack, tokens(N), SIZES)
    ref_logits, ref = full(lm)
    assert torch.allclose(logits, ref_logits, atol=1e-5)
    for store, ref_store in zip(cache.stores, ref.stores):
        assert store.compressed
        a, b = store.view(), ref_store.view()
        ka, kb = (x.k.gather(2, x.pos.argsort(-1)[..., None].expand_as(x.k)) for x in (a, b))
        va, vb = (x.v.gather(2, x.pos.argsort(-1)[..., None].expand_as(x.v)) for x in (a, b))
        assert torch.allclose(ka, kb, atol=1e-4) and torch.allclose(va, vb, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_double_and_triple_stacks(tiny_93, name):
    double = make_stack(
        tiny_93, compressor=make(name), scheduler=StreamingLLMScheduler(), budget=0.5, sinks=2, window=4
    )
    logits, cache = run_chunks(tiny_93, double, tokens(N), SIZES)
    assert torch.isfinite(logits).all()
    for store in cache.stores:
        assert (store.row_tokens() == math.ceil(0.5 * N)).all()
    triple = make_stack(
        tiny_93,
        router=BaseRouter(num_experts=4, top_k=2),
        compressor=make(name),
        scheduler=H2OScheduler(),
        budget=0.5,
        sinks=2,
        window=4,
    )
    logits, cache = run_chunks(tiny_93, triple, tokens(N), SIZES, shadow=True)
    assert torch.isfinite(logits).all()
    for store in cache.stores:
        assert (store.row_tokens() == math.ceil(0.5 * N)).all()
        for seg in store.compressed:  # eviction really freed rows (and whole groups)
            assert all(t.shape[0] == seg.size for t in seg.data_fields().values())
            if hasattr(seg, "gcount"):
                assert int(seg.gcount.sum()) == seg.size and bool((seg.gcount > 0).all())


def _run_batch(lm, mk):
    """Two sequences of different lengths as a left-padded batch, then one by one."""
    a, b = tokens(60, 1), tokens(45, 2)
    pre, chunks = (40, 25), [4, 4, 1, 1]

    def solo(seq, n0):
        cache = loop.new_cache(lm, mk())
        outs, at = [loop.step(lm, cache, seq[:n0])[-1]], n0
        for n in chunks:
            outs.append(loop.step(lm, cache, seq[at : at + n])[-1])
            at += n
        return torch.stack(outs), cache

    (ra, ca), (rb, cb) = solo(a, pre[0]), solo(b, pre[1])
    cache = loop.new_cache(lm, mk(), batch=2)
    ids = torch.zeros(2, pre[0], dtype=torch.long)
    real = torch.zeros(2, pre[0], dtype=torch.bool)
    ids[0], real[0] = torch.tensor(a[: pre[0]]), True
    ids[1, pre[0] - pre[1] :], real[1, pre[0] - pre[1] :] = torch.tensor(b[: pre[1]]), True
    outs = [loop.forward_batch(lm, cache, ids, real)[:, -1]]
    cache.after_forward()
    at = list(pre)
    for n in chunks:
        ids = torch.tensor([a[at[0] : at[0] + n], b[at[1] : at[1] + n]])
        outs.append(loop.forward_batch(lm, cache, ids, torch.ones_like(ids, dtype=torch.bool))[:, -1])
        cache.after_forward()
        at = [at[0] + n, at[1] + n]
    out = torch.stack(outs, 1)
    return out, (ra, rb), cache, (ca, cb)


@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_equals_one_by_one(tiny_93, name):
    def mk():
        return make_stack(
            tiny_93, compressor=make(name), scheduler=H2OScheduler(), budget=0.6, sinks=2, window=4
        )

    out, (ra, rb), cache, (ca, cb) = _run_batch(tiny_93, mk)
    assert torch.allclose(out[0], ra, atol=1e-4) and torch.allclose(out[1], rb, atol=1e-4)
    h = tiny_93.kv_heads
    for store, sa, sb in zip(cache.stores, ca.stores, cb.stores):
        assert torch.equal(store.row_tokens(), torch.cat([sa.row_tokens(), sb.row_tokens()]))
        sizes = [seg.size for seg in store.compressed]
        assert sizes == [s.size + t.size for s, t in zip(sa.compressed, sb.compressed)]
        assert store.compressed[0].lens[:h].sum() == sa.compressed[0].size


# --- pyramid --------------------------------------------------------------------------------


def test_pyramid_layer_bits_fall_linearly_rounded_down():
    assert layer_bits(4, 8, 2) == [8, 4, 4, 2]  # 8, 6, 4, 2
    assert layer_bits(3, 8, 2) == [8, 4, 2]  # 8, 5, 2
    assert layer_bits(1, 8, 2) == [8]
    assert layer_bits(5, 4, 4) == [4] * 5
    bits = layer_bits(32, 8, 2)
    assert bits[0] == 8 and bits[-1] == 2 and bits == sorted(bits, reverse=True)
    for layer, b in enumerate(bits):
        exact = 8 - 6 * layer / 31
        assert b == max(w for w in SUPPORTED_BITS if w <= exact + 1e-9)


def test_pyramid_stores_each_layer_at_its_bits(deep):
    lm, g = deep, 8
    stack = make_stack(lm, compressor=PyramidCompressor(group_size=g), sinks=SINKS, window=WINDOW)
    _, cache = run_chunks(lm, stack, tokens(N), SIZES)
    d, h, q = lm.head_dim, lm.kv_heads, compressed_per_head(g)
    for bits, store in zip([8, 4, 4, 2], cache.stores):
        (seg,) = store.compressed
        assert isinstance(seg, QuantSegment) and (seg.key_bits, seg.value_bits) == (bits, bits)
        codes = q * h * (d * bits // 8) * 2  # packed K and V codes
        vparams = q * h * math.ceil(d / g) * 2 * 2  # per-token value zero + step, fp16
        kparams = (q // g) * h * (d * 2 * 2 + 2)  # per-group key zero + step, fp16; int16 count
        assert store.nbytes() == codes + vparams + kparams + fp_bytes(lm, N - q)
    # every layer at 8 bits is KIVI at 8 bits
    same = make_stack(lm, compressor=PyramidCompressor(bits_min=8, group_size=g), sinks=SINKS, window=WINDOW)
    kivi = make_stack(lm, compressor=QuantizedCompressor(bits=8, group_size=g), sinks=SINKS, window=WINDOW)
    a, b = run_chunks(lm, same, tokens(N), SIZES)[0], run_chunks(lm, kivi, tokens(N), SIZES)[0]
    assert torch.equal(a, b)


# --- svd --------------------------------------------------------------------------------------


def _store(lm, batch: int = 2, n: int = 40, seed: int = 0) -> tuple[LayerStore, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d = lm.kv_heads, lm.head_dim
    basis = torch.randn(h, d, d, generator=g)  # correlated channels, as real keys
    k = torch.einsum("bhtd,hde->bhte", torch.randn(batch, h, n, d, generator=g), basis)
    v = torch.randn(batch, h, n, d, generator=g) * 2
    store = LayerStore(batch, h, d, torch.float32, torch.device("cpu"))
    store.append(k, v)
    return store, k, v


def _bound(lm, tech, sinks=SINKS, window=WINDOW):
    tech.bind(replace(BindContext.for_model(lm), budget=budget_of(sinks=sinks, window=window)))
    return tech


def test_svd_rank_error_is_each_blocks_svd_tail(tiny_93):
    lm, n = tiny_93, 16
    tech = _bound(lm, SVDCompressor(key_rank=5, value_rank=9, block_size=n))
    store, k, v = _store(lm)
    tech.compress(0, store)
    (seg,) = store.compressed
    assert isinstance(seg, SVDSegment) and seg.size == 2 * lm.kv_heads * 32  # 2 blocks per head-row
    rotary = Rotary.from_model(lm.model)
    pos = torch.arange(40)
    pre = rotary.unrotate(k, pos)  # (B, H, T, D) pre-RoPE keys
    for x, a, b, r in ((pre, seg.ka, seg.kb, 5), (v, seg.va, seg.vb, 9)):
        blocks = x[:, :, SINKS : SINKS + 2 * n].reshape(-1, n, lm.head_dim)  # head-row major, as stored
        rebuilt = seg.expand(a, b).view(-1, n, lm.head_dim)
        err = (rebuilt - blocks).pow(2).sum((1, 2))
        tail = torch.linalg.svdvals(blocks)[:, r:].pow(2).sum(-1)
        assert torch.allclose(err, tail, rtol=1e-3, atol=1e-4)
    rk, rv = seg.read(torch.float32)
    assert torch.allclose(rk, rotary.rotate(seg.expand(seg.ka, seg.kb), seg.pos), atol=1e-6)
    assert torch.allclose(rv, seg.expand(seg.va, seg.vb))
    assert tech.metrics()["key_residual"] > 0


@pytest.mark.parametrize("rotated, dtype", [(64, torch.float32), (16, torch.float32), (16, torch.bfloat16)])
def test_rotation_matches_rotate_half_and_rows_share_angles(rotated, dtype):
    """Rotary's half-by-half rotation is bitwise HF's ``x·cos + rotate_half(x)·sin`` (full and
    partial rotary, with the attention scaling), undone by unrotate; rotate_rows gives rotate's
    values bitwise whether the head-rows share their positions (angles computed once) or not."""
    torch.manual_seed(0)
    d, rows, per_row = 64, 6, 37
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, rotated, 2).float() / rotated)), 1.25)
    x = torch.randn(rows * per_row, d).to(dtype)
    pos = torch.randperm(500)[:per_row].repeat(rows)
    angles = pos.float()[:, None] * rotary.inv_freq
    cos, sin = torch.cat((angles.cos(),) * 2, -1) * 1.25, torch.cat((angles.sin(),) * 2, -1) * 1.25
    xr = x[:, :rotated].float()
    half = torch.cat((-xr[:, rotated // 2 :], xr[:, : rotated // 2]), -1)
    expected = torch.cat(((xr * cos + half * sin).to(dtype), x[:, rotated:]), -1)
    out = rotary.rotate(x, pos)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert torch.allclose(
        rotary.unrotate(out.float(), pos), x.float(), atol=0.05 if dtype != torch.float32 else 1e-5
    )
    assert torch.equal(rotary.rotate_rows(x, pos, per_row), out)  # every row at the same positions
    mixed = pos.clone()
    mixed[-1] += 1  # the last row differs: no sharing
    assert torch.equal(rotary.rotate_rows(x, mixed, per_row), rotary.rotate(x, mixed))
    assert torch.equal(rotary.rotate_rows(x, pos, None), out)


@pytest.mark.parametrize("scaling", [1.0, 1.25])
@pytest.mark.parametrize("rows, per_row, d", [(6, 37, 64), (8, 300, 16), (2, 5, 128), (1, 1, 32)])
def test_keys_in_pairs_order_turn_as_rotate_rows_bit_for_bit(rows, per_row, d, scaling):
    """rotate_pairs (each rotated pair side by side, one complex product and a copy back) gives
    rotate_rows' keys bit for bit: every head-row at the same positions (the step's shared angles),
    rows at different positions, flat; and rebuilt on a basis with its rows in pairs_order, a
    product gives the same keys in that order (so a segment's read is the same); a partial rotation
    has no pairs order."""
    torch.manual_seed(d + per_row)
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), scaling)
    basis, lat = torch.randn(rows, d, 8), torch.randn(1, rows, per_row, 8)
    order = rotary.pairs_order(basis)
    assert order is not None and order.tolist()[:4] == [0, d // 2, 1, d // 2 + 1]
    x = torch.einsum("bhtr,hdr->bhtd", lat, basis).reshape(rows, per_row, d)
    paired = torch.einsum("bhtr,hdr->bhtd", lat, basis.index_select(1, order)).reshape(rows, per_row, d)
    assert torch.equal(paired, x[..., order])
    shared = torch.randperm(4000)[:per_row].repeat(rows, 1)
    mixed = torch.randint(0, 4000, (rows, per_row))
    for pos, n in ((shared, per_row), (mixed, per_row), (mixed, None)):
        assert torch.equal(rotary.rotate_pairs(paired, pos, n), rotary.rotate_rows(x, pos, n))
        flat = pos.reshape(-1)
        got = rotary.rotate_pairs(paired.reshape(-1, d), flat, n)
        assert torch.equal(got, rotary.rotate_rows(x.reshape(-1, d), flat, n))
    partial = Rotary(1.0 / (10000 ** (torch.arange(0, d // 2, 2).float() / (d // 2))))
    assert partial.pairs_order(basis) is None


@pytest.mark.parametrize(
    "heads, per_row, rank, d", [(1, 1, 4, 16), (2, 224, 8, 16), (8, 1000, 32, 128), (4, 37, 64, 64)]
)
def test_one_sequences_latents_expand_as_their_einsum_bit_for_bit(heads, per_row, rank, d):
    """A batch of one expands its latents (``LatentSegment._expand_rows``) by the one batched product
    its einsum makes, without the einsum: the same keys and values, bit for bit, also from a
    field's strided view of its rows; several sequences take the einsum."""
    torch.manual_seed(heads * per_row + rank)
    lat = torch.randn(heads, per_row + 3, rank)[:, :per_row]  # a per-row field read in place
    basis = torch.randn(heads, d, rank)
    want = torch.einsum("bhtr,hdr->bhtd", lat.reshape(1, heads, per_row, rank), basis)
    got = LatentSegment._expand_rows(lat, basis)
    assert torch.equal(got, want.reshape(heads, per_row, d))
    two = torch.randn(2 * heads, per_row, rank)
    want = torch.einsum("bhtr,hdr->bhtd", two.view(2, heads, per_row, rank), basis)
    assert torch.equal(LatentSegment._expand_rows(two, basis), want.reshape(2 * heads, per_row, d))


def test_layers_of_a_step_share_the_angles_of_the_same_positions(monkeypatch):
    """rotate_rows computes one head-row's angles once for the layers of a step (each layer's
    segment holds the same positions in its own tensor), each layer's positions at one comparison;
    positions that change, even in place, or another rotary, compute their own. Every
    result is rotate's, bitwise."""
    torch.manual_seed(0)
    rows, per_row, d = 3, 40, 64
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    computed = []
    original = Rotary._cos_sin
    monkeypatch.setattr(
        Rotary,
        "_cos_sin",
        lambda self, pos, device: computed.append(pos.numel()) or original(self, pos, device),
    )
    compared, equal = [], torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or equal(a, b))
    pos = torch.arange(per_row).repeat(rows)
    for _layer in range(4):
        x = torch.randn(rows * per_row, d)
        compared.clear()
        out = rotary.rotate_rows(x, pos.clone(), per_row)
        assert len(compared) == 1  # the first: are the rows alike; later: the kept positions alone
        assert equal(out, original_rotate(rotary, x, pos))
    assert computed == [per_row]  # the first layer's angles, reused by the other three
    pos[per_row - 1 :: per_row] += 1  # a new position in every row, written in place
    x = torch.randn(rows * per_row, d)
    assert torch.equal(rotary.rotate_rows(x, pos, per_row), original_rotate(rotary, x, pos))
    other = Rotary(rotary.inv_freq * 0.5)
    assert torch.equal(other.rotate_rows(x, pos, per_row), original_rotate(other, x, pos))
    assert computed == [per_row] * 3


def original_rotate(rotary: Rotary, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotation with angles computed afresh for every token."""
    angles = pos.float()[:, None] * rotary.inv_freq
    return rotary._turn(x, angles.cos(), angles.sin(), undo=False)


def test_svd_full_rank_reconstruction_is_exact(neox):
    tech = _bound(neox, SVDCompressor(key_rank=16, value_rank=16, block_size=16))
    store, k, v = _store(neox)
    tech.compress(0, store)
    view = store.view()
    order = view.pos.argsort(-1)[..., None].expand_as(view.k)
    assert torch.allclose(view.k.gather(2, order), k, atol=1e-4)
    assert torch.allclose(view.v.gather(2, order), v, atol=1e-4)


@pytest.mark.parametrize("value_rank", [8, None])
def test_svd_bytes_match_factor_count(tiny_93, value_rank):
    lm, n, rk = tiny_93, 16, 4
    stack = make_stack(
        lm, compressor=make("svd", value_rank=value_rank, block_size=n), sinks=SINKS, window=WINDOW
    )
    _, cache = run_chunks(lm, stack, tokens(N), SIZES)
    h, d, q = lm.kv_heads, lm.head_dim, compressed_per_head(n)
    per_token = rk + (d if value_rank is None else value_rank)
    per_block = d * rk + (0 if value_rank is None else d * value_rank)
    for store in cache.stores:
        (seg,) = store.compressed
        assert seg.size == q * h and int(seg.gcount.numel()) == q // n * h
        expect = q * h * per_token * 4 + (q // n) * h * (per_block * 4 + 2) + fp_bytes(lm, N - q)
        assert store.nbytes() == expect


# --- lora and lora_plus_plus ------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 5, 16])
@pytest.mark.parametrize("name", ["lora", "lora_plus_plus"])
def test_lora_bytes_match_latents_and_bases(tiny_93, name, group):
    lm, rk, rv = tiny_93, 4, 8
    stack = make_stack(lm, compressor=make(name, move_group=group), sinks=SINKS, window=WINDOW)
    _, cache = run_chunks(lm, stack, tokens(N), SIZES)
    h, d, q = lm.kv_heads, lm.head_dim, compressed_per_head(group)
    per_token = (rk + rv) * 4 if name == "lora" else (rk + rv) * 4 // 8 + 4 * 2  # int4 + fp16 params
    for store in cache.stores:
        (seg,) = store.compressed
        assert isinstance(seg, LatentSegment) and seg.size == q * h
        bases = h * d * (rk + rv) * 4  # one key and one value basis per KV head, float32
        assert store.nbytes() == q * h * per_token + bases + fp_bytes(lm, N - q)


@pytest.mark.parametrize("name", ["lora", "lora_plus_plus"])
def test_lora_moves_the_tokens_past_the_window_in_whole_groups(tiny_93, name):
    """After every forward (a prefill, chunks, one-token steps; one sequence and a left-padded
    batch of two), each head-row's latents are whole groups of ``move_group`` of its oldest
    unprotected tokens, and fewer than a group of them stay in full precision past the sinks and
    the window; with ``move_group=1``, every one of them has left."""

    def stack_of(group):
        return make_stack(tiny_93, compressor=make(name, move_group=group), sinks=SINKS, window=WINDOW)

    moved_in_groups(tiny_93, stack_of, SINKS, WINDOW)


def test_lora_bases_are_calibrated_once_and_recorded(tiny, tmp_path, monkeypatch):
    from kvbench.calibration import artifacts

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    first = _bound(tiny, make("lora"))
    (record,) = first.ctx.calibrations
    assert record["kind"] == "lora" and Path(record["path"]).exists()
    assert str(tmp_path) in record["path"]
    assert record["settings"] == {"key_rank": 4, "value_rank": 8, "tokens": CAL}
    key = first.cache.bases["key"]
    assert key.shape == (tiny.num_layers, tiny.kv_heads, tiny.head_dim, 4)
    eye = torch.eye(4).expand(tiny.num_layers, tiny.kv_heads, 4, 4)
    assert torch.allclose(key.transpose(-1, -2) @ key, eye, atol=1e-5)  # orthonormal columns

    def refuse(*args, **kwargs):
        raise AssertionError("bases recomputed instead of loaded")

    monkeypatch.setattr(artifacts, "kv_bases", refuse)
    stack = make_stack(tiny, compressor=make("lora"), sinks=SINKS, window=WINDOW)
    assert stack.calibrations() == [record]
    assert torch.equal(stack.compressor.cache.bases["key"], key)


def test_lora_plus_plus_latents_within_half_a_step(tiny_93):
    lm = tiny_93
    for bits in (8, 4):
        tech = _bound(lm, make("lora_plus_plus", latent_bits=bits, key_rank=6, value_rank=10))
        store, k, v = _store(lm)
        tech.compress(1, store)
        (seg,) = store.compressed
        assert seg.klat.dtype == torch.uint8 and seg.klat.shape[1] == 6 * bits // 8
        group = tech.move_group  # the oldest whole groups past the window leave it
        pos = torch.arange(SINKS, SINKS + (40 - WINDOW - SINKS) // group * group)
        pre = Rotary.from_model(lm.model).unrotate(k, torch.arange(40))[:, :, pos]
        bk, bv = tech.cache.bases["key"][1], tech.cache.bases["value"][1]
        exact_k = torch.einsum("bhtd,hdr->bhtr", pre, bk).reshape(-1, 6)
        exact_v = torch.einsum("bhtd,hdr->bhtr", v[:, :, pos], bv).reshape(-1, 10)
        kl, vl = seg.latents()
        assert ((kl - exact_k).abs() <= seg.kstep.float() / 2 + 1e-5).all()
        assert ((vl - exact_v).abs() <= seg.vstep.float() / 2 + 1e-5).all()
        assert seg.kzero.dtype == torch.float16 and seg.kstep.shape == (seg.size, 1)


# --- chains and knobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("other", ["svd", "quantized", "pyramid"])
def test_chain_refuses_two_representation_stages(other):
    with pytest.raises(ConfigError, match="representation"):
        chain("lora", other)


def test_chain_chunkkv_then_svd_runs(tiny_93):
    if not (Path(__file__).resolve().parents[1] / "conf/compressor/chunkkv.yaml").exists():
        pytest.skip("chunkkv not in conf/compressor yet")
    stages = chain("chunkkv", {"name": "svd", "key_rank": 4, "value_rank": 8, "block_size": 8})
    stack = make_stack(tiny_93, compressor=stages, budget=0.5, sinks=2, window=4)
    logits, cache = run_chunks(tiny_93, stack, tokens(N), SIZES)
    assert torch.isfinite(logits).all()
    for store in cache.stores:
        assert int(store.row_tokens().max()) <= math.ceil(0.5 * N)
        assert any(isinstance(s, SVDSegment) for s in store.compressed)


@pytest.mark.parametrize(
    ("cls", "knobs", "message"),
    [
        (PyramidCompressor, {"bits_max": 5}, "compressor.bits_max=5"),
        (PyramidCompressor, {"bits_min": 8, "bits_max": 4}, "compressor.bits_min=8"),
        (SVDCompressor, {"key_rank": 0}, "compressor.key_rank=0"),
        (SVDCompressor, {"key_rank": 32, "block_size": 16}, "compressor.key_rank=32"),
        (SVDCompressor, {"block_size": 0}, "compressor.block_size=0"),
        (LoraCompressor, {"value_rank": -1}, "compressor.value_rank=-1"),
        (LoraPlusPlusCompressor, {"latent_bits": 2}, "compressor.latent_bits=2"),
        (LoraPlusPlusCompressor, {"latent_bits": 4, "key_rank": 5}, "compressor.key_rank=5"),
        (LoraCompressor, {"move_group": 0}, "compressor.move_group=0"),
        (LoraPlusPlusCompressor, {"move_group": -2}, "compressor.move_group=-2"),
    ],
)
def test_knobs_are_validated(cls, knobs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        cls(**knobs)


@pytest.mark.parametrize("name", ["svd", "lora"])
def test_rank_above_head_dim_or_no_model_is_refused(tiny, name):
    with pytest.raises(ConfigError, match="key_rank=32"):
        _bound(tiny, make(name, key_rank=32, **({"block_size": 64} if name == "svd" else {})))
    with pytest.raises(ConfigError, match="rotary"):
        make(name).bind(BindContext(num_layers=2))
