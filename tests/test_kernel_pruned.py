"""ThinK's fused decode over pruned key channels (:mod:`kvbench.kernels.pruned_decode`, issue 30),
under ``TRITON_INTERPRET=1`` on the CPU (conftest sets it where there is no CUDA): the kernel
against its torch reference, a tiny model's logits on the Triton path against the torch path's, and
what one layer's decode attention launches."""

from __future__ import annotations

import pytest
import torch

from helpers import in_packed_rows, make_stack, run_chunks, tokens
from kvbench.cache import ragged
from kvbench.compressors.pruning import PrunedSegment, PruningCompressor
from kvbench.kernels import attention as ka
from kvbench.kernels import dispatch, pruned_decode
from test_kernel_launches import attention_launches, lm  # noqa: F401 (lm: the launch model, a fixture)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _pruned(gen: torch.Generator, lens: torch.Tensor, head_dim: int, keep: int, dtype: torch.dtype):
    """Kept keys ``(N, keep)``, values ``(N, head_dim)`` and sorted distinct channels ``(BH, keep)``
    int16 for head-rows of ``lens`` tokens."""
    n = int(lens.sum())
    kp = torch.randn(n, keep, generator=gen).to(dtype)
    v = torch.randn(n, head_dim, generator=gen).to(dtype)
    channels = torch.stack(
        [torch.randperm(head_dim, generator=gen)[:keep].sort().values for _ in range(lens.numel())]
    )
    return kp, v, channels.to(torch.int16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, head_dim, keep, lens, queries",
    [
        (1, 2, 2, 64, 32, [77, 77], 1),  # one query head per KV head, half the channels
        (1, 9, 3, 80, 40, [300] * 3, 1),  # GQA 9/3, head_dim 80, two splits
        (2, 8, 2, 64, 20, [700, 5, 64, 130], 1),  # ragged head-rows, one three splits long
        (1, 4, 2, 128, 128, [90, 90], 1),  # every channel kept: plain attention
        (2, 6, 2, 64, 5, [33, 33, 33, 33], 3),  # fewer channels than a block, a chunk of queries
    ],
    ids=["group1", "gqa-9-3", "ragged-splits", "keep-all", "few-channels-chunk"],
)
def test_pruned_decode_equals_scatter_then_attention(
    device, batch, q_heads, kv_heads, head_dim, keep, lens, queries
):
    """One decode step reading the kept channels of each head-row's keys (the query's channels
    gathered in the kernel by the head-row's indices) gives what scattering the kept channels into
    zeros and SDPA give, in float32 and bfloat16: head-rows of equal length (known on the host) and
    of different lengths, lengths off the kernel's block, several splits; equal head-rows also read in
    place from a packed segment's buffers (head-rows further apart than their tokens)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(head_dim * keep + sum(lens))
    lens = torch.tensor(lens)
    if len(set(lens.tolist())) == 1:
        ragged.tell(lens, int(lens[0]))  # every head-row's count known: no starts read
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        kp, v, channels = _pruned(gen, lens, head_dim, keep, dtype)
        q = torch.randn(batch, q_heads, queries, head_dim, generator=gen).to(dtype)
        want = pruned_decode.attend_reference(q, kp, v, channels, lens, head_dim**-0.5)
        on = [x.to(device) for x in (q, kp, v, channels, lens)]  # on the CPU the same tensors
        parts = pruned_decode.partials(*on, int(lens.max()), head_dim**-0.5)
        got = ka.merge([parts], on[0], kv_heads)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)
        if ragged.told(lens) is not None:  # a packed segment's rows, read in place: the same result
            kp_rows, v_rows = (in_packed_rows(x, lens.numel()) for x in on[1:3])
            args = (on[0], kp_rows, v_rows, *on[3:], int(lens.max()), head_dim**-0.5)
            packed = ka.merge([pruned_decode.partials(*args, per_row=True)], on[0], kv_heads)
            assert torch.equal(packed, got)


def test_an_empty_pruned_segment_reads_nothing():
    """No token stored: the partials say so (nothing read), and the merge gives zeros, as SDPA does
    for a query that reads nothing."""
    q = torch.randn(1, 4, 1, 64)
    lens = torch.zeros(2, dtype=torch.long)
    parts = pruned_decode.partials(
        q, torch.empty(0, 16), torch.empty(0, 64), torch.zeros(2, 16, dtype=torch.int16), lens, 0, 0.125
    )
    assert torch.equal(ka.merge([parts], q, 2), torch.zeros_like(q))


def test_the_engine_gives_the_same_logits_on_either_path(tiny, monkeypatch):
    """A tiny model (GQA 6/2) under ThinK's pruning stores the same bytes over a prefill and decode
    steps with ``kernels=triton`` (interpreted here) as with ``kernels=torch``, and its logits agree
    within float tolerance: each decode step reads the pruned keys through the fused kernel, which
    sums in another order than SDPA over the decoded rows. The torch path never asks the kernel."""
    ids = tokens(60)
    fused = []
    kernel = pruned_decode.partials
    monkeypatch.setattr(pruned_decode, "partials", lambda *a, **k: fused.append(k) or kernel(*a, **k))

    def logits(path: str):
        with dispatch.using(path):
            stack = make_stack(tiny, compressor=PruningCompressor(keep_ratio=0.5), window=8, sinks=2)
            out, cache = run_chunks(tiny, stack, ids, [40] + [1] * 20)
        return out, cache.nbytes()

    torch_logits, torch_bytes = logits("torch")
    assert not fused
    triton_logits, triton_bytes = logits("triton")
    assert triton_bytes == torch_bytes
    torch.testing.assert_close(triton_logits, torch_logits, atol=1e-4, rtol=1e-4)
    assert len(fused) >= 20 * tiny.model.config.num_hidden_layers  # every decode step, every layer
    # the segment's packed rows read in place, once a step has moved a token in
    assert all(k == {"per_row": True} for k in fused[tiny.model.config.num_hidden_layers :])


def test_the_torch_path_decodes_a_pruned_segment(tiny, monkeypatch):
    """On the torch path a pruned segment has no partials (the step is decoded as before): it is
    not asked for them (:meth:`Segment.torch_partials`), and asked anyway it gives none."""
    given = []
    original = PrunedSegment.attend_partials
    monkeypatch.setattr(PrunedSegment, "attend_partials", lambda self, *a: given.append(original(self, *a)))
    for asked in (False, True):
        if asked:
            monkeypatch.setattr(PrunedSegment, "torch_partials", lambda self: True)
        with dispatch.using("torch"):
            stack = make_stack(tiny, compressor=PruningCompressor(keep_ratio=0.5), window=8, sinks=2)
            run_chunks(tiny, stack, tokens(40), [30] + [1] * 5)
        assert bool(given) == asked and all(part is None for part in given)


def test_a_layers_decode_attention_is_the_pruned_kernel_the_window_and_one_merge(lm):  # noqa: F811
    """One layer's decode attention on the Triton path: the pruned segment's kernel, the
    full-precision window's decode kernel, and one merge of their partials, nothing else (the
    segment's packed rows are read where they are)."""
    calls = attention_launches(lm, "compressor/pruning")
    assert calls, "compressor/pruning: no decode step read its tokens through the engine"
    want = {"triton._pruned_decode_kernel": 1, "triton._decode_kernel": 1, "triton._merge_kernel": 1}
    for ran in calls:  # the segment's packed rows read in place: no join of its tokens, no copy
        assert ran == want, f"compressor/pruning: {ran}"
