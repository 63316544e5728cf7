"""kvpress's prefill and decode times for the presses kvbench also has, for ``gpu_check.py --kvpress``.

kvpress (NVIDIA's library of KV-cache "presses", https://github.com/NVIDIA/kvpress) compresses
transformers' own cache once, at the end of the prefill, from forward hooks. This script times it
on the model ``gpu_check.py``'s memory part times kvbench on: random weights with Llama-3.1-8B's
shapes (``--layers`` of its layers, bf16), a prefill of each of ``--contexts`` tokens and
``--steps`` greedy decode steps, batch 1. Rows:

- ``none``: transformers' ``DynamicCache`` with SDPA and no press (kvpress's own baseline);
- ``snapkv``: ``SnapKVPress``; ``streaming_llm``: ``StreamingLLMPress``; ``adakv``:
  ``AdaKVPress(SnapKVPress)``, all at ``compression_ratio`` 0.5 (kvbench's budget 0.5) with
  kvpress's defaults otherwise;
- ``h2o``: ``ObservedAttentionPress`` (eager attention, which writes every layer's full attention
  matrix: skipped where that matrix would not fit, ``--eager-max-gb``).

It imports transformers and kvpress only, never kvbench: kvpress 0.5 needs transformers below 5.3
and kvbench 5.23 or later, so each runs in its own environment. It writes one JSON file
(``--out``) that ``gpu_check.py --kvpress FILE`` prints beside kvbench's rows of the same cells:

    PYTHONPATH=<kvpress environment> python scripts/bench_kvpress.py --out /tmp/kvpress.json
    python scripts/gpu_check.py --only memory --kvpress /tmp/kvpress.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

SHAPED_8B = dict(  # Llama-3.1-8B's shapes (gpu_check.py's memory part imports them from here)
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)


def presses(ratio: float) -> dict:
    """Each row's press (None: no press) and the attention it needs."""
    import kvpress

    return {
        "none": (None, "sdpa"),
        "snapkv": (kvpress.SnapKVPress(compression_ratio=ratio), "sdpa"),
        "streaming_llm": (kvpress.StreamingLLMPress(compression_ratio=ratio), "sdpa"),
        "h2o": (kvpress.ObservedAttentionPress(compression_ratio=ratio), "eager"),
        "adakv": (kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio)), "sdpa"),
    }


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def one_row(model, press, ids: torch.Tensor, n: int, steps: int, device: str) -> dict:
    """Prefill ``n`` tokens under ``press``, then ``steps`` greedy decode steps; seconds and peak memory."""
    cache = transformers.DynamicCache(config=model.config)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        sync(device)
        start = time.perf_counter()
        if press is None:
            out = model(input_ids=ids[:, :n], past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            with press(model):
                out = model(input_ids=ids[:, :n], past_key_values=cache, use_cache=True, logits_to_keep=1)
        sync(device)
        prefill = time.perf_counter() - start
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            sync(device)
            times.append(time.perf_counter() - start)
    kept = cache.layers[0].keys.shape[-2]
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    del cache
    return {
        "prefill_s": prefill,
        "tpot_ms": 1000 * sum(times[1:]) / max(1, len(times) - 1),  # the first step warms up
        "total_s": prefill + sum(times),
        "kept_tokens_layer0": int(kept),
        "peak_allocated_mb": peak,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--contexts", default="32768,8192")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--ratio", type=float, default=0.5, help="kvpress's compression_ratio (kvbench budget 0.5)"
    )
    ap.add_argument("--eager-max-gb", type=float, default=40.0, help="largest eager attention matrix to run")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result: dict = {"transformers": transformers.__version__, "torch": torch.__version__, "rows": {}}
    try:
        import kvpress
    except Exception as e:  # reported, not hidden: the JSON says why no row was timed
        result["error"] = f"kvpress not importable: {type(e).__name__}: {e}"
        print(result["error"])
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 0
    result["kvpress"] = getattr(kvpress, "__version__", None) or _dist_version("kvpress")
    result["device"] = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPED_8B, num_hidden_layers=args.layers)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    heads, dtype_bytes = (
        SHAPED_8B["num_attention_heads"],
        2 + 4,
    )  # eager: the scores and their float32 softmax
    print(
        f"kvpress {result['kvpress']} (transformers {transformers.__version__}) on {result['device']}, "
        f"{args.layers} layers, ratio {args.ratio}"
    )
    print(f"{'press':16s} {'context':>7s} {'prefill s':>9s} {'TPOT ms':>8s} {'total s':>8s} {'kept':>6s}")
    for n in [int(c) for c in args.contexts.split(",")]:
        ids = torch.randint(
            0, SHAPED_8B["vocab_size"], (1, n + 1), generator=torch.Generator().manual_seed(n)
        )
        ids = ids.to(args.device)
        for name, (press, attn) in presses(args.ratio).items():
            key = f"{name}@{n}"
            if attn == "eager" and heads * n * n * dtype_bytes / 1e9 > args.eager_max_gb:
                result["rows"][key] = {
                    "skipped": f"eager attention at {n} tokens exceeds {args.eager_max_gb} GB"
                }
                print(f"{name:16s} {n:7d} skipped: {result['rows'][key]['skipped']}", flush=True)
                continue
            model.set_attn_implementation(attn)
            try:
                row = one_row(model, press, ids, n, args.steps, args.device)
            except Exception as e:  # one press failing is a row that says so, not a lost run
                row = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(f"{name:16s} {n:7d} error: {row['error']}", flush=True)
            else:
                print(
                    f"{name:16s} {n:7d} {row['prefill_s']:9.3f} {row['tpot_ms']:8.1f} {row['total_s']:8.3f} "
                    f"{row['kept_tokens_layer0']:6d}",
                    flush=True,
                )
            result["rows"][key] = row
            if args.device == "cuda":
                torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
