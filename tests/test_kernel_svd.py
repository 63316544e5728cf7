"""The fused decode over SVD's per-block factors (:mod:`kvbench.kernels.svd_decode`, issue 30):
against its torch reference under ``TRITON_INTERPRET=1`` (conftest sets it where there is no CUDA,
before kvbench imports Triton), end to end against the torch path on a tiny model, and what a
layer's decode attention launches with it."""

from __future__ import annotations

import pytest
import torch

from helpers import make_stack, run_chunks, tokens
from kvbench import config, models
from kvbench.cache.rotary import Rotary
from kvbench.compressors.svd import SVDCompressor, SVDSegment
from kvbench.eval import stepcost
from kvbench.kernels import attention as ka
from kvbench.kernels import dispatch, svd_decode
from test_kernel_launches import MODEL, attention_launches

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _factors(gen, batch, kv_heads, tokens_per_row, head_dim, block, rk, rv, dtype):
    """Random per-token factors ``(N, rk)``, ``(N, rv)`` (or full values ``(N, D)`` where ``rv`` is
    None) and per-block bases ``(M, D, r)`` of ``batch * kv_heads`` head-rows."""
    n = batch * kv_heads * tokens_per_row
    m = n // block
    ka_ = torch.randn(n, rk, generator=gen).to(dtype)
    kb = (torch.randn(m, head_dim, rk, generator=gen) / rk**0.5).to(dtype)
    if rv is None:
        return ka_, torch.randn(n, head_dim, generator=gen).to(dtype), kb, None
    va = torch.randn(n, rv, generator=gen).to(dtype)
    return ka_, va, kb, (torch.randn(m, head_dim, rv, generator=gen) / rv**0.5).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, tokens_per_row, head_dim, block, ranks, rotated, splits, queries",
    [
        (1, 2, 2, 48, 32, 8, (5, 12), 32, 1, 2),  # no grouping, two queries; blocks shorter than a chunk
        (2, 6, 3, 600, 40, 24, (7, 11), 16, 3, 1),  # GQA 2, a batch, partial rotary, three splits
        (1, 8, 2, 300, 64, 100, (6, None), 64, 2, 1),  # GQA 4, full values, blocks of two chunks, two splits
        (1, 6, 2, 320, 32, 64, (3, None), 32, 2, 1),  # GQA 3, full values, blocks of one chunk, two splits
    ],
)
def test_svd_decode_equals_rebuild_then_attention(
    device, batch, q_heads, kv_heads, tokens_per_row, head_dim, block, ranks, rotated, splits, queries
):
    """The fused SVD decode (keys rebuilt from each block's factors and rotated in registers,
    factored values summed per block and expanded once by its basis, full values read as stored)
    gives what rebuilding every key and value and SDPA give, with RoPE's attention scaling, ranks
    off the powers of two, one or two queries, in float32 and bfloat16; its splits merge by their
    log-sum-exp."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(tokens_per_row)
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, rotated, 2).float() / rotated)), 1.25)
    pos = torch.randperm(3 * tokens_per_row, generator=gen)[:tokens_per_row].repeat(batch * kv_heads)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(batch, q_heads, queries, head_dim, generator=gen).to(dtype)
        ka_, va, kb, vb = _factors(gen, batch, kv_heads, tokens_per_row, head_dim, block, *ranks, dtype)
        args = (ka_, va, pos, kb, vb, rotary, kv_heads, block, head_dim**-0.5)
        want = svd_decode.attend_reference(q, *args)
        on = [x.to(device) if isinstance(x, torch.Tensor) else x for x in args]
        parts = svd_decode.partials(q.to(device), *on)
        assert parts.m.shape[0] == splits
        got = ka.merge([parts], q.to(device), kv_heads)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


def test_ragged_blocks_take_the_decoded_path():
    """On the Triton path a segment whose blocks an eviction left uneven has no fused partials
    (None: the step is decoded); whole blocks of equal head-rows have."""
    gen = torch.Generator().manual_seed(0)
    rows, per_row, block, d = 2, 16, 8, 16
    ka_, va, kb, vb = _factors(gen, 1, rows, per_row, d, block, 3, 5, torch.float32)
    lens = torch.full((rows,), per_row)
    seg = SVDSegment(
        lens=lens, pos=torch.arange(per_row).repeat(rows), rotary=Rotary(torch.ones(d // 2)), ka=ka_,
        va=va, kb=kb, vb=vb, gcount=torch.full((kb.shape[0],), block, dtype=torch.int16), glens=lens // block,
    )  # fmt: skip
    q = torch.randn(1, 4, 1, d, generator=gen)
    with dispatch.using("triton"):
        parts = seg.attend_partials(q, 0.25, 1)
        assert isinstance(parts, ka.Partials)
        ka.workspace(q.device, 16).give_back(parts)  # not merged here: its room given back
        keep = torch.ones(rows * per_row, dtype=torch.bool)
        keep[3] = False
        seg.keep(keep)
        assert seg.attend_partials(q, 0.25, 1) is None


# full values at the kernel's level (above); factored end to end, for CI's time
@pytest.mark.parametrize("value_rank", [5], ids=["factored-values"])
def test_svd_gives_the_same_logits_on_either_path(tiny, value_rank, monkeypatch):
    """A tiny model under an svd compressor stores the same bytes with ``kernels=triton``
    (interpreted here) as with ``kernels=torch``, and its logits agree within float tolerance:
    each decode step reads the factored blocks through the fused kernel, which sums in another order
    than SDPA over the rebuilt keys and values."""
    ids = tokens(60)
    fused = []
    kernel = svd_decode.partials
    monkeypatch.setattr(svd_decode, "partials", lambda *a: fused.append(1) or kernel(*a))

    def logits(path: str):
        compressor = SVDCompressor(key_rank=3, value_rank=value_rank, block_size=8)
        with dispatch.using(path):
            out, cache = run_chunks(
                tiny, make_stack(tiny, compressor=compressor, window=8, sinks=2), ids, [40] + [1] * 20
            )
        return out, cache.nbytes()

    (torch_logits, torch_bytes), (triton_logits, triton_bytes) = logits("torch"), logits("triton")
    assert triton_bytes == torch_bytes
    torch.testing.assert_close(triton_logits, torch_logits, atol=1e-4, rtol=1e-4)
    assert len(fused) >= 20 * tiny.model.config.num_hidden_layers  # every decode step, every layer


@pytest.fixture(scope="module")
def lm():
    config.register()
    return models.load(stepcost.model_config(MODEL), "cpu")


def test_a_layers_svd_decode_attention_is_its_partials_and_one_merge(lm):
    """One layer's decode step over an svd segment and the full-precision window launches the fused
    SVD kernel, the decode kernel and one merge, and nothing else."""
    calls = attention_launches(lm, "compressor/svd")
    assert calls, "svd: no decode step read its tokens through the engine"
    want = {"triton._svd_decode_kernel": 1, "triton._decode_kernel": 1, "triton._merge_kernel": 1}
    for ran in calls:
        assert ran == want, f"svd: {ran}"
