"""The fused low-rank decode over quantized latents (``lora_plus_plus``; :mod:`kvbench.kernels.
latent_decode` with ``bits``, issue 30): against its torch reference under ``TRITON_INTERPRET=1``
(conftest sets it where there is no CUDA, before kvbench imports Triton), end to end against the
torch path on a tiny model, and what a layer's decode attention launches with it."""

from __future__ import annotations

import pytest
import torch

from helpers import in_packed_rows, make_stack, run_chunks, tokens
from kvbench import config, models
from kvbench.cache import quant
from kvbench.cache.rotary import Rotary
from kvbench.compressors.lora_plus_plus import LATENT_BITS, LoraPlusPlusCompressor
from kvbench.compressors.lowrank import Bases, LatentSegment
from kvbench.eval import stepcost
from kvbench.kernels import attention as ka
from kvbench.kernels import dispatch, latent_decode
from test_kernel_launches import MODEL, attention_launches

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _codes(gen, n: int, rank: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` random latents of ``rank`` quantized as a :class:`LatentSegment` stores them: codes
    packed along each latent ``(n, rank * bits / 8)``, a float16 zero and step ``(n, 1)`` each."""
    codes, zero, step = quant.quantize(torch.randn(n, rank, generator=gen), bits, dim=-1)
    return quant.pack(codes, bits), zero, step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", LATENT_BITS)
@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, tokens_per_row, head_dim, ranks, rotated, splits",
    [
        (1, 2, 2, 48, 32, (6, 10), 32, 1),  # no grouping (GQA 1), one split
        (2, 6, 3, 600, 40, (14, 22), 16, 3),  # GQA 2, a batch, partial rotary: the rest passes through
        (1, 9, 3, 77, 80, (12, 20), 32, 1),  # GQA 3, head_dim 80
        (1, 8, 2, 2100, 64, (18, 30), 64, 9),  # GQA 4, several splits merged by their log-sum-exp
    ],
)
def test_quantized_latent_decode_equals_dequantize_then_attention(
    device, bits, batch, q_heads, kv_heads, tokens_per_row, head_dim, ranks, rotated, splits
):
    """The fused latent decode over 4- and 8-bit latent codes (dequantized in registers, keys
    rebuilt and rotated there, values kept latent until one product with their basis) gives what
    dequantizing the latents, rebuilding every key and value and SDPA give, with RoPE's attention
    scaling, ranks off the powers of two, in float32 and bfloat16."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(tokens_per_row + bits)
    rk, rv = ranks
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, rotated, 2).float() / rotated)), 1.25)
    n = batch * kv_heads * tokens_per_row
    lens = torch.full((batch * kv_heads,), tokens_per_row)
    pos = torch.randperm(3 * tokens_per_row, generator=gen)[:tokens_per_row].repeat(batch * kv_heads)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(batch, q_heads, 1, head_dim, generator=gen).to(dtype)
        (kcodes, kzero, kstep), (vcodes, vzero, vstep) = (_codes(gen, n, r, bits) for r in ranks)
        assert kcodes.shape == (n, rk * bits // 8) and kcodes.dtype == torch.uint8
        kbasis = (torch.randn(kv_heads, head_dim, rk, generator=gen) / rk**0.5).to(dtype)
        vbasis = (torch.randn(kv_heads, head_dim, rv, generator=gen) / rv**0.5).to(dtype)
        args = (kcodes, vcodes, pos, kbasis, vbasis, rotary, lens)
        params = (kzero, kstep, vzero, vstep)
        want = latent_decode.attend_reference(q, *args, head_dim**-0.5, bits, params)
        on = [x.to(device) if isinstance(x, torch.Tensor) else x for x in args]
        parts = latent_decode.partials(
            q.to(device), *on, tokens_per_row, head_dim**-0.5, bits, tuple(p.to(device) for p in params)
        )
        assert parts.m.shape[0] == splits
        got = ka.merge([parts], q.to(device), kv_heads)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)
        # a packed segment's rows, read in place (head-rows further apart than their tokens)
        rows = batch * kv_heads
        packed = [in_packed_rows(x.to(device), rows) for x in (kcodes, vcodes, pos)]
        parts = latent_decode.partials(
            q.to(device), *packed, *on[3:], tokens_per_row, head_dim**-0.5, bits,
            tuple(in_packed_rows(p.to(device), rows) for p in params), per_row=True,
        )  # fmt: skip
        assert torch.equal(ka.merge([parts], q.to(device), kv_heads), got)


def test_the_reference_dequantizes_as_the_segment_does():
    """The quantized reference is the unquantized one over the latents a lora_plus_plus segment
    reads back (:meth:`LatentSegment.latents`), bitwise."""
    gen = torch.Generator().manual_seed(0)
    kv_heads, per_row, d, rk, rv, bits = 2, 24, 16, 4, 6, 4
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    lens = torch.full((kv_heads,), per_row)
    pos = torch.arange(per_row).repeat(kv_heads)
    kb, vb = (torch.randn(kv_heads, d, r, generator=gen) for r in (rk, rv))
    k, v = (torch.randn(kv_heads * per_row, d, generator=gen) for _ in range(2))
    seg = LatentSegment.encode(rotary, Bases.make(rotary, kb, vb), bits, k, v, pos, lens)
    q = torch.randn(1, 4, 1, d, generator=gen)
    params = (seg.kzero, seg.kstep, seg.vzero, seg.vstep)
    got = latent_decode.attend_reference(q, seg.klat, seg.vlat, pos, kb, vb, rotary, lens, 0.25, bits, params)
    want = latent_decode.attend_reference(q, *seg.latents(), pos, kb, vb, rotary, lens, 0.25)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [8])  # the default; 4 bits at the kernel's level (above), for CI's time
def test_lora_plus_plus_gives_the_same_logits_on_either_path(tiny, bits, monkeypatch):
    """A tiny model under ``lora_plus_plus`` stores the same bytes with ``kernels=triton``
    (interpreted here) as with ``kernels=torch``, and its logits agree within float tolerance: each
    decode step of every layer reads the quantized latents through the fused kernel (no decoded
    keys or values), which sums in another order than the torch path."""
    ids = tokens(60)
    fused = []
    kernel = latent_decode.partials
    monkeypatch.setattr(latent_decode, "partials", lambda *a, **k: fused.append(a[10]) or kernel(*a, **k))

    def logits(path: str):
        compressor = LoraPlusPlusCompressor(
            key_rank=4, value_rank=8, latent_bits=bits, calibration_tokens=256
        )
        with dispatch.using(path):
            out, cache = run_chunks(
                tiny, make_stack(tiny, compressor=compressor, window=8, sinks=2), ids, [40] + [1] * 20
            )
        return out, cache.nbytes()

    (torch_logits, torch_bytes), (triton_logits, triton_bytes) = logits("torch"), logits("triton")
    assert triton_bytes == torch_bytes
    torch.testing.assert_close(triton_logits, torch_logits, atol=1e-4, rtol=1e-4)
    # every decode step, every layer, with the codes' bit width
    assert len(fused) >= 20 * tiny.model.config.num_hidden_layers and set(fused) == {bits}


@pytest.fixture(scope="module")
def lm():
    config.register()
    return models.load(stepcost.model_config(MODEL), "cpu")


def test_a_layers_lora_plus_plus_decode_attention_is_its_partials_and_one_merge(lm):
    """One layer's decode step over quantized latents and the full-precision window launches the
    fused latent kernel, the decode kernel and one merge: no dequantizing kernel and no decoded
    copy, and nothing else: the segment's packed rows are read where they are
    (:func:`kvbench.cache.segments.packed_rows`), no join of the tokens moved in."""
    calls = attention_launches(lm, "compressor/lora_plus_plus")
    assert calls, "lora_plus_plus: no decode step read its tokens through the engine"
    want = {"triton._latent_decode_kernel": 1, "triton._decode_kernel": 1, "triton._merge_kernel": 1}
    for ran in calls:
        assert ran == want, f"lora_plus_plus: {ran}"
