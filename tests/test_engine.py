"""The cache engine with the stack `none` equals plain transformers; positions never shift."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch

from conftest import FAMILIES, tiny_cfg
from helpers import make_stack, run_chunks, tokens
from kvbench import models
from kvbench.cache import attention as att
from kvbench.cache import engine, partials
from kvbench.compressors.lora import LoraCompressor
from kvbench.compressors.lora_plus_plus import LoraPlusPlusCompressor
from kvbench.compressors.lowrank import LatentSegment
from kvbench.compressors.svd import SVDCompressor, SVDSegment
from kvbench.eval import loop, perplexity
from kvbench.schedulers.streaming_llm import StreamingLLMScheduler


def plain_logits(lm, ids):
    lm.model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return lm.model(torch.tensor([ids])).logits[0].float()
    finally:
        lm.model.set_attn_implementation("kvbench")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_none_stack_equals_transformers(family):
    lm = models.load(tiny_cfg(family), "cpu")
    ids = tokens(60)
    got, cache = run_chunks(lm, make_stack(lm), ids, [30, 7, 1, 1, 21])
    assert torch.allclose(got, plain_logits(lm, ids), atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 60


def test_gqa_9_3_split_equals_transformers(tiny_93):
    assert (tiny_93.kv_heads, tiny_93.model.config.num_attention_heads) == (3, 9)
    ids = tokens(40)
    got, _ = run_chunks(tiny_93, make_stack(tiny_93), ids, [20, 20])
    assert torch.allclose(got, plain_logits(tiny_93, ids), atol=1e-4, rtol=1e-4)


def test_chunked_perplexity_equals_full_pass(tiny):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        dict(name="t", prefill=40, chunk=8, chunks_per_window=4, windows=1, decode_steps=0)
    )
    ids = tokens(200)
    metrics, wins = perplexity.evaluate(tiny, make_stack(tiny), ids, cfg, None)
    window = ids[: perplexity.window_length(cfg)]
    full = torch.log_softmax(plain_logits(tiny, window), -1)
    target = torch.tensor(window[41:])
    ref_nll = -full[40:-1].gather(-1, target[:, None])[:, 0]
    assert torch.allclose(wins[0].nll, ref_nll, rtol=1e-4, atol=1e-6)
    assert metrics.score.value == pytest.approx(float(ref_nll.mean().exp()), rel=1e-4)


def test_eviction_keeps_true_positions(tiny):
    """After eviction the next token's rotary position is the true count, not the stored length."""
    stack = make_stack(tiny, scheduler=StreamingLLMScheduler(), budget=0.25, sinks=2, window=4)
    _, cache = run_chunks(tiny, stack, tokens(64), [64])
    assert cache.get_seq_length() == 64
    assert cache.stores[0].stored_tokens() < 64 * tiny.kv_heads
    pos = cache.stores[0].view().pos
    assert int(pos.max()) == 63  # the newest token kept its original position


def test_compressed_cache_refuses_crop_and_beam(tiny):
    _, cache = run_chunks(tiny, make_stack(tiny), tokens(8), [8])
    with pytest.raises(NotImplementedError, match="crop"):
        cache.crop(4)
    with pytest.raises(NotImplementedError, match="beam"):
        cache.reorder_cache(torch.tensor([0]))


def test_no_folder_of_the_checkout_shadows_an_installed_package():
    """Run from the checkout's root (``python -m kvbench``, ``python -m pytest``: the working folder
    is on ``sys.path``), no folder of kvbench's is imported in place of an installed package. The
    Triton kernels live inside the package (``src/kvbench/kernels``): as a top-level ``kernels/``
    they were imported in place of Hugging Face's ``kernels``, which transformers 5.25 imports when
    it builds a model."""
    import subprocess
    import sys
    from pathlib import Path

    import kvbench.kernels

    root = Path(__file__).resolve().parents[1]
    assert not [p.name for p in root.iterdir() if (p / "__init__.py").exists()]  # no package at the top
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '')"
    found = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    origin = found.stdout.strip()  # an installed package's, or none
    assert not origin or "site-packages" in Path(origin).parts, origin
    assert Path(kvbench.kernels.__file__).parent == root / "src" / "kvbench" / "kernels"


@pytest.mark.parametrize("case", ["causal", "ragged", "window", "bias", "decode"])
def test_probs_skip_unread_keys_bitwise(case):
    """Scores computed in causal sub-blocks against only the keys they reach equal, bit for bit,
    the masked softmax over every key (the skipped columns are the zeros of -inf logits)."""
    from kvbench.cache import attention as att

    gen = torch.Generator().manual_seed(7)
    b, h, g, t, d = 2, 2, 3, 700, 16
    q = 1 if case == "decode" else t
    query = torch.randn(b, h * g, q, d, generator=gen)
    key = torch.randn(b, h, t, d, generator=gen)
    pos = torch.arange(t).expand(b, h, t)
    valid = torch.ones(b, h, t, dtype=torch.bool)
    if case == "ragged":
        valid[1, 0, 650:] = False
    qpos = torch.arange(t - q, t).expand(b, q)
    window = 300 if case == "window" else None
    bias = torch.rand(b, h, t, generator=gen) if case == "bias" else None
    mask = att.read_mask(pos, valid, qpos, window)
    logits = torch.einsum("bhgqd,bhtd->bhgqt", query.view(b, h, g, q, d), key) * 0.25
    if bias is not None:
        logits = logits + bias[:, :, None, None, :]
    want = torch.softmax(logits.masked_fill(~mask[:, :, None], float("-inf")), dim=-1)
    assert torch.equal(att.probs(query, key, mask, 0.25, bias), want)
    blocks = list(att.probs_blocks(query, key, lambda s, e: mask[:, :, s:e], 0.25, bias))
    # a causal prefill's sub-blocks are only as wide as the keys their queries read
    assert [p.shape[-1] for _, p in blocks] == ([t] if case == "decode" else [256, 512, t])


@pytest.mark.parametrize("block", [None, 10, 300])
@pytest.mark.parametrize("past, q", [(0, 700), (0, 200), (0, 512), (40, 600), (300, 16)])
def test_plain_causal_scores_equal_the_masked_ones_bitwise(past, q, block, monkeypatch):
    """The plain causal path (no mask built, only each sub-block's diagonal masked) gives, bit for
    bit, the scores of the causal read mask, for prefills longer and shorter than a sub-block, for
    queries after a past (an observation window's last queries), and in outer blocks of a few
    queries or of more than a sub-block (``block`` queries: a long context's blocks)."""
    from kvbench.cache import attention as att

    if block is not None:
        monkeypatch.setattr(att, "_BLOCK_ELEMS", block * 9 * (past + q))

    gen = torch.Generator().manual_seed(11)
    b, h, g, d = 1, 3, 3, 16
    t = past + q
    query = torch.randn(b, h * g, q, d, generator=gen)
    key = torch.randn(b, h, t, d, generator=gen)
    mask = att.read_mask(
        torch.arange(t).expand(b, h, t),
        torch.ones(b, h, t, dtype=torch.bool),
        torch.arange(past, t).expand(b, q),
        None,
    )
    want = list(att.probs_blocks(query, key, lambda s, e: mask[:, :, s:e], 0.25))
    got = list(att.probs_blocks(query, key, None, 0.25, causal_past=past))
    assert [s for s, _ in got] == [s for s, _ in want]
    for (_, a), (_, w) in zip(got, want):
        assert torch.equal(a, w)


@pytest.mark.parametrize("tech", ["h2o", "lru", "lru_plus", "pikv", "snapkv"])
def test_observers_read_narrow_sub_blocks_as_one_full_block(tech):
    """A causal prefill's scores come in sub-blocks only as wide as the keys their queries read
    (the later keys have probability 0); every observer's state is the one a single full-width
    block of the same probabilities gives: exactly for positions, to rounding for sums."""
    from kvbench.cache import attention as att
    from kvbench.cache.store import LayerStore
    from kvbench.compressors.pikv import PiKVCompressor
    from kvbench.compressors.snapkv import SnapKVCompressor
    from kvbench.schedulers.h2o import H2OScheduler
    from kvbench.schedulers.lru import LRUScheduler
    from kvbench.schedulers.lru_plus import LRUPlusScheduler

    make = {
        "h2o": H2OScheduler,
        "lru": LRUScheduler,
        "lru_plus": LRUPlusScheduler,
        "pikv": PiKVCompressor,
        "snapkv": SnapKVCompressor,
    }[tech]
    gen = torch.Generator().manual_seed(5)
    b, h, g, t, d = 2, 2, 3, 600, 8
    k, v = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    query = torch.randn(b, h * g, t, d, generator=gen)
    stores = [LayerStore(b, h, d, torch.float32, torch.device("cpu")) for _ in range(2)]
    for store in stores:
        store.append(k, v)
    qpos = stores[0].last_qpos
    observer = make()
    view = stores[0].view()
    mask = att.read_mask(view.pos, view.valid, qpos, None)
    observer.observe(0, stores[0], att.probs(query, k, mask, 0.3), qpos)
    blocks = list(att.probs_blocks(query, k, None, 0.3, causal_past=0))
    assert [p.shape[-1] for _, p in blocks] == [256, 512, 600]
    for start, part in blocks:
        observer.observe(0, stores[1], part, qpos[:, start : start + part.shape[3]])
    states = stores[0].states()
    assert states and states == stores[1].states()
    for st in states:
        one, split = stores[0].state(st), stores[1].state(st)
        if tech == "lru":
            assert torch.equal(one, split)
        else:
            torch.testing.assert_close(one, split, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_observed_logits_are_the_keys_product_in_their_dtype(dtype):
    """In a bfloat16 or float16 model the logits an observer reads are the product of the stored
    keys in their dtype (float32 sums rounded once, as eager reference implementations take them),
    then scaled in float32: bit for bit that, with no float32 copy of the keys written; float32
    keys give the float32 product as before. Queries of another dtype than the keys (keys rebuilt
    in float32) multiply in float32."""
    from kvbench.eval.stepcost import LaunchCounter

    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 8, 1, 64, generator=gen).to(dtype)
    key = torch.randn(1, 2, 300, 64, generator=gen).to(dtype)
    with LaunchCounter() as counter:
        probs = att.decode_probs(query, key, 0.125)
    want = (query.view(1, 2, 4, 64) @ key.transpose(-1, -2)).float().mul_(0.125)
    assert torch.equal(probs, torch.softmax(want.view(1, 2, 4, 1, 300), -1))
    assert counter.bytes < key.numel() * 4  # a float32 copy of the keys alone would be that
    q32, k32 = query.float(), key.float()
    exact = (q32.view(1, 2, 4, 64) @ k32.transpose(-1, -2)).mul_(0.125).view(1, 2, 4, 1, 300)
    assert torch.equal(att.decode_probs(q32, k32, 0.125), torch.softmax(exact, -1))
    assert torch.equal(att.decode_probs(query, k32, 0.125), torch.softmax(exact, -1))
    blocks = list(att.probs_blocks(query, key, lambda s, e: None, 0.125))  # a prefill's blocks alike
    assert torch.equal(blocks[0][1], probs)


@pytest.mark.parametrize("latent", [False, True])
def test_partials_merged_equal_attention_over_every_slot(latent):
    """A decode step attended part by part (:func:`partials.partial`, ragged slots of one part masked,
    one part's values latent on per-head bases) and read as one softmax gives what SDPA gives over
    every slot at once; a query group that reads nothing in one part takes the others' output."""
    gen = torch.Generator().manual_seed(3)
    b, h, g, d, r = 2, 3, 3, 16, 5
    q = torch.randn(b, h * g, 1, d, generator=gen)
    k1, k2 = torch.randn(b, h, 7, d, generator=gen), torch.randn(b, h, 11, d, generator=gen)
    v1 = torch.randn(b, h, 7, d, generator=gen)
    basis = torch.randn(h, d, r, generator=gen) if latent else None
    lat = torch.randn(b, h, 11, r, generator=gen)
    v2 = torch.einsum("bhtr,hdr->bhtd", lat, basis) if latent else torch.randn(b, h, 11, d, generator=gen)
    valid = torch.rand(b, h, 7, generator=gen) > 0.3
    valid[0, 1] = False  # a head-row with nothing in the first part
    parts = [
        partials.partial(q, k1, v1, 0.25, valid),
        partials.partial(q, k2, lat if latent else v2, 0.25, basis=basis),
    ]
    mask = torch.cat((valid, torch.ones(b, h, 11, dtype=torch.bool)), -1)[:, :, None]
    want = att.attend(q, torch.cat((k1, k2), 2), torch.cat((v1, v2), 2), mask, 0.25)
    torch.testing.assert_close(partials.merge(parts, q, h), want, atol=1e-5, rtol=1e-5)


def test_one_partial_merges_to_its_own_quotient_bit_for_bit():
    """One part (a ragged layer of one segment) is its own quotient, written out here as the
    log-sum-exp state it was before several parts were read as one softmax: the same bits, and
    head-rows that read nothing give zeros."""
    gen = torch.Generator().manual_seed(5)
    b, h, g, d = 2, 3, 2, 8
    q = torch.randn(b, h * g, 1, d, generator=gen)
    k, v = torch.randn(b, h, 13, d, generator=gen), torch.randn(b, h, 13, d, generator=gen)
    valid = torch.rand(b, h, 13, generator=gen) > 0.4
    valid[1, 2] = False
    logits = partials.partial(q, k, v, 0.3, valid).logits * 0.3  # its logits come unscaled
    m = logits.amax(-1, keepdim=True)
    p = (logits - m.masked_fill(m == float("-inf"), 0.0)).exp()
    total = p.sum(-1)
    want = torch.einsum("bhgqt,bhtd->bhgqd", p, v) / total.masked_fill(total == 0, 1.0)[..., None]
    got = partials.merge([partials.partial(q, k, v, 0.3, valid)], q, h)
    assert torch.equal(got, want.flatten(1, 2)) and not got.view(b, h, g, 1, d)[1, 2].any()


@pytest.mark.parametrize(
    "make, segment",
    [
        (lambda: LoraCompressor(key_rank=4, value_rank=8, calibration_tokens=256), LatentSegment),
        (
            lambda: LoraPlusPlusCompressor(key_rank=4, value_rank=8, latent_bits=4, calibration_tokens=256),
            LatentSegment,
        ),
        (lambda: SVDCompressor(key_rank=3, value_rank=5, block_size=8), SVDSegment),
        (lambda: SVDCompressor(key_rank=3, value_rank=None, block_size=8), SVDSegment),
    ],
    ids=["lora", "lora_plus_plus-4bit", "svd", "svd-fp-values"],
)
def test_factored_values_are_attended_without_rebuilding_them(tiny_93, make, segment, monkeypatch):
    """On the torch path, decode steps attend a latent (lora, lora_plus_plus) or block-factored (svd)
    segment through its partial, values summed in factor space and expanded once: the logits agree
    with decoding every key and value first, and the stored bytes are the same."""
    ids, sizes = tokens(50), [30] + [1] * 20
    monkeypatch.setattr(partials, "PARTIAL_MIN_SLOTS", 0)  # the tiny model's segments are short
    used = []
    original = segment.attend_partials
    monkeypatch.setattr(
        segment, "attend_partials", lambda self, *a: used.append(original(self, *a) is not None)
    )
    out, cache = run_chunks(tiny_93, make_stack(tiny_93, compressor=make(), window=4, sinks=2), ids, sizes)
    assert sum(used) >= 16 * tiny_93.model.config.num_hidden_layers
    monkeypatch.setattr(partials, "gather", lambda *a: None)
    decoded, cache_decoded = run_chunks(
        tiny_93, make_stack(tiny_93, compressor=make(), window=4, sinks=2), ids, sizes
    )
    assert cache.nbytes() == cache_decoded.nbytes()
    torch.testing.assert_close(out, decoded, atol=1e-4, rtol=1e-4)


def test_a_bare_step_over_parts_is_read_from_the_segments_alone(tiny_93, monkeypatch):
    """A decode step of a stack that acts outside attention only (svd), over layers of several
    segments that each give their part, reads the segments alone: it takes no masked read (no view
    of a layer is made or updated for it), and the parts are asked once per layer."""
    monkeypatch.setattr(partials, "PARTIAL_MIN_SLOTS", 0)  # the tiny model's segments are short
    masked, asked = [], []
    masked_read, gather = engine.KVCache._attend_masked, partials.gather
    monkeypatch.setattr(
        engine.KVCache, "_attend_masked", lambda *a, **k: masked.append(1) or masked_read(*a, **k)
    )
    monkeypatch.setattr(partials, "gather", lambda *a: asked.append(a[0]) or gather(*a))
    svd = SVDCompressor(key_rank=3, value_rank=5, block_size=8)
    _, cache = run_chunks(tiny_93, make_stack(tiny_93, compressor=svd, window=4, sinks=2), tokens(30), [30])
    masked.clear()
    asked.clear()
    for token in tokens(6, 1):
        loop.step(tiny_93, cache, [token])
    assert len(cache.stores[0].segments) > 1
    assert not masked and len(asked) == 6 * len(cache.stores)


def test_a_bare_step_over_decoded_segments_makes_no_view(tiny_93, monkeypatch):
    """A decode step of a stack that acts outside attention only (KIVI), over layers of several
    segments of which one has no part on the torch path, decodes them and reads every slot without
    a view: no masked read, and the joined positions are not updated. Against the masked read: the
    same logits bit for bit, and a view made afterwards (for a technique that reads it) holds the
    same positions and valid slots; the masked read's joined rows are held beside the cache."""
    from kvbench.compressors.quantized import QuantizedCompressor

    def run(lean: bool):
        if not lean:
            monkeypatch.setattr(engine, "_decoded_whole", lambda store: None)
        stack = make_stack(tiny_93, compressor=QuantizedCompressor(bits=2, group_size=8), window=4, sinks=2)
        _, cache = run_chunks(tiny_93, stack, tokens(40), [40])
        masked, masked_read = [], engine.KVCache._attend_masked
        monkeypatch.setattr(
            engine.KVCache, "_attend_masked", lambda *a, **k: masked.append(1) or masked_read(*a, **k)
        )
        logits, resident = [], []
        for t in tokens(12, 1):
            logits.append(loop.step(tiny_93, cache, [t]))
            resident.append(cache.resident_bytes())
        monkeypatch.undo()
        return torch.cat(logits), cache, masked, resident

    lean, cache, masked, resident = run(True)
    ref, want, masked_ref, resident_ref = run(False)
    assert len(cache.stores[0].segments) > 1
    assert not masked and masked_ref.count(1) == 12 * len(want.stores)
    assert torch.equal(lean, ref)
    assert cache.nbytes() == want.nbytes() and all(a <= b for a, b in zip(resident, resident_ref))
    for store, other in zip(cache.stores, want.stores):
        view, other_view = store.view(), other.view()
        assert torch.equal(view.pos, other_view.pos) and torch.equal(view.valid, other_view.valid)
        assert torch.equal(view.k, other_view.k) and torch.equal(view.v, other_view.v)


def test_an_observed_step_over_ragged_rows_reads_its_output_from_its_probabilities(tiny_93, monkeypatch):
    """A decode step over ragged full-precision rows (AdaKV's per-head budgets) whose only
    technique inside attention observes the probabilities makes the rows' logits once: the
    observer's probabilities are their softmax, and the output is those probabilities times the
    values (adakv version 3), not a second read. Against the masked read, which makes them twice:
    the logits agree at float tolerance; the first layer, whose keys and queries come from the
    tokens alone, holds the same observer state and rows bit for bit; every layer holds the same
    tokens (resident bytes after every step)."""
    from kvbench.schedulers.adakv import AdaKVScheduler

    def run(ragged_path: bool):
        if not ragged_path:
            monkeypatch.setattr(engine, "_observed_ragged", lambda *a: None)
        stack = make_stack(
            tiny_93, scheduler=AdaKVScheduler(obs_window=4, pool=3), budget=0.4, window=4, sinks=2
        )
        _, cache = run_chunks(tiny_93, stack, tokens(40), [40])
        masked = []
        masked_read, merge = engine.KVCache._attend_masked, partials.merge
        monkeypatch.setattr(
            engine.KVCache, "_attend_masked", lambda *a, **k: masked.append(1) or masked_read(*a, **k)
        )
        monkeypatch.setattr(partials, "merge", lambda *a: masked.append("merge") or merge(*a))
        logits, resident = [], []
        for t in tokens(8, 1):
            logits.append(loop.step(tiny_93, cache, [t]))
            resident.append(cache.resident_bytes())
        monkeypatch.undo()
        return torch.cat(logits), cache, masked, resident

    fast, cache, masked, resident = run(True)  # no masked read, no merge of logits
    slow, ref, masked_ref, resident_ref = run(False)
    assert not cache.stores[0].fp.rows.uniform  # ragged rows
    assert not masked and masked_ref.count(1) == 8 * len(ref.stores)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    assert resident == resident_ref  # what the stores hold after each step
    store, want = cache.stores[0], ref.stores[0]
    assert store.states() == want.states() and store.states()
    for st in store.states():
        assert torch.equal(store.state(st), want.state(st))
    view, want_view = store.view(), want.view()
    assert torch.equal(view.k, want_view.k) and torch.equal(view.valid, want_view.valid)


def _lora_partials(lm, monkeypatch) -> list:
    """What LatentSegment.attend_partials returned over a tiny lora run (prefill 30, 5 steps)."""
    given = []
    original = LatentSegment.attend_partials
    monkeypatch.setattr(LatentSegment, "attend_partials", lambda self, *a: given.append(original(self, *a)))
    lora = LoraCompressor(key_rank=4, value_rank=8, calibration_tokens=256)
    run_chunks(lm, make_stack(lm, compressor=lora, window=4, sinks=2), tokens(40), [30] + [1] * 5)
    return given


def test_partials_stay_within_the_decoded_blocks_bound(tiny_93, monkeypatch):
    """A layer whose keys exceed :data:`engine.DECODE_ELEMS` is decoded in blocks of head-rows
    instead: the torch path's partials, which rebuild a segment's keys whole, are not asked."""
    monkeypatch.setattr(partials, "PARTIAL_MIN_SLOTS", 0)
    monkeypatch.setattr(engine, "DECODE_ELEMS", 20 * tiny_93.head_dim)  # fewer than one layer's keys
    assert not _lora_partials(tiny_93, monkeypatch)


def test_short_segments_are_decoded_on_the_torch_path(tiny_93, monkeypatch):
    """Below :data:`partials.PARTIAL_MIN_SLOTS` tokens per head-row a latent segment has no partial on the
    torch path (SDPA over the decoded rows is quicker there): it is not asked for one
    (:meth:`Segment.torch_partials`), asked anyway it gives none, and the step is decoded, bitwise
    as before."""
    assert not _lora_partials(tiny_93, monkeypatch)
    monkeypatch.setattr(LatentSegment, "torch_partials", lambda self: True)
    given = _lora_partials(tiny_93, monkeypatch)
    assert given and all(part is None for part in given)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_cache_goes_in_under_the_keyword_the_forward_declares(family):
    """transformers renamed ``past_key_values`` to ``cache`` and removes the old name in 5.40, where
    a cache passed under it would be dropped for a model-built one: kvbench passes the cache under
    the name the installed version's forward declares, and no deprecation is raised."""
    lm = models.load(tiny_cfg(family), "cpu")
    assert lm.cache_arg in inspect.signature(lm.model.forward).parameters
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_chunks(lm, make_stack(lm), tokens(20), [12, 1, 1])
    assert not [w for w in seen if "past_key_values" in str(w.message)]

    def older(input_ids=None, past_key_values=None, use_cache=None):
        """An older transformers' forward."""

    before = SimpleNamespace(model=SimpleNamespace(forward=older))
    assert models.LoadedModel.cache_arg.func(before) == "past_key_values"


@pytest.mark.parametrize("evict", [False, True])
def test_a_forward_plans_its_reads_once(tiny, evict, monkeypatch):
    """Every layer of a forward follows one read plan, made at its first layer (issue 29): one plan
    (and one read of the padding mask) per forward, whatever the number of layers."""
    from kvbench.cache import plan
    from kvbench.eval import loop
    from kvbench.schedulers.h2o import H2OScheduler

    made = []
    make = plan.ReadPlan.make.__func__

    def counted(cls, cache, q_len, window):
        made.append((q_len, window))
        return make(cls, cache, q_len, window)

    monkeypatch.setattr(plan.ReadPlan, "make", classmethod(counted))
    stack = make_stack(tiny, scheduler=H2OScheduler() if evict else None, budget=0.5)
    cache = loop.new_cache(tiny, stack, batch=2)
    ids = torch.tensor([tokens(12), tokens(12, seed=1)])
    real = torch.ones_like(ids, dtype=torch.bool)
    real[1, :3] = False  # left padding
    loop.step_batch(tiny, cache, ids, real, [])
    for _ in range(3):
        loop.step_batch(tiny, cache, ids[:, :1], real[:, -1:], [])
    assert len(cache.stores) > 1
    assert made == [(12, None)] + [(1, None)] * 3
    plan = cache.plan(1, None)
    assert len(plan.first) == len(cache.stores) and len(plan.observers) == evict


@pytest.mark.parametrize("kind", ["router", "quest"])
def test_a_routed_step_over_dense_rows_reads_through_the_mask_with_no_view(tiny_93, monkeypatch, kind):
    """A decode step whose only technique inside attention is the read selector (a router, Quest),
    over full-precision rows that every head fills, reads them through the selector's mask with no
    view made by the engine (a router makes none either: it reads the rows' keys). Against the
    masked read: the same logits and the same read figures, bit for bit."""
    from kvbench.cache.plan import ReadPlan
    from kvbench.cache.store import LayerStore
    from kvbench.routers.moba import BaseRouter
    from kvbench.schedulers.quest import QuestScheduler

    def run(routed: bool):
        if not routed:
            make = ReadPlan._make.__func__
            monkeypatch.setattr(
                ReadPlan,
                "_make",
                classmethod(lambda cls, *a: dataclasses.replace(make(cls, *a), routed=False)),
            )
        if kind == "router":
            stack = make_stack(tiny_93, router=BaseRouter(num_experts=4, top_k=2), window=4, sinks=2)
        else:
            stack = make_stack(tiny_93, scheduler=QuestScheduler(page_size=4, dense_layers=0), budget=1.0)
        _, cache = run_chunks(tiny_93, stack, tokens(40), [40])
        views, masked = [], []
        make_view, masked_read = LayerStore.view, engine.KVCache._attend_masked
        monkeypatch.setattr(LayerStore, "view", lambda self: views.append(1) or make_view(self))
        monkeypatch.setattr(
            engine.KVCache, "_attend_masked", lambda *a, **k: masked.append(1) or masked_read(*a, **k)
        )
        logits = torch.cat([loop.step(tiny_93, cache, [t]) for t in tokens(10, 1)])
        monkeypatch.undo()
        return logits, stack.metrics(), masked, views

    lean, figures, masked, views = run(True)
    ref, figures_ref, masked_ref, _ = run(False)
    assert not masked and masked_ref
    assert kind == "quest" or not views
    assert torch.equal(lean, ref) and figures == figures_ref


@pytest.mark.parametrize("batch", [1, 2])
def test_a_bare_step_over_rows_of_different_lengths_is_one_masked_sdpa(batch):
    """One segment of full-precision rows of different lengths (DuoAttention's streaming heads
    shorter than its retrieval heads) is read on the torch path by SDPA with the rows' valid slots
    as its mask: the attention over each head-row's own tokens (float64 reference), as the
    segment's partial and its merge give it, in fewer operations."""
    from kvbench.cache.store import LayerStore
    from kvbench.eval.stepcost import LaunchCounter

    gen = torch.Generator().manual_seed(batch)
    h, g, d, t = 2, 3, 8, 20
    store = LayerStore(batch, h, d, torch.float32, torch.device("cpu"))
    store.append(torch.randn(batch, h, t, d, generator=gen), torch.randn(batch, h, t, d, generator=gen))
    mask = torch.ones(batch, h, t, dtype=torch.bool)
    mask[:, 1, 4:15] = False  # the second head of each sequence keeps 9 of its 20 tokens
    store.keep(mask)
    assert not store.fp.rows.uniform and store.dense_kv() is None
    query = torch.randn(batch, h * g, 1, d, generator=gen)
    with torch.inference_mode(), LaunchCounter() as ragged:
        out = engine._attend_ragged(store, query, 0.3)
    with torch.inference_mode(), LaunchCounter() as parts:
        merged = engine._attend_parts(store, query, 0.3)
    assert out is not None and merged is not None and ragged.ops < parts.ops
    view = store.view()
    for b in range(batch):
        for head in range(h * g):
            kv = head // g
            live = view.valid[b, kv]
            k, v = view.k[b, kv][live].double(), view.v[b, kv][live].double()
            want = torch.softmax(query[b, head, 0].double() @ k.T * 0.3, -1) @ v
            assert torch.allclose(out[b, head, 0].double(), want, atol=1e-6)
            assert torch.allclose(merged[b, head, 0].double(), want, atol=1e-6)
