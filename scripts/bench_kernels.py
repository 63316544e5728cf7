"""The cache's Triton kernels against their torch paths and dense bf16 SDPA, side by side in one run
(issue 14; docs/kernels.md), on Llama-3.1-8B's attention shapes: 32 query / 8 KV heads, head_dim
128, at 4k, 32k and 128k stored tokens, batch 1 and 8.

For each kernel: its time (``triton.testing.do_bench``, median), the torch path's, dense bf16 SDPA
over the full cache (one decode step), and the memory it moves as a share of the device's peak
bandwidth (the data sheet's for an H100 or H200; else the bandwidth of a device copy measured
here, said so).

- ``kivi.quantize``: keys and values of every token to 2 bits, packed (reads bf16, writes codes).
- ``kivi.dequantize``: the 2-bit cache back to bf16.
- ``decode.masked``: one decode step over a cache whose KV heads keep half their tokens (a ragged
  mask), against the torch path (SDPA with the mask repeated over the query group) and dense SDPA
  over every token.
- ``decode.ragged``: the same ragged heads read by their lengths (AdaKV's and DuoAttention's rows):
  the kernel reads no mask and no slot past a head-row's tokens, against the torch path (padded,
  masked SDPA) and dense SDPA over every slot.
- ``decode.sparse1/8``: one decode step reading one page in eight (Quest's pages of 16 tokens,
  and the window), against the torch path (SDPA with the mask) and dense SDPA over every token.
- ``decode.pages1/8``: the same step with the pages named by index (:class:`att.Pages`, as Quest
  hands them on the Triton path): the kernel's grid covers the named pages and the window only,
  against the torch path (SDPA with the mask) and dense SDPA over every token.
- ``decode.window``: one decode step under a sliding window of 4,096 tokens (Mistral's), the
  window computed in the kernel from the stored positions, against the torch path (SDPA with the
  mask built from the positions) and dense SDPA over every token.
- ``score.quest``: Quest's page bounds for one decode step (pages of 16 tokens, the query group's
  maximum), against the torch path (two matmuls).
- ``decode.latent``: one decode step over low-rank latents (``lora``: rank 32 keys and values on
  per-head bases), keys rebuilt and rotated in registers and values kept latent, against the torch
  path (rebuild every key and value, then SDPA) and bf16 SDPA over the full cache.
- ``decode.latent8bit``: the same step over ``lora_plus_plus``'s quantized latents (its defaults:
  rank 16 keys, rank 32 values, 8-bit codes with a float16 zero and step per token and latent),
  the codes dequantized in registers, against the torch path (dequantize the latents, rebuild every
  key and value, then SDPA) and bf16 SDPA over the full cache.
- ``decode.kivi2bit``: one decode step over a 2-bit KIVI cache, codes dequantized in registers,
  against the torch path (dequantize, then SDPA) and bf16 SDPA over the full cache.
- ``decode.blocks2/8``: a position router's step (``router=base``): 8 blocks split the routed
  slots, each query reads 2, named by index (:class:`att.Pages` with ``parts``), against the torch
  path (SDPA with the mask) and dense SDPA over every token.
- ``decode.experts2/8``: a centroid router's step (``router=topk_balanced``, ``pikv``, ``eplb``): 8
  experts of scattered slots, each query reads 2; the Triton path lists the routed slots expert by
  expert (:class:`att.Pages` with ``order``, one sort, timed with the step) and reads the chosen
  experts' only, against the torch path (the mask gathered from each slot's expert, then SDPA) and
  dense SDPA over every token.
- ``decode.pruned``: one decode step over ThinK's pruned keys (half the key channels kept), the
  query's kept channels read in the kernel, against the torch path (keys rebuilt with zeros, then
  SDPA) and bf16 SDPA over the full cache.
- ``decode.svd``: one decode step over SVD's per-block factors (``compressor=svd``'s ranks and
  blocks), keys rebuilt and rotated in registers, against the torch path (rebuild every key and
  value, then SDPA) and bf16 SDPA over the full cache.

On a CPU there are no Triton figures: the script times the torch paths at the smaller contexts and
says that GPU figures need a GPU.

``--table src/kvbench/kernels/dispatch_table.json`` (on a GPU) writes the torch/triton ratio of every row, per
batch and context, as this GPU's entry of the table ``kernels=auto`` reads, with the commit, date,
torch and Triton versions and this command (docs/kernels.md, "Which path kernels=auto takes").

    python scripts/bench_kernels.py [--contexts 4096,32768,131072] [--batches 1,8] [--table PATH]
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --check --contexts 128 --batches 1
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from kvbench.cache import attention as att
from kvbench.cache import quant
from kvbench.cache.rotary import Rotary
from kvbench.compressors.quantized import quantize_tokens
from kvbench.kernels import dispatch, kivi_decode, latent_decode, pruned_decode, svd_decode

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
REPEATS = 5  # timed calls per figure on a CPU (--check: 1)
PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}  # HBM, data sheets (SXM)
ROOT = Path(__file__).resolve().parents[1]
RATIOS: dict[str, dict[str, dict[str, float]]] = {}  # row -> batch -> stored tokens -> torch / triton time


def bench(fn, cuda: bool) -> float:
    """Median milliseconds of ``fn`` (on a CPU, of ``REPEATS`` calls after one warm-up)."""
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def peak_gbps(device: torch.device) -> tuple[float, str]:
    name = torch.cuda.get_device_name(device)
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps, f"{name}, data sheet {gbps:.0f} GB/s"
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    ms = bench(lambda: x.clone(), True)
    gbps = 2 * x.numel() / ms / 1e6
    return gbps, f"{name}, a device copy measured here {gbps:.0f} GB/s"


def row(label: str, ms: dict[str, float], moved: int | None, peak: float | None) -> str:
    cells = [f"{k} {v:.3f} ms" for k, v in ms.items()]
    if "triton" in ms:
        cells += [f"torch/triton {ms['torch'] / ms['triton']:.2f}x"]
        if "sdpa" in ms:
            cells += [f"sdpa/triton {ms['sdpa'] / ms['triton']:.2f}x"]
        if moved is not None and peak:
            cells += [f"{moved / ms['triton'] / 1e6 / peak:.0%} of peak bandwidth"]
    return f"{label:38s} " + ", ".join(cells)


def show(name: str, batch: int, t: int, ms: dict[str, float], moved: int | None, peak: float | None) -> None:
    """Print one row's figures at ``batch`` and ``t`` stored tokens, and keep its torch/triton ratio
    for ``--table`` (:data:`RATIOS`)."""
    print(row(f"{name:<19s}batch {batch}, {t} tokens", ms, moved, peak))
    if "triton" in ms:
        RATIOS.setdefault(name, {}).setdefault(str(batch), {})[str(t)] = round(ms["torch"] / ms["triton"], 3)


def case(
    batch: int, t: int, device: torch.device, gen: torch.Generator, peak: float | None, check: bool = False
) -> None:
    """The kernels at one batch size and context, each beside its torch path (``check``: the Triton
    rows under the interpreter, once each, to check the script)."""
    cuda = device.type == "cuda"
    kernels = None
    if cuda or check:
        from kvbench.kernels import attention, kivi, scoring

        kernels = (kivi, attention, scoring)
    k = torch.randn(batch * KV_HEADS * t, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    moved = 2 * k.numel() * 2 + 2 * k.numel() // 4  # bf16 keys and values, 2-bit codes
    paths = {"torch": quant, **({"triton": kernels[0]} if kernels else {})}
    ms = {
        n: bench(lambda ops=ops: (ops.quantize_keys(k, 2, 32), ops.quantize_values(k, 2, 32)), cuda)
        for n, ops in paths.items()
    }
    show("kivi.quantize", batch, t, ms, moved, peak)
    keys, values = quant.quantize_keys(k, 2, 32), quant.quantize_values(k, 2, 32)

    def dequant(ops) -> None:
        ops.dequantize_keys(*keys, 2, torch.bfloat16, per_group=32)
        ops.dequantize_values(*values, 2, HEAD_DIM, 32, torch.bfloat16)

    ms = {n: bench(lambda ops=ops: dequant(ops), cuda) for n, ops in paths.items()}
    show("kivi.dequantize", batch, t, ms, moved, peak)
    kv = k.view(batch, KV_HEADS, t, HEAD_DIM)  # keys and values alike: the time is the same
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    lens = torch.randint(t // 4, 3 * t // 4 + 1, (batch, KV_HEADS, 1, 1), generator=gen, device=device)
    mask = torch.arange(t, device=device) < lens  # ragged heads: about half the slots each
    scale = HEAD_DIM**-0.5
    sdpa = bench(lambda: F.scaled_dot_product_attention(q, kv, kv, scale=scale, enable_gqa=True), cuda)
    ms = {"torch": bench(lambda: att.attend(q, kv, kv, mask, scale), cuda), "sdpa": sdpa}
    if kernels:
        ms["triton"] = bench(lambda: kernels[1].attend(q, kv, kv, mask, scale), cuda)
    moved = 2 * kv.numel() * 2 + mask.numel()  # every slot's key and value (bf16) and the mask
    show("decode.masked", batch, t, ms, moved, peak)
    # the same ragged heads read by their lengths (AdaKV's, DuoAttention's rows): no mask, and no
    # slot past a head-row's tokens, against the torch path's padded, masked SDPA
    ms = {"torch": bench(lambda: att.attend(q, kv, kv, mask, scale), cuda), "sdpa": sdpa}
    held = lens.view(batch, KV_HEADS)
    if kernels:
        ms["triton"] = bench(lambda: kernels[1].attend(q, kv, kv, None, scale, lens=held), cuda)
    moved = 2 * int(held.sum()) * HEAD_DIM * 2  # the tokens held (bf16 keys and values)
    show("decode.ragged", batch, t, ms, moved, peak)
    # a read selector's step: Quest's pages of 16 tokens, one in eight read (and the window)
    pages = torch.rand(batch, KV_HEADS, t // 16, generator=gen, device=device) < 1 / 8
    sparse = pages.repeat_interleave(16, -1)[..., None, :]
    sparse[..., -32:] = True
    ms = {"torch": bench(lambda: att.attend(q, kv, kv, sparse, scale), cuda), "sdpa": sdpa}
    if kernels:
        ms["triton"] = bench(lambda: kernels[1].attend(q, kv, kv, sparse, scale), cuda)
    read = int(sparse.sum()) * HEAD_DIM * 2 * 2 + sparse.numel()  # the pages read (bf16) and the mask
    show("decode.sparse1/8", batch, t, ms, read, peak)
    # the same selector's step as the pages it names: the grid covers those pages and the window
    chosen = max(1, t // 16 // 8)
    index = torch.rand(batch, KV_HEADS, 1, t // 16, generator=gen, device=device).argsort(-1)[..., :chosen]
    named = att.Pages(index, 16, 0, t - 32)
    ms = {"torch": bench(lambda: att.attend(q, kv, kv, named.mask(t), scale), cuda), "sdpa": sdpa}
    if kernels:
        ms["triton"] = bench(lambda: kernels[1].attend(q, kv, kv, None, scale, pages=named), cuda)
    read = batch * KV_HEADS * (chosen * 16 + 32) * HEAD_DIM * 2 * 2 + index.numel() * 8  # pages, index
    show("decode.pages1/8", batch, t, ms, read, peak)
    # a position router's step (router=base): 8 blocks split the routed slots (all but 4 sinks and
    # the window of 32), each query reads 2 of them, named by index (att.Pages with parts)
    lo, hi = 4, t - 32
    index = torch.rand(batch, KV_HEADS, 1, 8, generator=gen, device=device).argsort(-1)[..., :2]
    blocks = att.Pages(index, hi - lo, lo, hi, start=lo, parts=8)
    ms = {"torch": bench(lambda: att.attend(q, kv, kv, blocks.mask(t), scale), cuda), "sdpa": sdpa}
    if kernels:
        ms["triton"] = bench(lambda: kernels[1].attend(q, kv, kv, None, scale, pages=blocks), cuda)
    read = batch * KV_HEADS * (2 * (hi - lo) // 8 + t - hi + lo) * HEAD_DIM * 2 * 2  # blocks, the rest
    show("decode.blocks2/8", batch, t, ms, read, peak)
    # a centroid router's step (router=topk_balanced, pikv, eplb): 8 experts of scattered slots, each
    # query reads 2; the torch path builds the mask from each slot's expert (Routing.mask), the
    # Triton path lists the routed slots expert by expert (one sort) and reads the 2 experts' only
    expert = torch.randint(0, 8, (batch, KV_HEADS, hi - lo), generator=gen, device=device)
    column = F.pad(expert, (lo, t - hi), value=8)[:, :, None, :]  # 8: always read
    chosen2 = torch.zeros(batch, KV_HEADS, 1, 8, dtype=torch.bool, device=device)
    chosen2.scatter_(-1, index, True)
    ids = torch.arange(10, device=device)

    def by_mask() -> torch.Tensor:
        read = F.pad(chosen2, (0, 1), value=True).gather(-1, column)
        return att.attend(q, kv, kv, read, scale)

    def listed() -> att.Pages:
        held, order = column[:, :, 0, lo:hi].sort(dim=-1, stable=True)
        bounds = torch.searchsorted(held, ids.expand(batch, KV_HEADS, 10).contiguous())
        first = torch.cat([index, torch.full_like(index[..., :1], 8)], -1)
        return att.Pages(first, hi - lo, lo, hi, lo, 9, order=order.add_(lo), bounds=bounds)

    ms = {"torch": bench(by_mask, cuda), "sdpa": sdpa}
    if kernels:
        ms["triton"] = bench(lambda: kernels[1].attend(q, kv, kv, None, scale, pages=listed()), cuda)
    read = batch * KV_HEADS * (2 * (hi - lo) // 8 + t - hi + lo) * HEAD_DIM * 2 * 2  # experts, the rest
    show("decode.experts2/8", batch, t, ms, read + expert.numel() * 8, peak)
    # a sliding window of 4,096 tokens: what a step reads comes from the positions
    kpos = torch.arange(t, device=device).expand(batch, KV_HEADS, t)
    at = att.Positions(kpos, torch.full((batch, 1), t, device=device), 4096)
    valid = torch.ones(batch, KV_HEADS, 1, t, dtype=torch.bool, device=device)
    ms = {
        "torch": bench(lambda: att.attend(q, kv, kv, at.mask() & valid, scale), cuda),
        "sdpa": sdpa,
    }
    if kernels:
        ms["triton"] = bench(lambda: kernels[1].attend(q, kv, kv, valid, scale, positions=at), cuda)
    read = batch * KV_HEADS * min(t, 4096) * HEAD_DIM * 2 * 2 + kpos.numel() * 8  # the window, positions
    show("decode.window", batch, t, ms, read, peak)
    # Quest's page bounds for the step: per-channel minimum and maximum of every page of 16 tokens
    kmin = kv.view(batch, KV_HEADS, t // 16, 16, HEAD_DIM).amin(3)
    kmax = kv.view(batch, KV_HEADS, t // 16, 16, HEAD_DIM).amax(3)
    ms = {"torch": bench(lambda: att.group_bounds(q, kmin, kmax), cuda)}
    if kernels:
        ms["triton"] = bench(lambda: kernels[2].group_bounds(q, kmin, kmax), cuda)
    show("score.quest", batch, t, ms, 2 * kmin.numel() * 2, peak)
    lens = torch.full((batch * KV_HEADS,), t, device=device)
    seg = quantize_tokens(k, k, torch.arange(k.shape[0], device=device), lens, 2, 2, 32)
    packed = (seg.kcodes, seg.vcodes, seg.vzero, seg.vstep, seg.kzero, seg.kstep)
    ms = {
        "torch": bench(lambda: kivi_decode.attend_reference(q, *packed, lens, 2, 2, 32, 32, scale), cuda),
        "sdpa": sdpa,  # bf16 over the full cache, as above
    }
    if kernels:

        def fused() -> None:
            parts = kivi_decode.partials(q, *packed, lens, seg.glens, t, 2, 2, 32, 32, scale)
            kernels[1].merge([parts], q, KV_HEADS)

        ms["triton"] = bench(fused, cuda)
    moved = sum(x.numel() * x.element_size() for x in packed)  # the codes and their parameters
    show("decode.kivi2bit", batch, t, ms, moved, peak)
    # low-rank latents at rank 32 (lora): every token's key and value latent, bases per KV head
    rotary = Rotary(1.0 / (500000 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM)))
    klat, vlat = (k[:, :32].contiguous() for _ in range(2))
    bases = [
        torch.randn(KV_HEADS, HEAD_DIM, 32, generator=gen, device=device).to(torch.bfloat16) for _ in range(2)
    ]
    positions = torch.arange(t, device=device).repeat(batch * KV_HEADS)
    latent = (klat, vlat, positions, *bases, rotary, lens)
    ms = {"torch": bench(lambda: latent_decode.attend_reference(q, *latent, scale), cuda), "sdpa": sdpa}
    if kernels:

        def fused_latent() -> None:
            kernels[1].merge([latent_decode.partials(q, *latent, t, scale)], q, KV_HEADS)

        ms["triton"] = bench(fused_latent, cuda)
    moved = 2 * klat.numel() * 2 + positions.numel() * 8  # the latents (bf16) and positions
    show("decode.latent", batch, t, ms, moved, peak)
    # lora_plus_plus's defaults: keys at rank 16, values at rank 32, each token's latents as 8-bit
    # codes with a float16 zero and step (the bases above, the keys' cut to rank 16)
    qbits, qrk = 8, 16
    (kc, kz, ks), (vc, vz, vs) = (quant.quantize(k[:, :r], qbits, dim=-1) for r in (qrk, 32))
    coded = (quant.pack(kc, qbits), quant.pack(vc, qbits), positions, bases[0][..., :qrk].contiguous())
    coded += (bases[1], rotary, lens)
    params = (kz, ks, vz, vs)
    ms = {
        "torch": bench(lambda: latent_decode.attend_reference(q, *coded, scale, qbits, params), cuda),
        "sdpa": sdpa,
    }
    if kernels:

        def fused_coded() -> None:
            kernels[1].merge([latent_decode.partials(q, *coded, t, scale, qbits, params)], q, KV_HEADS)

        ms["triton"] = bench(fused_coded, cuda)
    moved = sum(x.numel() * x.element_size() for x in (*coded[:3], *params))  # codes, parameters, positions
    show("decode.latent8bit", batch, t, ms, moved, peak)
    # ThinK's pruned keys: half the key channels of every head-row kept (64 of 128), values whole
    keep = HEAD_DIM // 2
    picks = [torch.randperm(HEAD_DIM, generator=gen)[:keep].sort().values for _ in range(batch * KV_HEADS)]
    channels = torch.stack(picks).to(device=device, dtype=torch.int16)
    pruned = (k[:, :keep].contiguous(), k, channels, lens)
    ms = {"torch": bench(lambda: pruned_decode.attend_reference(q, *pruned, scale), cuda), "sdpa": sdpa}
    if kernels:

        def fused_pruned() -> None:
            kernels[1].merge([pruned_decode.partials(q, *pruned, t, scale)], q, KV_HEADS)

        ms["triton"] = bench(fused_pruned, cuda)
    moved = (keep + HEAD_DIM) * k.shape[0] * 2  # the kept key channels and the values (bf16)
    show("decode.pruned", batch, t, ms, moved, peak)
    # SVD's per-block factors (compressor=svd's defaults): keys at rank 16, values at rank 32,
    # blocks of 64 tokens with their own bases
    block, rk, rv = 64, 16, 32
    m = k.shape[0] // block
    factors = (k[:, :rk].contiguous(), k[:, :rv].contiguous(), positions)
    svd_bases = [torch.randn(m, HEAD_DIM, r, generator=gen, device=device).bfloat16() for r in (rk, rv)]
    svd = (*factors, *svd_bases, rotary, KV_HEADS, block)
    ms = {"torch": bench(lambda: svd_decode.attend_reference(q, *svd, scale), cuda), "sdpa": sdpa}
    if kernels:

        def fused_svd() -> None:
            kernels[1].merge([svd_decode.partials(q, *svd, scale)], q, KV_HEADS)

        ms["triton"] = bench(fused_svd, cuda)
    moved = k.shape[0] * (rk + rv) * 2 + sum(x.numel() for x in svd_bases) * 2  # factors, bases (bf16)
    show("decode.svd", batch, t, ms, moved, peak)


def host_ms(fn, calls: int = 2000) -> float:
    """Milliseconds a call of ``fn`` takes on the host: the best of 5 means over ``calls`` calls."""
    import timeit

    return 1e3 * min(timeit.repeat(fn, number=calls, repeat=5)) / calls


FIXED_TOKENS = 4096  # the fixed cost's context: short enough that reading the cache costs little
FIXED_TARGET_US = 30.0  # issue 30: a decode kernel call at batch 1 and 4k tokens, end to end


def fixed_cost(
    device: torch.device, gen: torch.Generator, t: int = FIXED_TOKENS, check: bool = False
) -> None:
    """Where a decode kernel call's time goes at batch 1 and ``t`` tokens (ragged
    heads read by their lengths): the call end to end (:func:`attention.attend`), and the variants
    that leave a stage out: the arguments and workspace alone (``prepare``), the launch alone (its
    arguments made), the merge alone (its partials written), against dense SDPA over every slot."""
    from kvbench.kernels import attention

    cuda = device.type == "cuda"
    kv = torch.randn(1, KV_HEADS, t, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    q = torch.randn(1, Q_HEADS, 1, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    lens = torch.randint(t // 4, 3 * t // 4 + 1, (1, KV_HEADS), generator=gen, device=device)
    scale = HEAD_DIM**-0.5
    room = attention.workspace(device, attention.blocks(q, KV_HEADS)[1])

    def made() -> attention.Launch:
        launch = attention.prepare(q, kv, kv, None, scale, lens=lens)
        room.give_back(launch.out)  # taken and given back: the room is reused, as merge does
        return launch

    launch, kernel = made(), attention._decode_kernel
    parts = attention.partials(q, kv, kv, None, scale, lens=lens)
    ms = {
        "call": bench(lambda: attention.attend(q, kv, kv, None, scale, lens=lens), cuda),
        # the host's work alone: on a CPU too, over many calls (what the interpreter leaves meaningful)
        "prepare": bench(made, cuda) if cuda else host_ms(made),
        "launch": bench(lambda: kernel[launch.grid](*launch.args, **launch.constants), cuda),
        "merge": bench(lambda: attention.merge([parts], q, KV_HEADS), cuda),
        "sdpa": bench(lambda: F.scaled_dot_product_attention(q, kv, kv, scale=scale, enable_gqa=True), cuda),
    }
    cells = ", ".join(f"{k} {1e3 * v:.1f} us" for k, v in ms.items())
    verdict = "" if check else f" (target: call at most {FIXED_TARGET_US:.0f} us)"
    print(f"{'fixed cost':19s}batch 1, {t} tokens    {cells}{verdict}")


def commit() -> str:
    """This checkout's short commit (``unknown`` outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def write_table(path: Path, device: torch.device) -> None:
    """Write (or replace) this GPU's entry of the dispatch table at ``path`` from :data:`RATIOS`,
    with where and when they were measured; other GPUs' entries stay. A new file takes the shipped
    table's module map (:mod:`kvbench.kernels.dispatch`)."""
    import triton

    shipped = dispatch.table()
    table = json.loads(path.read_text()) if path.exists() else {k: shipped[k] for k in ("about", "modules")}
    name = torch.cuda.get_device_name(device)
    table.setdefault("devices", {})[name] = {
        "commit": commit(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": "python " + shlex.join(sys.argv),
        "versions": dict(dispatch.VERSIONS),
        "ratios": RATIOS,
    }
    path.write_text(dispatch.dumps(table) + "\n")
    print(f"bench_kernels: wrote {name}'s entry ({len(RATIOS)} rows) to {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--contexts", default=None, help="stored tokens (default 4096,32768,131072; CPU 1024,4096)"
    )
    ap.add_argument("--batches", default="1,8")
    ap.add_argument(
        "--check",
        action="store_true",
        help="on a CPU: the Triton rows under TRITON_INTERPRET=1, to check this script (times mean nothing)",
    )
    ap.add_argument(
        "--table",
        type=Path,
        default=None,
        help="on a GPU: write this GPU's ratios into the dispatch table at this path "
        "(src/kvbench/kernels/dispatch_table.json: what kernels=auto reads)",
    )
    args = ap.parse_args()
    if args.check and not dispatch.interpreted():
        ap.error("--check needs TRITON_INTERPRET=1 in the environment")
    global REPEATS
    REPEATS = 1 if args.check else REPEATS
    cuda = torch.cuda.is_available()
    if args.table is not None and not cuda:
        sys.exit("bench_kernels: --table needs CUDA: a CPU has no Triton timings to fill the table with")
    device = torch.device("cuda" if cuda else "cpu")
    contexts = [int(c) for c in (args.contexts or ("4096,32768,131072" if cuda else "1024,4096")).split(",")]
    peak = None
    if cuda:
        peak, where = peak_gbps(device)
        print(f"bench_kernels: {where}")
    elif args.check:
        print("bench_kernels: --check: Triton under its interpreter on the CPU; the times mean nothing")
    else:
        print("bench_kernels: no CUDA here: the torch paths alone (Triton figures need a GPU)")
    gen = torch.Generator(device=device).manual_seed(0)
    if cuda or args.check:
        checking = args.check and not cuda  # the interpreter: the smallest context, to check the script
        fixed_cost(device, gen, contexts[0] if checking else FIXED_TOKENS, check=checking)
    for batch in (int(b) for b in args.batches.split(",")):
        for t in contexts:
            case(batch, t, device, gen, peak, check=args.check and not cuda)
    if args.table is not None:
        write_table(args.table, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
