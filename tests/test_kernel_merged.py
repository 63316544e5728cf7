"""Merged units read in place on the Triton path (issue 30): a :class:`MergedSegment`'s units are
full precision, so its decode-step state is the decode kernel's over its own rows, each head-row
read to its length with each unit's ``log(count)`` bias, no mask and no decoded copy; a layer's
step is that kernel, the full-precision window's and one merge. Under ``TRITON_INTERPRET=1``
(conftest sets it where there is no CUDA): against attention over the units and the window laid
side by side with the bias, end to end against the torch path on a tiny model, and what a layer's
decode attention launches."""

from __future__ import annotations

import pytest
import torch

from helpers import make_stack, run_chunks, tokens
from kvbench import config, models
from kvbench.cache import engine
from kvbench.cache.store import LayerStore
from kvbench.compressors.distillation import DistillationCompressor, MergedSegment
from kvbench.eval import stepcost
from kvbench.kernels import attention as ka
from kvbench.kernels import dispatch
from test_kernel_launches import MODEL, attention_launches

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _store(gen, batch, kv_heads, head_dim, units, window, dtype, device) -> tuple[LayerStore, MergedSegment]:
    """A layer's store holding merged units (``units`` per head-row, head-major; some counts above
    one) before a full-precision window of ``window`` tokens in every head-row."""
    bh = batch * kv_heads
    store = LayerStore(batch, kv_heads, head_dim, dtype, torch.device(device))
    fp = [torch.randn(batch, kv_heads, window, head_dim, generator=gen).to(dtype) for _ in "kv"]
    store.append(*(x.to(device) for x in fp))
    lens = torch.tensor(units)
    n = int(lens.sum())
    count = torch.randint(1, 6, (n,), generator=gen, dtype=torch.int32)
    seg = MergedSegment(
        lens=lens.to(device),
        pos=torch.arange(n).to(device),
        k=torch.randn(n, head_dim, generator=gen).to(dtype).to(device),
        v=torch.randn(n, head_dim, generator=gen).to(dtype).to(device),
        count=count.to(device),
        mpos=torch.arange(int(count.sum())).to(device),
    )
    same = len(set(units)) == 1
    store.adopt(seg, {}, first=True, per_row=units[0] if same else None)
    assert len(units) == bh and seg.rows.uniform == same
    return store, seg


def _reference(query, store: LayerStore, seg: MergedSegment, scaling: float) -> torch.Tensor:
    """SDPA over the units (padded per head-row) and the window side by side: valid slots as a
    mask, each unit's ``log(count)`` as its logit bias (the window's: none)."""
    b, h, d = store.batch, store.kv_heads, store.head_dim
    width = seg.rows.width
    valid = seg.rows.valid().view(b, h, width)
    k, v = (torch.zeros(b * h, width, d, dtype=x.dtype, device=x.device) for x in (seg.k, seg.v))
    k[seg.rows.valid()], v[seg.rows.valid()] = seg.k, seg.v
    bias = torch.zeros(b * h, width, device=query.device)
    bias[seg.rows.valid()] = seg.count.float().log()
    fp = store.fp.rows
    keys = torch.cat([k.view(b, h, width, d), fp.get("k").view(b, h, -1, d)], 2)
    values = torch.cat([v.view(b, h, width, d), fp.get("v").view(b, h, -1, d)], 2)
    mask = torch.cat([valid, fp.valid().view(b, h, -1)], 2)[:, :, None, :]
    bias = torch.cat([bias.view(b, h, width), torch.zeros(b, h, fp.width, device=query.device)], 2)
    return ka.attend_reference(query, keys, values, mask, scaling, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, head_dim, units, window",
    [
        (1, 8, 2, 32, [300, 300], 6),  # as distillation's uniform merge leaves them: two splits
        (2, 6, 2, 40, [3, 0, 5, 2], 4),  # ragged head-rows (its general merge), one of them empty
        (1, 9, 3, 64, [17, 17, 17], 9),  # GQA 3, units and window of odd lengths
    ],
)
def test_merged_units_read_in_place_equal_attention_with_their_bias(
    device, batch, q_heads, kv_heads, head_dim, units, window
):
    """On the Triton path a merged segment gives the decode kernel's state over its own rows (the
    flat units, or each head-row's gathered to its first slots where head-rows differ), with its
    bias and lengths and no mask; merged with the window's it is attention over both side by side
    with the bias. On the torch path it gives none, as before (the step is decoded)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(sum(units))
    scaling = head_dim**-0.5
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        store, seg = _store(gen, batch, kv_heads, head_dim, units, window, dtype, device)
        q = torch.randn(batch, q_heads, 1, head_dim, generator=gen).to(dtype).to(device)
        want = _reference(q, store, seg, scaling)
        with dispatch.using("torch"):
            assert seg.attend_partials(q, scaling, batch) is None
        calls = []

        def spy(*a, partials=ka.partials, calls=calls):
            calls.append(a)
            return partials(*a)

        with dispatch.using("triton"), pytest.MonkeyPatch.context() as mp:
            mp.setattr(ka, "partials", spy)
            parts = [s.attend_partials(q, scaling, batch) for s in store.segments]
            got = ka.merge(parts, q, kv_heads)
        merged = calls[0]
        assert merged[3] is None and merged[5] is not None  # no mask; the units' bias
        assert (merged[6] is None) == seg.rows.uniform  # lengths where head-rows differ
        assert merged[1].shape[2] == seg.rows.width  # no slot past the longest head-row
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu().float(), want.cpu().float(), atol=tol, rtol=tol)


# GQA 3 at the kernel's level (above); one model end to end, for CI's time
@pytest.mark.parametrize("model", ["tiny"], ids=["heads-6-2"])
def test_merged_units_give_the_same_logits_on_either_path(model, monkeypatch, request):
    """A tiny model under distillation gives logits within float tolerance on both paths (the
    kernels sum in another order than SDPA): on the Triton path every decode step of every layer
    reads its merged units in place (the kernel with their bias, no mask, no positions) and merges
    them with the window's state, never the masked kernel over a decoded view; the bytes stored are
    the same. (A scheduler beside distillation evicts to the budget before any merge: no merged
    units to read.)"""
    lm = request.getfixturevalue(model)
    ids = tokens(60)
    merged, kernels, decoded = [], [], []
    attend_partials = MergedSegment.attend_partials

    def spy_segment(seg, *a):
        parts = attend_partials(seg, *a)
        merged.append(parts is not None)
        return parts

    def spy_kernel(*a, partials=ka.partials):
        kernels.append((a[3] is not None, a[5] is not None, len(a) > 7 and a[7] is not None))
        return partials(*a)

    monkeypatch.setattr(MergedSegment, "attend_partials", spy_segment)
    monkeypatch.setattr(ka, "partials", spy_kernel)
    attend = ka.attend
    monkeypatch.setattr(ka, "attend", lambda *a, **kw: decoded.append(1) or attend(*a, **kw))

    def logits(path: str):
        stack = make_stack(lm, compressor=DistillationCompressor(), budget=0.5, window=8, sinks=2)
        with dispatch.using(path):
            out, cache = run_chunks(lm, stack, ids, [40] + [1] * 20)
        return out, cache.nbytes()

    (torch_logits, torch_bytes) = logits("torch")
    assert not merged and not kernels  # the torch path's steps are decoded, as before
    triton_logits, triton_bytes = logits("triton")
    assert triton_bytes == torch_bytes
    torch.testing.assert_close(triton_logits, torch_logits, atol=1e-4, rtol=1e-4)
    layers = lm.model.config.num_hidden_layers
    assert len(merged) == 20 * layers and all(merged)  # every decode step, every layer
    assert not decoded  # no step attended a decoded view
    assert sum(bias for _, bias, _ in kernels) == 20 * layers  # the units' kernel, with their bias
    assert not any(mask or pos for mask, _, pos in kernels)  # no mask, no positions


@pytest.fixture(scope="module")
def lm():
    config.register()
    return models.load(stepcost.model_config(MODEL), "cpu")


def test_a_layers_merged_decode_attention_is_its_partials_and_one_merge(lm):
    """One layer's decode step over merged units and the full-precision window launches the decode
    kernel twice (the units, with their bias; the window) and one merge, and nothing else: no
    decoded copy of the layer, no mask."""
    calls = attention_launches(lm, "compressor/distillation")
    assert calls, "distillation: no decode step read its tokens through the engine"
    for ran in calls:
        assert ran == {"triton._decode_kernel": 2, "triton._merge_kernel": 1}, f"distillation: {ran}"


def test_the_engine_asks_merged_units_only_on_the_triton_path(monkeypatch):
    """A step whose view carries a bias gathers the segments' states only where the step took the
    attention kernel: the torch path's states take no bias, so its steps are decoded as before."""
    gen = torch.Generator().manual_seed(0)
    store, seg = _store(gen, 1, 2, 16, [5, 5], 3, torch.float32, "cpu")
    q = torch.randn(1, 4, 1, 16, generator=gen)
    asked = []
    monkeypatch.setattr(engine.partials, "gather", lambda *a: asked.append(1))  # None: decoded
    mask = store.view().valid[:, :, None, :]
    for path in ("torch", "triton"):
        with dispatch.using(path):
            engine._attend_decoded(store, q, mask, None, 0.25, reads_all=True)
    assert asked == [1]  # the Triton path's step only
