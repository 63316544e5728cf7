"""Properties that decide whether kvbench fits at long context on a GPU, proven on the CPU: what
a forward allocates is recorded through torch's dispatch hooks on a tiny model with a large
vocabulary, where a ``q x vocabulary`` block of logits is the largest thing a prefill could make."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from conftest import tiny_cfg
from helpers import make_stack, run_chunks, tokens
from kvbench import models, run
from kvbench.cache import attention as att
from kvbench.cache import engine, held
from kvbench.cache.store import LayerStore
from kvbench.compressors.chunkkv import ChunkKVCompressor
from kvbench.compressors.distillation import DistillationCompressor
from kvbench.compressors.fastv import FastVCompressor
from kvbench.compressors.lora import LoraCompressor
from kvbench.compressors.lora_plus_plus import LoraPlusPlusCompressor
from kvbench.compressors.pikv import PiKVCompressor
from kvbench.compressors.pruning import PruningCompressor
from kvbench.compressors.pyramid import PyramidCompressor
from kvbench.compressors.pyramidkv import PyramidKVCompressor
from kvbench.compressors.quantized import QuantizedCompressor
from kvbench.compressors.random_select import RandomCompressor
from kvbench.compressors.snapkv import SnapKVCompressor
from kvbench.compressors.svd import SVDCompressor
from kvbench.errors import ConfigError
from kvbench.eval import generate, loop, perplexity
from kvbench.routers.adaptive import AdaptiveRouter
from kvbench.routers.eplb import EPLBRouter
from kvbench.routers.hierarchical import HierarchicalRouter
from kvbench.routers.moba import BaseRouter
from kvbench.routers.pikv import PikvRouter
from kvbench.routers.topk_balanced import TopKBalancedRouter
from kvbench.schedulers.adakv import AdaKVScheduler
from kvbench.schedulers.duo_attention import DuoAttentionScheduler
from kvbench.schedulers.flexgen import FlexGenScheduler
from kvbench.schedulers.h2o import H2OScheduler
from kvbench.schedulers.lru import LRUScheduler
from kvbench.schedulers.lru_plus import LRUPlusScheduler
from kvbench.schedulers.quest import QuestScheduler
from kvbench.schedulers.streaming_llm import StreamingLLMScheduler
from test_bad_inputs import refused
from tracking import Allocations

VOCAB = 20_000


@pytest.fixture(scope="module")
def wide_vocab():
    return models.load(tiny_cfg("llama", vocab_size=VOCAB), "cpu")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("query_aware", [False, True])
def test_generation_computes_logits_of_the_last_position_only(wide_vocab, batch, query_aware, monkeypatch):
    """A 300-token prompt's prefill makes no (300, V) logits: the lm head runs over each
    sequence's last position, as greedy decoding reads no other; the tokens are those of a model
    whose lm head runs over every position (one without ``logits_to_keep``)."""
    prompts = [generate.Prompt(tokens(300, s), tokens(6, 9 + s), max_new=3) for s in range(batch)]

    def run():
        with Allocations() as seen:
            out = generate.generate(
                wide_vocab, make_stack(wide_vocab), prompts, batch_size=batch, query_aware=query_aware
            )
        return [g.tokens for g in out], seen.rows_of(VOCAB)

    with monkeypatch.context() as m:
        m.setitem(wide_vocab.__dict__, "keeps_rows", False)
        want, every_row = run()
    got, rows = run()
    assert got == want
    assert every_row >= 300 * batch and 0 < rows <= batch


@pytest.mark.parametrize("batch_size", [1, 2])
def test_perplexity_scores_logits_of_its_chunks_only(wide_vocab, batch_size):
    """The prefill's logits are never scored, so never computed: the largest block of logits is a
    chunk's (per window of the batch); the scores are those of every row computed."""
    cfg = OmegaConf.create(
        dict(
            name="t",
            prefill=200,
            chunk=8,
            chunks_per_window=2,
            windows=2,
            decode_steps=2,
            batch_size=batch_size,
        )
    )
    ids = tokens(1000)
    stack = dict(scheduler=H2OScheduler(), budget=0.5, sinks=2, window=8)
    with Allocations() as seen:
        metrics, wins = perplexity.evaluate(wide_vocab, make_stack(wide_vocab, **stack), ids, cfg, None)
    assert 0 < seen.rows_of(VOCAB) <= cfg.chunk * batch_size
    # the same nll as a pass that keeps every row of the prefill
    cache = loop.new_cache(wide_vocab, make_stack(wide_vocab, **stack))
    loop.step(wide_vocab, cache, ids[: cfg.prefill])
    chunk = loop.step(wide_vocab, cache, ids[cfg.prefill : cfg.prefill + cfg.chunk])
    target = torch.tensor(ids[cfg.prefill + 1 : cfg.prefill + cfg.chunk + 1])
    nll = -torch.log_softmax(chunk, -1).gather(-1, target[:, None])[:, 0]
    torch.testing.assert_close(wins[0].nll[: cfg.chunk], nll)


@pytest.mark.parametrize("keep", [0, 1, 5, None])
def test_step_keeps_the_last_rows_asked_for(wide_vocab, keep):
    """``keep`` rows are the last rows of a full pass, and the only ones the lm head computes."""
    ids = tokens(120)
    full = loop.step(wide_vocab, loop.new_cache(wide_vocab, make_stack(wide_vocab)), ids)
    cache = loop.new_cache(wide_vocab, make_stack(wide_vocab))
    with Allocations() as seen:
        got = loop.step(wide_vocab, cache, ids, keep=keep)
    rows = len(ids) if keep is None else keep
    assert got.shape == (rows, VOCAB) and cache.get_seq_length() == len(ids)
    torch.testing.assert_close(got, full[len(ids) - rows :], rtol=1e-5, atol=1e-5)
    assert seen.rows_of(VOCAB) == rows


# --- the KV-hit probe's shadow: switched off, or sampled layers --------------------------------------

PPL = dict(name="t", prefill=60, chunk=8, chunks_per_window=2, windows=2, decode_steps=0)


def _probed(lm, **probe):
    cfg = OmegaConf.create({**PPL, **probe})
    stack = make_stack(lm, scheduler=H2OScheduler(), budget=0.5, sinks=2, window=8)
    return perplexity.evaluate(lm, stack, tokens(400), cfg, None)[0]


def test_kv_hit_switched_off_keeps_no_shadow(tiny, monkeypatch):
    made = []
    real = loop.new_cache
    monkeypatch.setattr(loop, "new_cache", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    metrics = _probed(tiny, kv_hit=False)
    assert metrics.kv_hit is None and metrics.kv_hit_excl is None
    assert made and all(c.shadow is None for c in made)


def test_kv_hit_of_sampled_layers_is_theirs(tiny, monkeypatch):
    """Probing layer 0 or layer 1 alone shadows that layer only; every layer's KV hit is the mean
    of the two (each layer samples the same queries), on keys kept on the host."""
    shadows = []
    real = loop.new_cache

    def new_cache(*a, **k):
        cache = real(*a, **k)
        shadows.append(cache.shadow)
        return cache

    monkeypatch.setattr(loop, "new_cache", new_cache)
    one = [_probed(tiny, kv_hit_layers=[i]) for i in range(tiny.num_layers)]
    for i in range(tiny.num_layers):
        assert [s is not None for s in shadows[i * 2]] == [j == i for j in range(tiny.num_layers)]
    every = _probed(tiny, kv_hit_queries=4)
    assert every.kv_hit == pytest.approx(sum(m.kv_hit for m in one) / len(one))
    assert all(t.device.type == "cpu" for layer in shadows[-1] for t in layer)
    fewer = _probed(tiny, kv_hit_queries=1)
    assert fewer.kv_hit != every.kv_hit  # another sample of queries


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("dataset.kv_hit=maybe", "dataset.kv_hit='maybe': must be true or false"),
        ("dataset.kv_hit_layers=[-1]", "dataset.kv_hit_layers=[-1]: must be null (every layer) or a list"),
        ("dataset.kv_hit_layers=[]", "dataset.kv_hit_layers=[]: must be null"),
        ("dataset.kv_hit_queries=0", "dataset.kv_hit_queries=0: must be an integer >= 1"),
    ],
)
def test_bad_probe_settings_get_one_line_before_any_model(tmp_path, override, needle):
    assert needle in refused(tmp_path, override)


def test_a_probed_layer_past_the_model_is_refused(tiny):
    with pytest.raises(
        ConfigError, match=r"^dataset.kv_hit_layers=\[0, 7\]: 7 is past the model's last layer \(1\)$"
    ):
        _probed(tiny, kv_hit_layers=[0, 7])


def test_probe_defaults_leave_the_cell_ids_as_they_were():
    ds = OmegaConf.create(
        {**PPL, "batch_size": 1, "kv_hit": True, "kv_hit_layers": None, "kv_hit_queries": 4}
    )
    assert run.dataset_identity(ds, "x") == {**PPL, "sha256": "x"}
    ds.kv_hit_layers = [0]
    assert run.dataset_identity(ds, "x") == {**PPL, "kv_hit_layers": [0], "sha256": "x"}


# --- masks from positions: per block of queries ---------------------------------------------------


@pytest.mark.parametrize("case", ["window", "padded"])
def test_a_prefill_mask_is_built_per_block_of_queries(case, monkeypatch):
    """A sliding-window model's prefill, or a padded batch's, reads through a mask from positions:
    it is built per block of queries (here 32), never whole ``(B, H, q, T)``, and the logits are
    those of one whole mask."""
    lm = models.load(tiny_cfg("mistral" if case == "window" else "llama"), "cpu")  # window 24
    n = 300

    def prefill():
        cache = loop.new_cache(lm, make_stack(lm), batch=2)
        ids = torch.tensor([tokens(n, 1), tokens(n, 2)])
        real = torch.ones(2, n, dtype=torch.bool)
        if case == "padded":
            real[1, :40] = False
        return loop.step_batch(lm, cache, ids, real, [])

    want = prefill()
    monkeypatch.setattr(att, "_BLOCK_ELEMS", 2 * lm.info["heads"] * n * 32)
    with Allocations() as seen:
        got = prefill()
    assert torch.equal(got, want)
    masks = [s for s, dtype, _ in seen.shapes if dtype == torch.bool and len(s) == 4 and s[-1] == n]
    assert masks and max(s[-2] for s in masks) == 32


@pytest.mark.parametrize("causal", [False, True])
def test_scores_cast_no_key_to_float32(monkeypatch, causal):
    """Found: the fp32 scores re-cast every stored key for every block of queries (at 32k, a
    full-cache-sized copy per 64 queries); then once per call. Now a bf16 cache's keys are never
    cast: each block's logits are the product in their dtype, converted to fp32 themselves."""
    q = torch.randn(1, 8, 300, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 300, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(att, "_BLOCK_ELEMS", 8 * 300 * 32)  # blocks of 32 queries
    with Allocations() as seen:
        blocks = list(att.probs_blocks(q, k, lambda a, b: None, 0.25, causal_past=0 if causal else None))
    assert len(blocks) >= 10
    casts = [s for s, dtype, _ in seen.shapes if s == tuple(k.shape) and dtype == torch.float32]
    assert not casts


# --- a compressed cache: decoded a block of head-rows at a time, kept nowhere -----------------------

HEAD_DIM = 64


@pytest.fixture(scope="module")
def wide_heads():
    """8 query and 2 KV heads of head_dim 64: decoded keys are clearly larger than their codes."""
    cfg = tiny_cfg("llama", heads=8, num_key_value_heads=2, head_dim=HEAD_DIM, hidden_size=128)
    return models.load(cfg, "cpu")


def _representations():
    return {
        "quantized": QuantizedCompressor(bits=2),
        "svd": SVDCompressor(key_rank=8, value_rank=8, block_size=16),
        "pruning": PruningCompressor(keep_ratio=0.5),
    }


@pytest.mark.parametrize("name", ["quantized", "svd", "pruning"])
def test_a_compressed_cache_holds_no_decoded_copy_between_steps(wide_heads, name):
    """Found: a compressed segment kept its tokens decoded in its rows, and the view joined them with
    the full-precision rows into a second copy, so a 2-bit cache held more than the full cache.
    Between steps a compressed cache now holds what its format stores, its full-precision rows (at
    their capacity) and per-token bookkeeping (positions, valid slots: at most 32 bytes a token and
    head-row), nothing decoded. A segment that packs the tokens joining it (``pruning``) holds its
    format's bytes at its buffers' capacity."""
    stack = make_stack(wide_heads, compressor=_representations()[name], budget=0.5)
    _, cache = run_chunks(wide_heads, stack, tokens(300, 1), [280] + [1] * 20)
    assert all(len(s.segments) == 2 for s in cache.stores)
    fp_rows = sum(s.fp.rows.fields[n].untyped_storage().nbytes() for s in cache.stores for n in ("k", "v"))

    def format_bytes(seg) -> int:
        packed = seg.__dict__.get("_packed")
        if packed is None:
            return seg.nbytes()
        # every buffer at its capacity, less the stored tokens' positions (bookkeeping, as elsewhere)
        held = sum(buf.untyped_storage().nbytes() for buf in packed.values() if buf is not None)
        return held - 8 * seg.size

    compressed = sum(format_bytes(seg) for s in cache.stores for seg in s.compressed)
    assert name != "pruning" or all("_packed" in seg.__dict__ for s in cache.stores for seg in s.compressed)
    stored = sum(seg.nbytes() for s in cache.stores for seg in s.compressed)
    side = cache.nbytes() - stored - sum(s.fp.nbytes() for s in cache.stores)
    token_rows = sum(s.stored_tokens() for s in cache.stores)
    held = cache.resident_bytes() - fp_rows - compressed - side
    assert 0 < held <= 32 * token_rows, (held, token_rows)


def test_attention_decodes_a_compressed_cache_a_block_of_head_rows_at_a_time(wide_heads, monkeypatch):
    """Blocks of one head-row (a decode budget of one head-row's keys) give the logits of one block
    of all, and a decode step then allocates no decoded keys beyond one head-row's (before: every
    stored token of the layer, decoded, and a joined copy)."""

    def decode():
        stack = make_stack(wide_heads, compressor=QuantizedCompressor(bits=2), budget=0.5)
        cache = loop.new_cache(wide_heads, stack, batch=2)
        ids = torch.tensor([tokens(200, 1), tokens(200, 2)])
        real = torch.ones(2, 200, dtype=torch.bool)
        outs = [loop.step_batch(wide_heads, cache, ids, real, [])]
        for i in range(6):
            outs.append(loop.step_batch(wide_heads, cache, ids[:, i : i + 1], real[:, :1], []))
        with Allocations() as seen:
            outs.append(loop.step_batch(wide_heads, cache, ids[:, 9:10], real[:, :1], []))
        width = cache.stores[0].view().pos.shape[2]
        # a (2, rows, T, D) block holds the keys and the values of its rows in one allocation
        decoded = [
            n // (2 if len(s) == 4 else 1)
            for s, dtype, n in seen.shapes
            if dtype == torch.float32 and s[-1:] == (HEAD_DIM,)
        ]
        return torch.cat(outs, 1), max(decoded) // (width * HEAD_DIM * 4)

    whole, rows = decode()
    assert rows >= 4  # every head-row of the batch at once
    monkeypatch.setattr(engine, "DECODE_ELEMS", 120 * HEAD_DIM)  # fewer than one head-row's tokens
    blocks, rows = decode()
    assert torch.allclose(blocks, whole, atol=1e-5, rtol=0)
    assert rows == 1


# --- bytes at 32k on Llama-3.1-8B's attention shapes, against formulas ----------------------------

T32K, KV_HEADS, HD = 32_768, 8, 128


@pytest.fixture(scope="module")
def llama8b_heads():
    """One small layer with Llama-3.1-8B's attention geometry (32 query, 8 KV heads, head_dim 128),
    for binding techniques; the 32k-token stores below are filled directly, with no forward."""
    cfg = tiny_cfg("llama", heads=32, num_key_value_heads=KV_HEADS, head_dim=HD, hidden_size=256)
    return models.load(cfg, "cpu")


def _store_at_32k(lm, role: str, technique, layer: int = 0, tokens: int = T32K) -> LayerStore:
    """A bf16 layer (``layer`` of the model's two) of one sequence after a prefill of ``tokens``
    (32k), with ``technique`` (its ``role``) applied at budget 0.5."""
    stack = make_stack(
        lm, **({role: technique} if technique is not None else {}), budget=0.5, sinks=4, window=32
    )
    gen = torch.Generator().manual_seed(0)
    store = LayerStore(1, KV_HEADS, HD, torch.bfloat16, torch.device("cpu"))
    k, v = (torch.randn(1, KV_HEADS, tokens, HD, generator=gen).to(torch.bfloat16) for _ in range(2))
    store.append(k, v)
    with torch.inference_mode():
        stack.apply(layer, store)
    return store


def _bookkeeping(store: LayerStore) -> int:
    """Bytes beyond the format's and the full-precision rows' keys and values that a store may hold:
    every segment's rows at their capacity with a position (int64), a valid flag (bool, for rows
    that every slot fills), the techniques' per-token state (float32) and, for merged units, a
    logit bias (float32) a slot; a compressed segment's
    own positions; merged units' member positions (int64 a member); the view's joined positions,
    valid slots and biases (9 bytes a slot, 13 with merged units; at most a quarter and 64 slots of
    room); the last chunk's query positions; and what side data holds beside the bytes it stores
    (``pruning``'s int64 copy of its kept channels, the float32 bases ``lora`` and
    ``lora_plus_plus`` multiply)."""
    bh = store.batch * store.kv_heads
    state = sum(4 * math.prod(st.shape) for st in store.states())
    merged = [seg.members() for seg in store.segments if seg.members() is not None]
    rows = sum(
        seg.rows.capacity * bh * (8 + 1 + state + (4 if seg.members() is not None else 0))
        for seg in store.segments
    )
    width = sum(seg.rows.width for seg in store.segments)
    slot = 9 + (4 if merged else 0)
    joined = slot * bh * (width + max(64, width // 4)) if len(store.segments) > 1 else 0
    members = sum(8 * pos.numel() for pos, _ in merged)
    seen = {t.untyped_storage().data_ptr() for data in store._side.values() for t in data.tensors()}
    beside = 0
    for t in (t for data in store._side.values() for t in held.tensors(data)):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            beside += storage.nbytes()
    return rows + 8 * store.stored_tokens() + members + joined + 8 * store.last_qpos.numel() + beside


def _resident(store: LayerStore) -> int:
    store.view()  # as attention leaves it: joined positions, nothing decoded
    store.release()
    return held.resident_bytes(store)


EVICTIONS = {
    "streaming_llm": ("scheduler", StreamingLLMScheduler),
    "h2o": ("scheduler", H2OScheduler),
    "lru": ("scheduler", LRUScheduler),
    "lru_plus": ("scheduler", LRUPlusScheduler),
    "adakv": ("scheduler", AdaKVScheduler),
    "snapkv": ("compressor", SnapKVCompressor),
    "random": ("compressor", RandomCompressor),
}
EVERY_TOKEN = {
    "quest": ("scheduler", QuestScheduler),
    "flexgen": ("scheduler", FlexGenScheduler),
    "base": ("router", BaseRouter),
    "hierarchical": ("router", HierarchicalRouter),
    "adaptive": ("router", AdaptiveRouter),
}


def _fp(tokens: int) -> int:
    """One KV head's ``tokens`` at 16 bits: keys and values of head_dim 128."""
    return tokens * 2 * HD * 2


def _kivi(q: int, bits: int) -> int:
    """One KV head's ``q`` tokens in KIVI's layout, groups of 32: keys and values ``bits`` a
    channel, 4 fp16 (zero, step) pairs per value token; per key group an fp16 zero and step per
    channel and an int16 count."""
    return q * (HD * bits // 8 * 2 + 4 * 2 * 2) + q // 32 * (HD * 2 * 2 + 2)


def _packed(t: int) -> int:
    """Tokens a KIVI-layout compressor packs: whole groups of 32 past the 4 sinks and the window."""
    return (t - 36) // 32 * 32


# the centroid routers' side data: a float32 centroid per expert (8) and channel, and its count
CENTROIDS = KV_HEADS * 8 * (HD + 1) * 4


def _duo() -> DuoAttentionScheduler:
    """DuoAttention with gates that make 3 of layer 0's 8 KV heads retrieval heads (the top half of
    the model's 16 heads by gate: 3 in layer 0, 5 in layer 1)."""
    sched = DuoAttentionScheduler(retrieval_ratio=0.5)
    sched.inject_gates(torch.tensor([[0.9, 0.8, 0.7] + [0.1] * 5, [0.95, 0.85, 0.75, 0.65, 0.6] + [0.2] * 3]))
    return sched


def case(name, role, technique, per_layer, layer: int = 0, tokens: int = T32K):
    return pytest.param(role, technique, per_layer, layer, tokens, id=name)


@pytest.mark.parametrize(
    "role, technique, per_layer, layer, tokens",
    [
        case("full-cache", "compressor", None, lambda t: KV_HEADS * _fp(t)),
        # KIVI 2-bit: whole groups past the sinks and the window packed, the rest at 16 bits
        case(
            "quantized",
            "compressor",
            lambda: QuantizedCompressor(bits=2, group_size=32),
            lambda t: KV_HEADS * (_kivi(_packed(t), 2) + _fp(t - _packed(t))),
        ),
        # ThinK at keep_ratio 0.5: past the sinks and the window, whole groups of 16 tokens whose
        # keys keep 64 of 128 channels (values whole); each KV head's 64 kept channel indices
        # (int16) once per layer
        case(
            "pruning",
            "compressor",
            lambda: PruningCompressor(keep_ratio=0.5),
            lambda t: KV_HEADS * ((q := (t - 36) // 16 * 16) * (64 + HD) * 2 + _fp(t - q) + 64 * 2),
        ),
        # evictions at budget 0.5: half the tokens, at 16 bits (which half is theirs)
        *[case(n, role, make, lambda t: KV_HEADS * _fp(t // 2)) for n, (role, make) in EVICTIONS.items()],
        # read selectors and placement store every token, at 16 bits (their metadata comes at decode)
        *[case(n, role, make, lambda t: KV_HEADS * _fp(t)) for n, (role, make) in EVERY_TOKEN.items()],
        # routers by running centroids: every token, and the centroids
        case("pikv-router", "router", PikvRouter, lambda t: KV_HEADS * _fp(t) + CENTROIDS),
        case("topk_balanced", "router", TopKBalancedRouter, lambda t: KV_HEADS * _fp(t) + CENTROIDS),
        # EPLB also stores its plan: float64 read loads per expert (8) and device (4), and int64
        # expert, device and device-without-replication of each slot (8: no reads yet, no replica)
        case(
            "eplb",
            "router",
            EPLBRouter,
            lambda t: KV_HEADS * _fp(t) + CENTROIDS + (8 + 4) * 8 + 3 * 8 * 8,
        ),
        # ChunkKV, chunks of 7: the 32,732 tokens past the sinks and the window are 4,676 whole
        # chunks; as many whole chunks as fit in half the tokens, less the 36 it protects
        case(
            "chunkkv",
            "compressor",
            lambda: ChunkKVCompressor(chunk_size=7),
            lambda t: KV_HEADS * _fp((t // 2 - 36) // 7 * 7 + 36),
        ),
        # FastV from layer 1: half the tokens there, every token in the layer before
        case("fastv", "compressor", lambda: FastVCompressor(layer=1), lambda t: KV_HEADS * _fp(t // 2), 1),
        case("fastv-before", "compressor", lambda: FastVCompressor(layer=1), lambda t: KV_HEADS * _fp(t)),
        # PyramidKV over two layers (beta 20): weights 2 - 1/20 and 1/20 of half the tokens
        case(
            "pyramidkv",
            "compressor",
            PyramidKVCompressor,
            lambda t: KV_HEADS * _fp(-(-t * 39 // 40)),
        ),
        case("pyramidkv-top", "compressor", PyramidKVCompressor, lambda t: KV_HEADS * _fp(-(-t // 40)), 1),
        # pyramid: KIVI at 8 bits in the first of two layers, at 2 in the last
        *[
            case(
                f"pyramid-{bits}bit",
                "compressor",
                lambda: PyramidCompressor(bits_max=8, bits_min=2),
                lambda t, bits=bits: KV_HEADS * (_kivi(_packed(t), bits) + _fp(t - _packed(t))),
                layer,
            )
            for layer, bits in ((0, 8), (1, 2))
        ],
        # PiKV's compressor: half the tokens kept; whole groups of them past the protected 36 move
        # to KIVI, half of those (the guard, 255 groups) at 8 bits and half at 2 bits
        case(
            "pikv-compressor",
            "compressor",
            PiKVCompressor,
            lambda t: KV_HEADS * (_kivi((q := _packed(t // 2)) // 2, 8) + _kivi(q // 2, 2) + _fp(t // 2 - q)),
        ),
        # DuoAttention: 3 retrieval heads keep every token, 5 streaming heads the sinks and window
        case("duo_attention", "scheduler", _duo, lambda t: _fp(3 * t + 5 * 36)),
        # SVD, blocks of 64 past the sinks and the window: per token 16 key and 32 value coefficients
        # (bf16), per block a 128 x 16 key and 128 x 32 value basis (bf16) and an int16 count
        case(
            "svd",
            "compressor",
            lambda: SVDCompressor(key_rank=16, value_rank=32, block_size=64),
            lambda t: (
                KV_HEADS
                * (
                    (q := (t - 36) // 64 * 64) * (16 + 32) * 2
                    + q // 64 * (HD * (16 + 32) * 2 + 2)
                    + _fp(t - q)
                )
            ),
        ),
        # LoRA: past the sinks and the window, whole groups of 16 tokens, 32 key and 32 value
        # latents (bf16) a token; the layer's calibrated bases once, 128 x 32 per KV head for keys
        # and for values
        case(
            "lora",
            "compressor",
            lambda: LoraCompressor(key_rank=32, value_rank=32),
            lambda t: (
                KV_HEADS * ((q := (t - 36) // 16 * 16) * (32 + 32) * 2 + _fp(t - q) + HD * (32 + 32) * 2)
            ),
        ),
        # LoRA++: in whole groups of 16 as LoRA, 16 key and 32 value latents at 8 bits and an fp16
        # zero and step for each of the two a token; bases 128 x 16 and 128 x 32
        case(
            "lora_plus_plus",
            "compressor",
            lambda: LoraPlusPlusCompressor(key_rank=16, value_rank=32, latent_bits=8),
            lambda t: (
                KV_HEADS
                * ((q := (t - 36) // 16 * 16) * (16 + 32 + 2 * 2 * 2) + _fp(t - q) + HD * (16 + 32) * 2)
            ),
        ),
        # distillation: the tokens past the sinks and the window merged into as many units as
        # half the tokens allow, less the 36, each a bf16 key and value and an int32 count. At 8k:
        # its k-means at prefill grows with the square of the context (a minute at 32k here)
        case(
            "distillation",
            "compressor",
            DistillationCompressor,
            lambda t: KV_HEADS * ((t // 2 - 36) * (2 * HD * 2 + 4) + _fp(36)),
            tokens=8192,
        ),
    ],
)
def test_bytes_at_32k_match_their_formulas(llama8b_heads, role, technique, per_layer, layer, tokens):
    """A layer of Llama-3.1-8B's shapes after a 32k prefill stores the bytes its format's formula
    gives, exactly, for every technique and the full cache, and holds no more than those, its
    full-precision rows' capacity and per-token bookkeeping; a decode step's attention allocates at
    most one block of decoded keys (``DECODE_ELEMS`` float32 elements), not the layer's."""
    made = technique() if technique is not None else None
    store = _store_at_32k(llama8b_heads, role, made, layer, tokens)
    assert store.nbytes() == per_layer(tokens)
    fp_capacity = sum(store.fp.rows.fields[n].untyped_storage().nbytes() for n in ("k", "v"))
    stored_fp = store.fp.nbytes()
    assert _resident(store) <= store.nbytes() - stored_fp + fp_capacity + _bookkeeping(store)
    query = torch.randn(1, 4 * KV_HEADS, 1, HD).to(torch.bfloat16)
    with Allocations() as seen:
        engine._attend_decoded(store, query, None, None, HD**-0.5)
    assert seen.largest() <= 4 * engine.DECODE_ELEMS
