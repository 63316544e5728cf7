"""Every technique on CUDA against the CPU path, on a tiny random model (9/3 GQA, 3 layers).

For each technique YAML: run alone at a tight budget in float32 on CPU and on CUDA and compare the
logits; run in bfloat16 on CUDA (finite, bytes counted) and as a padded batch of two sequences on
CUDA against one-by-one runs. Prints one line per technique and exits non-zero on a failure.

    python scripts/gpu_check.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvbench import models  # noqa: E402
from kvbench.eval import loop  # noqa: E402
from kvbench.roles import BindContext, Budget  # noqa: E402
from kvbench.stack import Stack, build_technique  # noqa: E402

ROLES = ("router", "compressor", "scheduler")
TINY = {
    "name": "tiny_gpu_check",
    "source": "tiny",
    "family": "llama",
    "seed": 0,
    "device_map": None,
    "description": "gpu check",
    "config": dict(
        vocab_size=256,
        hidden_size=144,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
    ),
}


def technique(role: str, name: str):
    node = OmegaConf.load(ROOT / "conf" / role / f"{name}.yaml")
    if name == "fastv":
        node.layer = 1
    return build_technique(node, role)


def run(lm, role, name, ids, budget, batch=None):
    stack = Stack(**{role: technique(role, name)}, budget=budget)
    stack.bind(BindContext.for_model(lm))
    cache = loop.new_cache(lm, stack, batch=1 if batch is None else 2)
    if batch is None:
        outs = [loop.step(lm, cache, ids[:200])]
        for i in range(200, len(ids), 8):
            outs.append(loop.step(lm, cache, ids[i : i + 8]))
        return torch.cat(outs), cache
    a, b = batch
    ids2 = torch.zeros(2, len(a), dtype=torch.long)
    real = torch.zeros(2, len(a), dtype=torch.bool)
    ids2[0], real[0] = torch.tensor(a), True
    ids2[1, len(a) - len(b) :], real[1, len(a) - len(b) :] = torch.tensor(b), True
    out = loop.forward_batch(lm, cache, ids2, real)[:, -1]
    cache.after_forward()
    return out, cache


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device")
        return 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (264,), generator=g).tolist()
    budget = Budget(fraction=0.3, budget_tokens=None, sinks=4, window=16)
    lms = {}
    for dev, dt in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        lms[(dev, dt)] = models.load(OmegaConf.create({**TINY, "dtype": dt}), dev)
    failures = 0
    options = [
        (r, p.stem)
        for r in ROLES
        for p in sorted((ROOT / "conf" / r).glob("*.yaml"))
        if p.stem not in ("none", "chain")
    ]
    for role, name in options:
        t0 = time.perf_counter()
        try:
            cpu, ccache = run(lms[("cpu", "float32")], role, name, ids, budget)
            gpu, gcache = run(lms[("cuda", "float32")], role, name, ids, budget)
            diff = float((cpu - gpu.cpu()).abs().max())
            same_bytes = ccache.nbytes() == gcache.nbytes()
            bf, bcache = run(lms[("cuda", "bfloat16")], role, name, ids, budget)
            finite = bool(torch.isfinite(bf).all())
            a, b = ids[:180], ids[40:150]
            batched, _ = run(lms[("cuda", "float32")], role, name, None, budget, batch=(a, b))
            solo = torch.stack([_solo(lms[("cuda", "float32")], role, name, s, budget) for s in (a, b)])
            bdiff = float((batched - solo).abs().max())
            ok = diff < 1e-3 and same_bytes and finite and bdiff < 1e-3
            failures += not ok
            print(
                f"{'ok  ' if ok else 'FAIL'} {role}/{name}: cpu-vs-cuda max|dlogit| {diff:.2e}, "
                f"bytes equal {same_bytes}, bf16 finite {finite} ({bcache.nbytes()} B), "
                f"padded batch vs solo {bdiff:.2e} [{time.perf_counter() - t0:.1f}s]",
                flush=True,
            )
        except Exception as err:  # report and go on: one line per technique
            failures += 1
            print(f"FAIL {role}/{name}: {type(err).__name__}: {err}", flush=True)
    print(f"{len(options) - failures}/{len(options)} techniques pass on {torch.cuda.get_device_name()}")
    return 1 if failures else 0


def _solo(lm, role, name, seq, budget):
    stack = Stack(**{role: technique(role, name)}, budget=budget)
    stack.bind(BindContext.for_model(lm))
    cache = loop.new_cache(lm, stack)
    return loop.step(lm, cache, seq)[-1]


if __name__ == "__main__":
    sys.exit(main())
