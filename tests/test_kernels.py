"""Triton kernels against their torch references (issue 14), under ``TRITON_INTERPRET=1`` on the
CPU (conftest sets it where there is no CUDA) and on CUDA where there is one; and the ``kernels``
setting: refused in one line when it cannot run, part of a cell's identity, said in its record."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_cfg
from helpers import in_packed_rows, make_stack, run_chunks, tokens
from kvbench import models, run
from kvbench.cache import attention as att
from kvbench.cache.rotary import Rotary
from kvbench.compressors.distillation import DistillationCompressor
from kvbench.compressors.lora import LoraCompressor
from kvbench.compressors.pikv import PiKVCompressor
from kvbench.compressors.pyramid import PyramidCompressor
from kvbench.compressors.quantized import QuantizedCompressor, quantize_tokens
from kvbench.kernels import attention as ka
from kvbench.kernels import compaction as kc
from kvbench.kernels import dispatch, kivi, kivi_decode, latent_decode
from kvbench.kernels import scoring as ks
from kvbench.routers.adaptive import AdaptiveRouter
from kvbench.routers.eplb import EPLBRouter
from kvbench.routers.hierarchical import HierarchicalRouter
from kvbench.routers.moba import BaseRouter
from kvbench.routers.pikv import PikvRouter
from kvbench.routers.topk_balanced import TopKBalancedRouter
from kvbench.schedulers.adakv import AdaKVScheduler
from kvbench.schedulers.h2o import H2OScheduler
from kvbench.schedulers.quest import QuestScheduler
from test_bad_inputs import cell, refused

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _equal(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "bits, head_dim, group", list(itertools.product((2, 3, 4, 8), (64, 80, 128), (32, 20)))
)
def test_kivi_kernels_equal_their_references(device, bits, head_dim, group):
    """Quantize-and-pack and unpack-and-dequantize, keys and values, give the torch path's bytes
    and values exactly, for every bit width, head_dim 64, 80 (value groups that do not tile it)
    and 128, groups of 32 and 20 tokens (not a power of two), in float32, bfloat16 and float16,
    token counts that are not multiples of the kernels' blocks: either path reads what the other
    wrote."""
    _skip_without(device)
    gen = torch.Generator().manual_seed(bits * head_dim + group)
    for dtype in DTYPES:
        k = (3 * torch.randn(3 * group, head_dim, generator=gen)).to(dtype)
        v = (3 * torch.randn(3 * group + 5, head_dim, generator=gen)).to(dtype)
        keys = kivi.quantize_keys_reference(k, bits, group)
        values = kivi.quantize_values_reference(v, bits, group)
        on = [t.to(device) for t in (*keys, *values)]
        _equal(kivi.quantize_keys(k.to(device), bits, group), keys)
        _equal(kivi.quantize_values(v.to(device), bits, group), values)
        want_k = kivi.dequantize_keys_reference(*keys, bits, dtype, per_group=group)
        _equal([kivi.dequantize_keys(*on[:3], bits, dtype, per_group=group)], [want_k])
        want_v = kivi.dequantize_values_reference(*values, bits, head_dim, group, dtype)
        _equal([kivi.dequantize_values(*on[3:], bits, head_dim, group, dtype)], [want_v])


@pytest.mark.parametrize("device", DEVICES)
def test_kivi_key_groups_left_ragged_by_an_eviction(device):
    """After an eviction a key group may hold fewer tokens than others: the kernel reads each
    token's group from ``group_ids``, as the reference does; an empty segment gives nothing."""
    _skip_without(device)
    gen = torch.Generator().manual_seed(0)
    packed, zero, step = kivi.quantize_keys_reference(torch.randn(4 * 32, 128, generator=gen), 2, 32)
    kept = torch.rand(4 * 32, generator=gen) < 0.6
    ids = (torch.arange(4 * 32) // 32)[kept]
    want = kivi.dequantize_keys_reference(packed[kept], zero, step, 2, torch.bfloat16, group_ids=ids)
    got = kivi.dequantize_keys(
        packed[kept].to(device), zero.to(device), step.to(device), 2, torch.bfloat16, group_ids=ids.to(device)
    )
    _equal([got], [want])
    empty = kivi.dequantize_keys(
        packed[:0].to(device), zero.to(device), step.to(device), 2, torch.float16, 32
    )
    assert empty.shape == (0, 128)


@pytest.mark.parametrize(
    "compressor, fused_kernel",
    [
        (lambda: QuantizedCompressor(bits=2, group_size=8), kivi_decode),
        (lambda: PyramidCompressor(bits_max=8, bits_min=3, group_size=8), kivi_decode),
        (lambda: PiKVCompressor(group_size=8), kivi_decode),
        (lambda: LoraCompressor(key_rank=4, value_rank=8, calibration_tokens=256), latent_decode),
    ],
    ids=["quantized-2bit", "pyramid-8-3bit", "pikv", "lora"],
)
def test_the_engine_gives_the_same_logits_on_either_path(tiny, compressor, fused_kernel, monkeypatch):
    """A tiny model's stored bytes over a prefill and decode steps are the same with
    ``kernels=triton`` (interpreted here) as with ``kernels=torch`` (the packing kernels write the
    torch path's bytes), and its logits agree within float tolerance: each decode step reads the
    packed codes (KIVI) or the latents (LoRA) through a fused kernel, which sums in another order
    than SDPA."""
    ids = tokens(60)
    fused = []
    kernel = fused_kernel.partials
    monkeypatch.setattr(fused_kernel, "partials", lambda *a, **k: fused.append(1) or kernel(*a, **k))

    def logits(path: str):
        with dispatch.using(path):
            out, cache = run_chunks(
                tiny, make_stack(tiny, compressor=compressor(), window=8, sinks=2), ids, [40] + [1] * 20
            )
        return out, cache.nbytes()

    (torch_logits, torch_bytes), (triton_logits, triton_bytes) = logits("torch"), logits("triton")
    assert triton_bytes == torch_bytes
    torch.testing.assert_close(triton_logits, torch_logits, atol=1e-4, rtol=1e-4)
    assert len(fused) >= 20  # every decode step past the first packed group, at least


def test_a_kernels_value_that_cannot_run_is_refused_in_one_line(tmp_path, monkeypatch):
    assert refused(tmp_path, "kernels=cuda") == "kernels='cuda': allowed auto, torch, triton"
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert refused(tmp_path, "kernels=triton").startswith(
            "kernels=triton with device=auto: Triton needs CUDA here, or TRITON_INTERPRET=1"
        )


def test_the_kernels_are_part_of_a_cell_and_its_record(tmp_path):
    """``kernels=torch`` (and ``auto`` on a CPU) keep the ids cells had before the kernels existed;
    ``triton`` is another cell, and the record says which path ran."""
    plain = run.plan(cell(tmp_path))
    assert "kernels" not in plain.ident
    auto = run.plan(cell(tmp_path, "kernels=auto", "device=cpu"))
    assert auto.cell_id == run.plan(cell(tmp_path, "kernels=torch")).cell_id == plain.cell_id
    triton = run.plan(cell(tmp_path, "kernels=triton", "device=cpu"))
    assert triton.ident["kernels"] == f"triton@{dispatch.versions_stamp()}"
    assert triton.cell_id != plain.cell_id
    record = run.run(
        cell(tmp_path, "kernels=triton", "device=cpu", "compressor=quantized", "compressor.group_size=8")
    )
    assert record["status"] == "done", record["error"]
    assert record["kernels"] == "triton"


# --- masked decode attention over a ragged cache ----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, queries, slots, head_dim, with_bias",
    [
        (1, 9, 3, 1, 77, 64, False),  # GQA 9/3, slots not a multiple of the block
        (2, 32, 8, 1, 130, 128, False),  # Llama-3.1-8B's heads, a batch
        (2, 9, 3, 3, 95, 80, True),  # a short chunk of queries, merged units' logit bias
        (1, 4, 2, 1, 2100, 64, False),  # several splits, merged by their log-sum-exp
    ],
)
def test_masked_decode_attention_equals_its_reference(
    device, batch, q_heads, kv_heads, queries, slots, head_dim, with_bias
):
    """The decode kernel gives SDPA's attention under a per-KV-head mask: ragged heads (each row
    its own number of stored slots, one head-row empty: zeros, as SDPA gives), a read selector's
    holes, bias per unit; and, with no mask, over each head-row's first ``lens`` slots; in
    float32, bfloat16 and float16."""
    _skip_without(device)
    gen = torch.Generator().manual_seed(slots)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        q = torch.randn(batch, q_heads, queries, head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(batch, kv_heads, slots, head_dim, generator=gen).to(dtype) for _ in range(2))
        lens = torch.randint(1, slots + 1, (batch, kv_heads), generator=gen)
        lens[0, -1] = 0 if not with_bias else lens[0, -1]  # an empty head-row (with a bias, SDPA's
        # additive mask is finite: it would average an empty row's values)
        mask = torch.arange(slots) < lens[..., None, None]  # (B, H, 1, T): each row's stored slots
        mask = mask & (torch.rand(batch, kv_heads, queries, slots, generator=gen) < 0.8)
        bias = torch.randn(batch, kv_heads, slots, generator=gen).to(dtype) if with_bias else None
        want = ka.attend_reference(q, k, v, mask, head_dim**-0.5, bias)
        on = [None if x is None else x.to(device) for x in (q, k, v, mask, bias)]
        got = ka.attend(*on[:4], head_dim**-0.5, on[4])
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)
        assert with_bias or not got[0, -(q_heads // kv_heads) :].any()  # the empty head-row's queries
        # each head-row's first `lens` slots, no mask: the kernel reads no further
        want = ka.attend_reference(q, k, v, None, head_dim**-0.5, bias, lens)
        got = ka.attend(*on[:3], None, head_dim**-0.5, on[4], lens.to(device))
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "role, technique",
    [
        ("scheduler", lambda: AdaKVScheduler()),  # ragged heads
        ("scheduler", lambda: QuestScheduler(page_size=4, dense_layers=0)),  # a read selector
        ("router", lambda: BaseRouter(num_experts=4, top_k=2)),  # a router
        ("compressor", lambda: DistillationCompressor()),  # merged units' bias
        ("compressor", None),  # the full cache of a sliding-window model: its window is a mask
    ],
    ids=["adakv", "quest", "router-base", "distillation", "sliding-window"],
)
def test_masked_steps_give_the_same_logits_on_either_path(tiny_93, role, technique, monkeypatch, request):
    """A tiny GQA model's logits over a prefill and decode steps agree on both paths (float
    tolerance: the kernel sums in another order) for techniques whose steps read through a mask;
    the Triton path ran the kernel at every masked step (AdaKV's ragged heads by their lengths,
    with no mask; a sliding window by positions, with no mask built from them; merged units
    read in place with their bias, beside the window's state: tests/test_kernel_merged.py; Quest's
    and the router's decode steps by the pages or blocks chosen, with no mask), and the read
    selectors scored their pages or experts by the scoring kernel."""
    ids = tokens(60)
    calls, by_lens, by_pos, by_pages, scored = [], [], [], [], []
    merge, partials = ka.merge, ka.partials
    monkeypatch.setattr(ka, "merge", lambda *a: calls.append(1) or merge(*a))

    def spy(*a):
        by_lens.append(a[6] is not None)
        by_pos.append(len(a) > 7 and a[7] is not None)
        by_pages.append(len(a) > 8 and a[8] is not None)
        return partials(*a)

    monkeypatch.setattr(ka, "partials", spy)
    for name in ("group_bounds", "group_scores"):
        kernel = getattr(ks, name)
        monkeypatch.setattr(ks, name, lambda *a, kernel=kernel, name=name: scored.append(name) or kernel(*a))

    lm = tiny_93 if technique is not None else models.load(tiny_cfg("mistral", sliding_window=16), "cpu")
    parts = {role: technique()} if technique is not None else {}

    def logits(path: str):
        with dispatch.using(path):
            stack = make_stack(lm, **parts, budget=0.5, window=8, sinks=2)
            return run_chunks(lm, stack, ids, [40] + [1] * 20)[0]

    want = logits("torch")
    assert not calls
    torch.testing.assert_close(logits("triton"), want, atol=1e-4, rtol=1e-4)
    assert len(calls) >= 20  # at least once a decode step
    case = request.node.callspec.id
    assert any(by_lens) == (case == "adakv")  # by lengths: one segment's ragged rows
    assert any(by_pos) == (case == "sliding-window")  # no selector: positions alone
    paged = case in ("quest", "router-base")  # each decode step, every layer
    assert sum(by_pages) == (20 * lm.model.config.num_hidden_layers if paged else 0)
    assert set(scored) == {"quest": {"group_bounds"}, "router-base": {"group_scores"}}.get(case, set())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "key_bits, value_bits, head_dim, q_heads, kv_heads",
    [(2, 2, 128, 32, 8), (3, 4, 80, 9, 3), (8, 2, 64, 4, 2), (4, 8, 64, 6, 2)],
)
def test_fused_kivi_decode_equals_dequantize_then_attention(
    device, key_bits, value_bits, head_dim, q_heads, kv_heads
):
    """One decode step over packed codes, dequantized in registers, gives what dequantizing the
    segment and attending gives: head-rows holding different numbers of whole groups (one of them
    several splits long), GQA, every bit width, head_dim 64, 80 and 128, float32, bfloat16 and
    float16."""
    _skip_without(device)
    g, batch = 32, 2
    gen = torch.Generator().manual_seed(key_bits * 10 + value_bits)
    groups = torch.randint(1, 6, (batch * kv_heads,), generator=gen)
    groups[0] = 40  # 1,280 tokens: two splits
    lens = groups * g
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        n = int(lens.sum())
        k, v = (torch.randn(n, head_dim, generator=gen).to(dtype) for _ in range(2))
        seg = quantize_tokens(k, v, torch.arange(n), lens, key_bits, value_bits, g)
        q = torch.randn(batch, q_heads, 1, head_dim, generator=gen).to(dtype)
        # the reference: every token dequantized, laid out in padded rows, attended by lengths
        width = int(lens.max())
        dk = kivi.dequantize_keys_reference(seg.kcodes, seg.kzero, seg.kstep, key_bits, dtype, g)
        dv = kivi.dequantize_values_reference(
            seg.vcodes, seg.vzero, seg.vstep, value_bits, head_dim, g, dtype
        )
        held = torch.arange(width) < lens[:, None]
        pad_k, pad_v = (torch.zeros(batch * kv_heads, width, head_dim, dtype=dtype) for _ in range(2))
        pad_k[held], pad_v[held] = dk, dv
        shape = (batch, kv_heads, width, head_dim)
        want = ka.attend_reference(
            q, pad_k.view(shape), pad_v.view(shape), None, head_dim**-0.5, None, lens.view(batch, -1)
        )
        on = [x.to(device) for x in (seg.kcodes, seg.vcodes, seg.vzero, seg.vstep, seg.kzero, seg.kstep)]
        parts = kivi_decode.partials(
            q.to(device), *on, lens.to(device), groups.to(device), width, key_bits, value_bits, g, g,
            head_dim**-0.5,
        )  # fmt: skip
        got = ka.merge([parts], q.to(device), kv_heads)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


# --- compaction after an eviction --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_compaction_equals_its_reference(device):
    """Each row's kept slots move to its front in order, for every kind of field the rows hold
    (bf16 keys of head_dim 128, fp16 of 80, int64 positions, float32 state of 16 a slot, bool),
    rows keeping different numbers (a short row's slots up to the widest read zeros, the rest of
    the capacity untouched) or all the same, slot counts that are not multiples of the block."""
    _skip_without(device)
    gen = torch.Generator().manual_seed(0)
    fields = [
        ((6, 100, 128), torch.bfloat16),
        ((6, 70, 80), torch.float16),
        ((6, 130), torch.int64),
        ((6, 100, 16), torch.float32),
        ((4, 130), torch.bool),
    ]
    for (bh, slots, *rest), dtype in fields:
        values = (100 * torch.randn(bh, slots, *rest, generator=gen)).to(dtype)
        for keep in (
            torch.rand(bh, slots, generator=gen) < 0.6,  # ragged
            torch.arange(slots).expand(bh, slots) % 3 != 1,  # the same count in every row
        ):
            width = int(keep.sum(-1).max())
            want = torch.full((bh, slots + 7, *rest), 7).to(dtype)
            kc.compact_into_reference(values, keep, want, width)
            got = torch.full((bh, slots + 7, *rest), 7).to(dtype).to(device)
            kc.compact_into(values.to(device), keep.to(device), got, width)
            assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("scheduler", [H2OScheduler, AdaKVScheduler], ids=["h2o", "adakv"])
def test_evictions_compact_through_the_kernel(tiny_93, scheduler, monkeypatch):
    """An eviction's compaction runs through the kernel on the Triton path and moves the same
    tokens: after a prefill and decode steps, the stored bytes and positions are those of the torch
    path, and the keys too (H2O keeps the same count in every head, bit for bit; AdaKV keeps
    different ones, and its ragged steps' attention, a kernel's on this path, moves later tokens'
    keys within float tolerance)."""
    calls = []
    kernel = kc.compact_into
    monkeypatch.setattr(kc, "compact_into", lambda *a: calls.append(1) or kernel(*a))

    def run_on(path: str):
        with dispatch.using(path):
            stack = make_stack(tiny_93, scheduler=scheduler(), budget=0.5, window=8, sinks=2)
            return run_chunks(tiny_93, stack, tokens(60), [40] + [1] * 10)[1]

    want, got = run_on("torch"), run_on("triton")
    assert calls
    assert got.nbytes() == want.nbytes()
    for a, b in zip(got.stores, want.stores, strict=True):
        assert torch.equal(a.view().pos, b.view().pos)
        if scheduler is H2OScheduler:
            assert torch.equal(a.view().k, b.view().k)
        torch.testing.assert_close(a.view().k, b.view().k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_block_sparse_decode_reads_the_selected_pages(device):
    """A read selector's mask (Quest's pages of 16 tokens, one in eight chosen per head-row, plus
    the sinks and the window): the kernel loads only the chosen slots and skips blocks with none,
    and gives SDPA's attention over them."""
    _skip_without(device)
    gen = torch.Generator().manual_seed(1)
    b, hq, h, t, d, page = 2, 32, 8, 2100, 128, 16
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(b, hq, 1, d, generator=gen).to(dtype)
        k, v = (torch.randn(b, h, t, d, generator=gen).to(dtype) for _ in range(2))
        chosen = torch.rand(b, h, -(-t // page), generator=gen) < 1 / 8
        mask = chosen.repeat_interleave(page, -1)[..., :t, None].transpose(-1, -2).clone()  # (B, H, 1, T)
        mask[..., :4] = mask[..., -32:] = True  # the sinks and the window
        want = ka.attend_reference(q, k, v, mask, d**-0.5)
        got = ka.attend(q.to(device), k.to(device), v.to(device), mask.to(device), d**-0.5)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "b, hq, h, t, d, page, lo, hi, k, parts",
    [
        (2, 32, 8, 2100, 128, 16, 4, 2064, 17, 1),  # one page in eight, several splits
        (1, 9, 3, 300, 80, 16, 0, 288, 5, 1),  # no sinks, head_dim 80
        (1, 4, 1, 100, 64, 16, 60, 40, 3, 1),  # the sinks past hi: every slot is read, no page counts
        (1, 4, 2, 1000, 64, 8, 3, 960, 40, 1),  # pages cut by the sinks and by hi
        (2, 8, 2, 1000, 64, 988, 4, 992, 3, 8),  # a router's 8 blocks of 123.5 routed slots from lo
        (1, 9, 3, 300, 80, 37, 2, 39, 4, 16),  # 16 blocks of 37 / 16 slots: some of 2, some of 3
        (1, 4, 2, 700, 64, 3, 4, 7, 2, 8),  # fewer routed slots than blocks: empty blocks
    ],
)
def test_decode_by_pages_reads_the_pages_named(device, b, hq, h, t, d, page, lo, hi, k, parts):
    """A read selector's pages as indices (:class:`att.Pages`: Quest's pages of ``page`` slots
    from slot 0, or a position router's ``parts`` blocks splitting ``page`` slots from ``lo``;
    some unused): the grid covers the always-read slots and the pages named only, and gives SDPA's
    attention over the same slots as a mask."""
    _skip_without(device)
    gen = torch.Generator().manual_seed(2)
    start = 0 if parts == 1 else lo
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(b, hq, 1, d, generator=gen).to(dtype)
        key, value = (torch.randn(b, h, t, d, generator=gen).to(dtype) for _ in range(2))
        n = t // page if parts == 1 else parts
        index = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(b * h)])
        index = index.view(b, h, 1, k)
        index[..., -1:] = -1  # fewer pages chosen than room for
        pages = att.Pages(index, page, min(lo, hi), hi, start, parts)
        launch = ka.prepare(q, key, value, None, 1.0, pages=pages)
        ka.workspace(q.device, launch.out.acc.shape[-1]).give_back(launch.out)
        longest = -(-page // parts)
        assert launch.args[15] == pages.lo + t - hi + k * longest  # the slots the grid covers
        mask = pages.mask(t)
        if parts > 1:  # the blocks the mask reads are the routers' (rank r in block r parts // page)
            rank = torch.arange(t) - lo
            block = torch.where((rank >= 0) & (rank < hi - lo), rank * parts // page, -1)
            chosen = (block[None, None, None, :, None] == index[..., None, :]).any(-1)
            assert torch.equal(mask, chosen | (block < 0))
        want = ka.attend_reference(q, key, value, mask, d**-0.5)
        on = att.Pages(index.to(device), page, pages.lo, hi, start, parts)
        got = ka.attend(q.to(device), key.to(device), value.to(device), None, d**-0.5, pages=on)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "b, hq, h, t, d, lo, hi, experts, k",
    [
        (1, 4, 2, 100, 64, 4, 90, 8, 3),  # 8 experts of scattered slots, 2 chosen and one unused
        (2, 9, 3, 300, 80, 2, 280, 6, 3),  # GQA 9/3, several blocks and splits
        (1, 32, 8, 40, 128, 2, 34, 16, 4),  # more experts than routed slots: empty experts
    ],
)
def test_decode_by_listed_pages_reads_the_experts_named(device, b, hq, h, t, d, lo, hi, experts, k):
    """Pages that are sets of slots (a centroid router's experts, :attr:`att.Pages.order`: the
    routed slots listed expert by expert, the unassigned ones as page ``E``, always read): the
    grid covers the always-read slots and the routed ones at most, and the kernel gives SDPA's
    attention over the slots of the experts named, as their mask."""
    _skip_without(device)
    gen = torch.Generator().manual_seed(hi)
    n = hi - lo
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(b, hq, 1, d, generator=gen).to(dtype)
        key, value = (torch.randn(b, h, t, d, generator=gen).to(dtype) for _ in range(2))
        expert = torch.randint(0, experts + 1, (b, h, n), generator=gen)  # experts: not assigned
        held, order = expert.sort(dim=-1, stable=True)
        bounds = torch.searchsorted(held, torch.arange(experts + 2).expand(b, h, experts + 2).contiguous())
        index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(b * h)]).view(
            b, h, 1, k
        )
        index[..., -1:] = -1  # fewer experts chosen than room for
        index = torch.cat([index, torch.full((b, h, 1, 1), experts)], -1)
        pages = att.Pages(index, n, lo, hi, lo, experts + 1, order=order + lo, bounds=bounds)
        launch = ka.prepare(q, key, value, None, 1.0, pages=pages)
        ka.workspace(q.device, launch.out.acc.shape[-1]).give_back(launch.out)
        assert launch.args[15] == lo + t - hi + n  # the slots the grid covers
        mask = pages.mask(t)
        slot = torch.full((b, h, t), -2)
        slot[..., lo:hi] = expert
        read = (slot[:, :, None, :, None] == index[..., None, :]).any(-1) | (slot[:, :, None, :] == -2)
        assert torch.equal(mask, read)
        want = ka.attend_reference(q, key, value, mask, d**-0.5)
        on = att.Pages(
            index.to(device),
            n,
            lo,
            hi,
            lo,
            experts + 1,
            order=(order + lo).to(device),
            bounds=bounds.to(device),
        )
        got = ka.attend(q.to(device), key.to(device), value.to(device), None, d**-0.5, pages=on)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "role, technique",
    [
        ("scheduler", lambda: QuestScheduler(page_size=4, dense_layers=0)),
        ("router", lambda: BaseRouter(num_experts=8, top_k=2)),
        ("router", lambda: HierarchicalRouter(num_experts=8, num_groups=4, top_groups=2, top_k=3)),
        ("router", lambda: AdaptiveRouter(num_experts=6, k_min=1, k_max=3)),
        ("router", lambda: TopKBalancedRouter(num_experts=6, top_k=2)),
        ("router", lambda: PikvRouter(num_experts=5, top_k=2)),
        ("router", lambda: EPLBRouter(num_experts=6, top_k=3)),
    ],
    ids=["quest", "base", "hierarchical", "adaptive", "topk_balanced", "pikv", "eplb"],
)
def test_read_selectors_count_the_same_reads_by_pages_as_by_their_mask(tiny_93, role, technique, monkeypatch):
    """A read selector's figures (tokens and bytes read per query, page metadata, experts read)
    are the same whether a decode step reads by its mask (torch path) or by the pages or blocks
    it names (Triton path), every decode step of every layer reads by them, and the logits agree
    within float tolerance."""
    ids = tokens(70)
    paged, partials = [], ka.partials
    monkeypatch.setattr(
        ka, "partials", lambda *a: paged.append(len(a) > 8 and a[8] is not None) or partials(*a)
    )

    def figures(path: str):
        with dispatch.using(path):
            stack = make_stack(tiny_93, **{role: technique()}, budget=0.4, window=4, sinks=2)
            logits = run_chunks(tiny_93, stack, ids, [40] + [1] * 12)[0]
            return logits, getattr(stack, role).metrics()

    (want, torch_path), (got, by_pages) = figures("torch"), figures("triton")
    assert by_pages == torch_path
    assert sum(paged) == 12 * tiny_93.model.config.num_hidden_layers
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, queries, slots, head_dim, window",
    [
        (2, 9, 3, 1, 77, 64, None),  # one step, causal over shuffled original positions
        (1, 32, 8, 4, 130, 128, 37),  # a chunk under a sliding window
        (2, 9, 3, 3, 95, 80, 8),  # a narrow window, a padding query
    ],
)
def test_decode_attention_from_positions_equals_its_reference(
    device, batch, q_heads, kv_heads, queries, slots, head_dim, window
):
    """Causal and sliding-window reads computed in the kernel from the stored slots' original
    positions (in any order, as evictions leave them) and the queries' (-1: a padding query, which
    reads every slot) give SDPA's attention under :func:`read_mask`'s mask; the valid slots come as
    one mask row shared by every query (stride 0)."""
    _skip_without(device)
    gen = torch.Generator().manual_seed(slots)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        q = torch.randn(batch, q_heads, queries, head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(batch, kv_heads, slots, head_dim, generator=gen).to(dtype) for _ in range(2))
        kpos = torch.stack(
            [torch.randperm(slots + 9, generator=gen)[:slots] for _ in range(batch * kv_heads)]
        )
        kpos = kpos.view(batch, kv_heads, slots)
        qpos = torch.arange(slots + 9 - queries, slots + 9).expand(batch, -1).clone()
        qpos[-1, 0] = -1 if queries > 1 else qpos[-1, 0]
        valid = torch.rand(batch, kv_heads, 1, slots, generator=gen) < 0.9
        mask = valid.expand(-1, -1, queries, -1)
        want = ka.attend_reference(q, k, v, mask, head_dim**-0.5, positions=att.Positions(kpos, qpos, window))
        on = att.Positions(kpos.to(device), qpos.to(device), window)
        got = ka.attend(
            q.to(device), k.to(device), v.to(device), mask.to(device), head_dim**-0.5, positions=on
        )
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)
        # the reference's mask is read_mask's, padding queries reading every valid slot
        seen = att.read_mask(kpos, valid[:, :, 0], qpos, window) | (valid & (qpos < 0)[:, None, :, None])
        torch.testing.assert_close(want, ka.attend_reference(q, k, v, seen, head_dim**-0.5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, queries, pages, head_dim",
    [
        (1, 9, 3, 1, 5, 64),  # GQA 9/3, fewer pages than a block
        (2, 32, 8, 2, 70, 128),  # Llama-3.1-8B's heads, pages past two blocks
        (1, 4, 4, 1, 33, 80),  # one query head per KV head
        (1, 4, 2, 1, 0, 64),  # no full page yet
    ],
)
def test_block_scores_equal_their_references(device, batch, q_heads, kv_heads, queries, pages, head_dim):
    """Quest's page bounds (the query group's maximum of Σ max(q·min, q·max)) and the routers'
    expert scores ((Σ_g q_g)·c) from the scoring kernel equal their torch references, and a bound
    is at least every q·k of its page."""
    _skip_without(device)
    gen = torch.Generator().manual_seed(pages)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-4), (torch.float16, 1e-4)):
        q = torch.randn(batch, q_heads, queries, head_dim, generator=gen).to(dtype)
        keys = torch.randn(batch, kv_heads, pages, 16, head_dim, generator=gen).to(dtype)
        kmin, kmax = keys.amin(3), keys.amax(3)
        centroid = keys.float().mean(3).to(dtype)
        on = [x.to(device) for x in (q, kmin, kmax, centroid)]
        bound = ks.group_bounds(*on[:3]).cpu()
        assert bound.shape == (batch, kv_heads, queries, pages) and bound.dtype == torch.float32
        torch.testing.assert_close(bound, att.group_bounds(q, kmin, kmax), atol=tol, rtol=tol)
        score = ks.group_scores(on[0], on[3]).cpu()
        torch.testing.assert_close(score, att.group_scores(q, centroid), atol=tol, rtol=tol)
        qk = torch.einsum(
            "bhgqd,bhptd->bhgqpt", q.float().view(batch, kv_heads, -1, queries, head_dim), keys.float()
        )
        assert (bound[:, :, None, :, :] >= qk.amax(-1) - 1e-4).all()


def test_bench_kernels_runs_every_row_on_both_paths():
    """``scripts/bench_kernels.py --check`` runs each row's Triton kernels (under the interpreter)
    beside their torch paths, so the benchmark a GPU node runs has been run through once; without
    the interpreter, ``--check`` is refused in one line."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = [sys.executable, str(script), "--check", "--contexts", "128", "--batches", "1"]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    fixed, *rows = [line for line in out.splitlines() if "batch 1, 128 tokens" in line]
    names = [line.split()[0] for line in rows]
    assert names == [
        "kivi.quantize", "kivi.dequantize", "decode.masked", "decode.ragged", "decode.sparse1/8",
        "decode.pages1/8", "decode.blocks2/8", "decode.experts2/8", "decode.window", "score.quest",
        "decode.kivi2bit", "decode.latent", "decode.latent8bit", "decode.pruned", "decode.svd",
    ]  # fmt: skip
    assert all("torch " in line and "triton " in line for line in rows)
    # a decode call's fixed cost, end to end and stage by stage
    assert fixed.startswith("fixed cost") and all(f"{k} " in fixed for k in ("call", "launch", "merge"))
    env["TRITON_INTERPRET"] = "0"
    refused = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "--check needs TRITON_INTERPRET=1" in refused.stderr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, tokens_per_row, head_dim, ranks, rotated",
    [
        (1, 9, 3, 77, 64, (16, 24), 64),  # GQA 9/3, ranks off the powers of two
        (2, 32, 8, 130, 128, (32, 32), 128),  # Llama-3.1-8B's heads, a batch
        (1, 4, 2, 50, 80, (8, 16), 32),  # head_dim 80, partial rotary: the rest passes through
        (1, 4, 2, 2100, 64, (16, 16), 64),  # several splits, merged by their log-sum-exp
    ],
)
def test_latent_decode_equals_rebuild_then_attention(
    device, batch, q_heads, kv_heads, tokens_per_row, head_dim, ranks, rotated
):
    """The fused latent decode (keys rebuilt and rotated in registers, values kept latent until
    one product with their basis) gives what rebuilding every key and value and SDPA give, with
    RoPE's attention scaling, in float32, bfloat16 and float16."""
    _skip_without(device)
    gen = torch.Generator().manual_seed(tokens_per_row)
    rk, rv = ranks
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, rotated, 2).float() / rotated)), 1.25)
    n = batch * kv_heads * tokens_per_row
    lens = torch.full((batch * kv_heads,), tokens_per_row)
    pos = torch.randperm(3 * tokens_per_row, generator=gen)[:tokens_per_row].repeat(batch * kv_heads)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        q = torch.randn(batch, q_heads, 1, head_dim, generator=gen).to(dtype)
        klat, vlat = (torch.randn(n, r, generator=gen).to(dtype) for r in ranks)
        kbasis = (torch.randn(kv_heads, head_dim, rk, generator=gen) / rk**0.5).to(dtype)
        vbasis = (torch.randn(kv_heads, head_dim, rv, generator=gen) / rv**0.5).to(dtype)
        args = (klat, vlat, pos, kbasis, vbasis, rotary, lens)
        want = latent_decode.attend_reference(q, *args, head_dim**-0.5)
        on = [x.to(device) if isinstance(x, torch.Tensor) else x for x in args]
        parts = latent_decode.partials(q.to(device), *on, tokens_per_row, head_dim**-0.5)
        got = ka.merge([parts], q.to(device), kv_heads)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)
        # a packed segment's rows, read in place (head-rows further apart than their tokens)
        packed = [in_packed_rows(x, batch * kv_heads) for x in on[:3]]
        parts = latent_decode.partials(
            q.to(device), *packed, *on[3:], tokens_per_row, head_dim**-0.5, per_row=True
        )
        assert torch.equal(ka.merge([parts], q.to(device), kv_heads), got)
