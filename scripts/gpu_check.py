"""kvbench on a GPU against its CPU path, and its memory at 8B x 32k. Six parts (``--only``):

- ``techniques``: every technique YAML alone at a tight budget, and chains and triples, on a tiny
  random model (9/3 GQA, 3 layers): float32 logits on CUDA against the CPU's over a 200-token
  prefill, 8-token chunks and 8 single-token decode steps (max |dlogit| < 1e-3), stored bytes
  equal, bfloat16 finite, and a padded batch of two against one-by-one runs.
- ``kernels``: the same, with the cache's Triton kernels on the device (``kernels=triton``,
  docs/kernels.md) against the CPU's torch path. On ``--device cpu`` it needs
  ``TRITON_INTERPRET=1`` (the interpreter: slow).
- ``geometry``: head_dim 128 (Llama-3's) and a sliding-window model (Mistral, window 24): the full
  cache and five techniques, CUDA float32 against the CPU, and bfloat16 / float16 against float32
  on the device within a stated tolerance: max |dlogit| <= 0.05 (bf16) or 0.01 (fp16) times the
  float32 logits' largest magnitude, 0.25 in either dtype for a technique that selects tokens (a
  near-tie between two tokens' scores may fall the other way in low precision, and the change is
  what the other token holds: on the CPU up to 0.18 for bf16, on an H200 0.08 for MoBA in fp16).
  The random models are drawn in float32 and cast, so every dtype has the same weights.
- ``protocols``: perplexity and needle end to end through ``kvbench.run`` on ``model=tiny_random``
  (a cell's record, its status and per-device memory).
- ``batching``: a LongBench-format cell (kvbench's synthetic set, ``--limit`` examples a task) on a
  random model with Llama-3.1-8B's shapes (``--layers``), the full cache and ``scheduler/h2o`` at
  budget 0.5: examples per second at ``dataset.batch_size=8`` against 1, and how many predictions
  agree (bf16 with padding may tip a near-tie of the random model's logits).
- ``memory``: a random model with Llama-3.1-8B's shapes (``--layers`` of them, 32 query / 8 KV
  heads, head_dim 128, vocabulary 128,256, bf16) at each of ``--contexts`` for the full cache and
  every technique: peak allocated and reserved memory of a prefill and 16 decode steps, the
  cache's stored and resident bytes, the time per output token and the decode attention time per
  layer (``decode_attn_ms``: the engine's attention and the stack's work, every third decode step,
  CUDA events); ``--techniques`` names some.
  A first row runs the same steps through transformers' own cache and SDPA, for comparison.

One line per check; exits non-zero on a failure. On a GPU node (one GPU; the memory part at 32k
with 32 layers needs about 33 GB free: the random weights are drawn in float32, 30 GiB, and cast
to bf16, and the full cache's cell then peaked at 24.3 GB on an H200; the whole script takes
about ten minutes there, the memory part at two contexts most of it):

    python scripts/gpu_check.py                      # everything on cuda
    python scripts/gpu_check.py --only memory --contexts 8192,32768
    python scripts/gpu_check.py --only memory --contexts 32768 --kernels torch,auto \
        --techniques none,compressor/quantized,scheduler/quest,scheduler/adakv   # issue 30's TPOT
    python scripts/gpu_check.py --device cpu --only techniques,geometry,protocols   # the script itself
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts")]

from bench_kvpress import SHAPED_8B  # noqa: E402  (torch and transformers only: kvpress runs it too)
from kvbench import config, models, run  # noqa: E402
from kvbench.cache import engine, timing  # noqa: E402
from kvbench.eval import loop, measure  # noqa: E402
from kvbench.kernels import dispatch  # noqa: E402
from kvbench.roles import BindContext, Budget  # noqa: E402
from kvbench.stack import Stack, build_technique, chain_stages  # noqa: E402

ROLES = ("router", "compressor", "scheduler")
CONF = ROOT / "conf"
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
GEOMETRIES = {
    "head_dim 128": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 256},
    "sliding window 24": {"sliding_window": 24},
}
# (role, name, selects tokens): the full cache and five techniques of the geometry checks
FIVE = [
    (None, "full cache", False),
    ("scheduler", "h2o", True),
    ("compressor", "snapkv", True),
    ("compressor", "quantized", False),
    ("scheduler", "quest", True),
    ("router", "base", True),
]
CHAINS = {  # compressor chains and triples, as a user composes them
    "compressor=chain[chunkkv,svd]": {
        "compressor": "[chunkkv,{name:svd,key_rank:4,value_rank:8,block_size:16}]"
    },
    "compressor=chain[lora,distillation]": {
        "compressor": "[{name:lora,key_rank:4,value_rank:8},distillation]"
    },
    "base+quantized+h2o": {"router": "base", "compressor": "quantized", "scheduler": "h2o"},
    "pikv+pyramid+streaming_llm": {"router": "pikv", "compressor": "pyramid", "scheduler": "streaming_llm"},
}
TOLERANCE = {torch.bfloat16: 0.05, torch.float16: 0.01}  # of the float32 logits' largest magnitude
# a technique that selects tokens: a near-tie that falls the other way changes the logits by what the
# other token or block holds, whatever the dtype (fp16 0.08 for MoBA's blocks on an H200)
SELECTION_FLIP = 0.25


def technique(role: str, spec: str):
    if role == "compressor" and spec.startswith("["):
        return chain_stages(_parse(spec))[0]
    path = CONF / role / f"{spec}.yaml"
    node = OmegaConf.load(path)
    for line in path.read_text().splitlines():  # knobs sized for a tiny model (head_dim 16, 3 layers)
        if line.startswith("# tiny:"):
            for kv in line.removeprefix("# tiny:").split():
                key, _, value = kv.partition("=")
                node[key] = int(value)
    return build_technique(node, role)


def _parse(spec: str):
    return compose("config", overrides=["compressor=chain", f"compressor.stages={spec}"]).compressor.stages


def stack_of(lm, parts: dict[str, str], budget: Budget) -> Stack:
    stack = Stack(**{role: technique(role, spec) for role, spec in parts.items()}, budget=budget)
    stack.bind(BindContext.for_model(lm))
    return stack


def run_ids(lm, parts, ids, budget):
    """Prefill 200, chunks of 8, then 8 single-token decode steps: every row of logits."""
    stack = stack_of(lm, parts, budget)
    cache = loop.new_cache(lm, stack)
    outs = [loop.step(lm, cache, ids[:200])]
    for i in range(200, len(ids) - 8, 8):
        outs.append(loop.step(lm, cache, ids[i : i + 8]))
    for i in range(len(ids) - 8, len(ids)):
        outs.append(loop.step(lm, cache, ids[i : i + 1]))
    return torch.cat(outs).float().cpu(), cache


def run_batch(lm, parts, a, b, budget):
    stack = stack_of(lm, parts, budget)
    cache = loop.new_cache(lm, stack, batch=2)
    ids2 = torch.zeros(2, len(a), dtype=torch.long)
    real = torch.zeros(2, len(a), dtype=torch.bool)
    ids2[0], real[0] = torch.tensor(a), True
    ids2[1, len(a) - len(b) :], real[1, len(a) - len(b) :] = torch.tensor(b), True
    out = loop.forward_batch(lm, cache, ids2, real)[:, -1]
    cache.after_forward()
    solo = []
    for seq in (a, b):
        one = loop.new_cache(lm, stack_of(lm, parts, budget))
        solo.append(loop.step(lm, one, seq)[-1])
    return float((out - torch.stack(solo)).abs().max())


class Checks:
    def __init__(self) -> None:
        self.failed = self.total = 0

    def line(self, ok: bool, text: str) -> None:
        self.total += 1
        self.failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {text}", flush=True)

    def guarded(self, name: str, fn) -> None:
        try:
            fn()
        except Exception as err:  # report and go on: one line per check
            self.line(False, f"{name}: {type(err).__name__}: {err}")


def options() -> list[tuple[str, str]]:
    return [
        (r, p.stem)
        for r in ROLES
        for p in sorted((CONF / r).glob("*.yaml"))
        if p.stem not in ("none", "chain")
    ]


def check_techniques(checks: Checks, device: str, kernels: str = "torch") -> None:
    """Every technique, chain and triple on ``device`` with the cache's ``kernels`` path against the
    CPU's torch path."""
    ids = torch.randint(0, 256, (272,), generator=torch.Generator().manual_seed(0)).tolist()
    budget = Budget(fraction=0.3, budget_tokens=None, sinks=4, window=16)
    lms = {
        (dev, dt): models.load(OmegaConf.create({**TINY, "dtype": dt}), dev)
        for dev, dt in (("cpu", "float32"), (device, "float32"), (device, "bfloat16"))
    }
    cases = [(f"{r}/{o}", {r: o}) for r, o in options()] + [(name, parts) for name, parts in CHAINS.items()]
    for name, parts in cases:

        def one(name=name, parts=parts):
            t0 = time.perf_counter()
            cpu, ccache = run_ids(lms[("cpu", "float32")], parts, ids, budget)
            with dispatch.using(kernels):
                dev, dcache = run_ids(lms[(device, "float32")], parts, ids, budget)
                bf, bcache = run_ids(lms[(device, "bfloat16")], parts, ids, budget)
                bdiff = run_batch(lms[(device, "float32")], parts, ids[:180], ids[40:150], budget)
            diff = float((cpu - dev).abs().max())
            same_bytes = ccache.nbytes() == dcache.nbytes()
            finite = bool(torch.isfinite(bf).all())
            checks.line(
                diff < 1e-3 and same_bytes and finite and bdiff < 1e-3,
                f"{name}: cpu-vs-{device} ({kernels}) max|dlogit| {diff:.2e} (prefill, chunks, 8 steps), "
                f"bytes equal {same_bytes}, bf16 finite {finite} ({bcache.nbytes()} B), "
                f"padded batch vs solo {bdiff:.2e} [{time.perf_counter() - t0:.1f}s]",
            )

        checks.guarded(f"{name} ({kernels})", one)


def check_geometry(checks: Checks, device: str) -> None:
    ids = torch.randint(0, 256, (240,), generator=torch.Generator().manual_seed(1)).tolist()
    budget = Budget(fraction=0.3, budget_tokens=None, sinks=4, window=16)
    for geo, extra in GEOMETRIES.items():
        family = "mistral" if "sliding_window" in extra else "llama"
        cfg = {**TINY, "family": family, "config": {**TINY["config"], **extra}}
        lm = {
            dt: models.load(OmegaConf.create({**cfg, "name": f"{geo}-{dt}", "dtype": dt}), dev)
            for dt, dev in (("float32", device), ("bfloat16", device), ("float16", device))
        }
        cpu_lm = models.load(OmegaConf.create({**cfg, "name": f"{geo}-cpu", "dtype": "float32"}), "cpu")
        for role, name, selects in FIVE:
            parts = {} if role is None else {role: name}
            tol = {
                dt: SELECTION_FLIP if selects else TOLERANCE[getattr(torch, dt)]
                for dt in ("bfloat16", "float16")
            }

            def one(parts=parts, name=name, geo=geo, lm=lm, cpu_lm=cpu_lm, tol=tol):
                ref, _ = run_ids(lm["float32"], parts, ids, budget)
                cpu, _ = run_ids(cpu_lm, parts, ids, budget)
                scale = float(ref.abs().max())
                diffs = {
                    dt: float((run_ids(lm[dt], parts, ids, budget)[0] - ref).abs().max()) / scale
                    for dt in ("bfloat16", "float16")
                }
                dcpu = float((cpu - ref).abs().max())
                ok = dcpu < 1e-3 and all(diffs[dt] <= tol[dt] for dt in diffs)
                checks.line(
                    ok,
                    f"{geo}, {name}: cpu-vs-{device} fp32 {dcpu:.2e}; relative to fp32: "
                    f"bf16 {diffs['bfloat16']:.3f} (<= {tol['bfloat16']}), "
                    f"fp16 {diffs['float16']:.4f} (<= {tol['float16']})",
                )

            checks.guarded(f"{geo}, {name}", one)


def check_protocols(checks: Checks, device: str, tmp: Path) -> None:
    for dataset, extra in (
        ("pydoc", ["dataset.windows=1"]),
        (
            "needle",
            [
                "dataset.lengths=[200]",
                "dataset.depths=[0.5]",
                "dataset.offsets=1",
                "dataset.max_new_tokens=4",
            ],
        ),
    ):

        def one(dataset=dataset, extra=extra):
            cfg = compose(
                "config",
                overrides=[
                    "model=tiny_random",
                    f"dataset={dataset}",
                    *extra,
                    f"device={device}",
                    "scheduler=h2o",
                    "budget=0.5",
                    f"results_dir={tmp / dataset}",
                    f"name=gpu_check_{dataset}",
                ],
            )
            record = run.run(cfg)
            memory = record.get("metrics", {}).get("memory", {})
            checks.line(
                record["status"] == "done" and any("kv_resident_peak_mb" in m for m in memory.values()),
                f"protocol {dataset} on {device}: {record['status']} {record.get('error', '')}, "
                f"memory {memory}",
            )

        checks.guarded(f"protocol {dataset}", one)


def shaped_8b(device: str, layers: int):
    """A random model with Llama-3.1-8B's shapes (``layers`` of its layers), bf16, built where it runs."""
    cfg = {
        **TINY,
        "name": "llama8b_shaped",
        "dtype": "bfloat16",
        "config": {**SHAPED_8B, "num_hidden_layers": layers},
    }
    torch.set_default_device(device)  # build the random weights where they run
    try:
        return models.load(OmegaConf.create(cfg), device)
    finally:
        torch.set_default_device(None)


def check_batching(checks: Checks, device: str, layers: int, limit: int, sizes=(1, 8)) -> None:
    """A LongBench-format cell (kvbench's synthetic set, its three tasks, ``limit`` examples each) on
    the 8B-shaped random model, full cache and ``scheduler/h2o`` at budget 0.5: examples per second
    at ``dataset.batch_size`` 8 against 1 (issue 29), and whether the predictions agree."""
    import bench_overhead as bo
    from kvbench.eval import longbench

    lm = shaped_8b(device, layers)
    ds = compose("config", overrides=["dataset=longbench_synthetic", f"dataset.limit={limit}"]).dataset
    docs = longbench.PROTOCOL.load(ds).data
    n = sum(len(v) for v in docs.values())
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(
        f"batching: LongBench-format cell, {n} examples, 8B-shaped random model ({layers} layers), on {name}"
    )
    for tech in (None, "scheduler/h2o"):

        def one(tech=tech, lm=lm):
            rates, predictions = [], []
            for size in sizes:
                stack = bo.build_cell_stack(lm, tech, 0.5, model="tiny_random")  # as the memory part's
                OmegaConf.update(ds, "batch_size", size)
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                _, examples = longbench.evaluate(lm, stack, docs, ds, None)
                if device == "cuda":
                    torch.cuda.synchronize()
                rates.append(n / (time.perf_counter() - start))
                predictions.append([e["prediction"] for e in examples])
            same = sum(a == b for a, b in zip(*predictions))
            print(
                f"{tech or 'full cache':28s} "
                + " ".join(f"batch {b}: {r:6.2f} examples/s" for b, r in zip(sizes, rates))
                + f"  ratio {rates[-1] / rates[0]:.2f}x, {same}/{n} predictions equal",
                flush=True,
            )
            checks.total += 1

        checks.guarded(f"batching {tech or 'full cache'}", one)
    if device == "cuda":
        torch.cuda.empty_cache()


def check_memory(
    checks: Checks,
    device: str,
    contexts: list[int],
    layers: int,
    only: str | None,
    steps: int = 16,
    paths: tuple[str, ...] = ("torch",),
    deadline: float | None = None,
    kvpress: str | None = None,
) -> None:
    import bench_overhead as bo

    lm = shaped_8b(device, layers)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(
        f"memory: Llama-3.1-8B-shaped random model, {layers} layers, bf16, on {name}; "
        f"weights {sum(lm.weight_bytes.values()) / 2**30:.1f} GiB",
        flush=True,
    )
    print(
        f"{'technique':28s} {'context':>7s} {'peak alloc MB':>13s} {'reserved MB':>11s} "
        f"{'stored MB':>9s} {'resident MB':>11s} {'prefill s':>9s} {'TPOT ms':>8s} {'attn ms/L':>10s}"
    )
    rows: dict[tuple[str, str, int], dict] = {}  # (technique, path, context) -> the row's figures
    for n in contexts:
        ids = torch.randint(
            0, SHAPED_8B["vocab_size"], (n + steps,), generator=torch.Generator().manual_seed(n)
        ).tolist()
        checks.guarded(
            f"memory transformers at {n}",
            lambda n=n, ids=ids: rows.update(
                {("transformers", "sdpa", n): plain_row(lm, ids, n, steps, checks)}
            ),
        )
        wanted = None if only is None else set(only.split(","))
        techs = [t for t in [None, *bo.catalog()] if wanted is None or (t or "none") in wanted]
        # svd last: on the H200 of 2026-11-27 its prefill at 32k ran past four minutes (CUDA's SVD of
        # thousands of 64 x 128 blocks a layer) and took every cell after it with the lent time
        techs.sort(key=lambda t: t == "compressor/svd")
        for tech, path in [(t, p) for t in techs for p in paths]:

            def one(tech=tech, n=n, ids=ids, path=path):
                with dispatch.using(
                    dispatch.resolve(path, torch.device(device))
                ):  # its kernels compiled, untimed
                    make = lambda: bo.build_cell_stack(lm, tech, 0.5, model="tiny_random")  # noqa: E731
                    loop.warm_up_kernels(lm, make, tokens=min(n, WARM_UP))
                stack = bo.build_cell_stack(lm, tech, 0.5, model="tiny_random")  # no GGUF needed
                measure.reset_peak(lm.devices)
                cache = loop.new_cache(lm, stack)
                with dispatch.using(dispatch.resolve(path, torch.device(device))):
                    prefill: list[float] = []
                    with measure.timed(lm.devices, prefill):
                        loop.step(lm, cache, ids[:n], keep=1)
                    times: list[float] = []
                    with timing.cell() as attn:  # every third decode step's attention, per layer
                        for i in range(steps):  # each step timed (measure.timed) into ``times``
                            loop.step(lm, cache, ids[n + i : n + i + 1], times, decode=True)
                        attn_ms = attn.metrics()["decode_attn_ms"]
                mem = measure.memory(lm.devices)
                alloc = sum(m.get("peak_allocated_mb") or 0 for m in mem.values())
                reserved = sum(m.get("peak_reserved_mb") or 0 for m in mem.values())
                tpot = 1000 * sum(times[1:]) / max(1, len(times) - 1)
                label = (tech or "full cache") + (f" [{path}]" if len(paths) > 1 else "")
                print(
                    f"{label:28s} {n:7d} {alloc:13.0f} {reserved:11.0f} "
                    f"{cache.nbytes() / 2**20:9.0f} {cache.resident_bytes() / 2**20:11.0f} {prefill[0]:9.3f} "
                    f"{tpot:8.1f} {'-' if attn_ms is None else format(attn_ms, '.3f'):>10s}",
                    flush=True,
                )
                evicts = any(t.flags.evicts_tokens for t in stack.pipeline)
                rows[(tech or "full cache", path, n)] = dict(
                    tpot_ms=tpot, prefill_s=prefill[0], total_s=prefill[0] + sum(times), evicts=evicts
                )
                checks.total += 1

            if deadline is not None and time.monotonic() > deadline:
                print(f"{(tech or 'full cache'):28s} {n:7d} not run: past --deadline", flush=True)
                continue
            checks.guarded(f"memory {tech or 'full cache'} ({path}) at {n}", one)
            if device == "cuda":
                torch.cuda.empty_cache()
    for path in paths:
        print_targets(rows, path, max(contexts))
    if kvpress:
        print_kvpress(rows, paths[0], kvpress)


WARM_UP = 2048  # tokens of the untimed run (loop.warm_up_kernels) before a technique is timed at 8B shapes


def print_targets(rows: dict, path: str, n: int) -> None:
    """Issue 29's GPU targets at context ``n``, from the rows measured above (``path``'s)."""
    full = rows.get(("full cache", path, n))
    plain = rows.get(("transformers", "sdpa", n))
    if full is None:
        print(f"targets at {n} ({path}): the full cache was not measured")
        return
    print(f"targets at {n} tokens ({path}), TPOT against the full cache's {full['tpot_ms']:.1f} ms:")
    if plain is not None:
        ratio = full["tpot_ms"] / plain["tpot_ms"]
        print(
            f"  full cache / transformers {ratio:.2f}x (target <= 1.05x) {'ok' if ratio <= 1.05 else 'MISS'}"
        )
    over = []
    for (tech, p, m), row in rows.items():
        if p != path or m != n or tech in ("full cache", "transformers"):
            continue
        ratio = row["tpot_ms"] / full["tpot_ms"]
        limit = 1.0 if row["evicts"] or tech == "compressor/quantized" else 1.5
        over += [f"{tech} {ratio:.2f}x (target <= {limit}x)"] if ratio > limit else []
    total = sum(1 for (t, p, m) in rows if p == path and m == n and t not in ("full cache", "transformers"))
    print(
        f"  {total - len(over)}/{total} within (evictions and KIVI 2-bit <= 1.0x, the rest <= 1.5x)"
        + "".join(f"\n  MISS {line}" for line in over)
    )


def print_kvpress(rows: dict, path: str, file: str) -> None:
    """kvpress's prefill and decode (scripts/bench_kvpress.py's JSON) beside kvbench's same cells."""
    import json

    data = json.loads(Path(file).read_text())
    if "error" in data:
        print(f"kvpress: {data['error']}")
        return
    print(
        f"kvpress {data['kvpress']} (transformers {data['transformers']}) beside kvbench, "
        "prefill + decode of the same steps, seconds (TPOT ms):"
    )
    print(f"{'technique':28s} {'context':>7s} {'kvbench':>16s} {'kvpress':>16s} {'kvbench/kvpress':>15s}")
    ours = {"none": "full cache", "snapkv": "compressor/snapkv", "streaming_llm": "scheduler/streaming_llm"}
    ours |= {"h2o": "scheduler/h2o", "adakv": "scheduler/adakv"}
    for key, theirs in data["rows"].items():
        press, n = key.split("@")
        mine = rows.get((ours[press], path, int(n)))
        if mine is None or "total_s" not in theirs:
            why = theirs.get("skipped") or theirs.get("error") or "kvbench row missing"
            print(f"{ours[press]:28s} {n:>7s} {why}")
            continue
        print(
            f"{ours[press]:28s} {n:>7s} {mine['total_s']:7.2f} ({mine['tpot_ms']:6.1f}) "
            f"{theirs['total_s']:7.2f} ({theirs['tpot_ms']:6.1f}) "
            f"{mine['total_s'] / theirs['total_s']:14.2f}x"
        )


def plain_row(lm, ids: list[int], n: int, steps: int, checks: Checks) -> dict:
    """The same prefill and decode steps through transformers' own cache and SDPA attention: what
    the full cache's row is compared with (issue 12's "within 1.05x of plain transformers")."""
    lm.model.set_attn_implementation("sdpa")
    cache = transformers.DynamicCache(config=lm.model.config)
    try:
        measure.reset_peak(lm.devices)
        times: list[float] = []
        with torch.inference_mode():
            chunks = [ids[:n], *([t] for t in ids[n : n + steps])]
            for chunk in chunks:
                x = torch.tensor([chunk], device=lm.device)
                with measure.timed(lm.devices, times):
                    lm.model(input_ids=x, **{lm.cache_arg: cache}, use_cache=True, logits_to_keep=1)
        mem = measure.memory(lm.devices)
        alloc = sum(m.get("peak_allocated_mb") or 0 for m in mem.values())
        reserved = sum(m.get("peak_reserved_mb") or 0 for m in mem.values())
        tpot = 1000 * sum(times[2:]) / max(1, len(times) - 2)  # decode steps after the first
        print(
            f"{'transformers (sdpa)':28s} {n:7d} {alloc:13.0f} {reserved:11.0f} {'':9s} {'':11s} "
            f"{times[0]:9.3f} {tpot:8.1f}"
        )
        checks.total += 1
        return dict(tpot_ms=tpot, prefill_s=times[0], total_s=sum(times), evicts=False)
    finally:
        lm.model.set_attn_implementation(engine.ATTN_NAME)
        del cache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default="techniques,kernels,geometry,protocols,batching,memory")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument(
        "--techniques",
        default=None,
        help="memory part: only these role/name (comma-separated; none: the full cache)",
    )
    ap.add_argument("--limit", type=int, default=8, help="batching part: examples per task")
    ap.add_argument(
        "--kernels",
        default="torch",
        help="memory part: the kernels paths to time each technique on, side by side (e.g. torch,auto)",
    )
    ap.add_argument("--results", default="/tmp/kvbench_gpu_check")
    ap.add_argument(
        "--kvpress",
        default=None,
        help="memory part: scripts/bench_kvpress.py's JSON, printed beside kvbench's rows of the same cells",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds after the start past which the memory and batching parts start no new cell",
    )
    args = ap.parse_args()
    deadline = None if args.deadline is None else time.monotonic() + args.deadline
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (--device cpu checks the script on the CPU)")
        return 2
    parts = set(args.only.split(","))
    checks = Checks()
    config.register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        if "techniques" in parts:
            check_techniques(checks, args.device)
        if "kernels" in parts:
            check_techniques(checks, args.device, kernels="triton")
        if "geometry" in parts:
            check_geometry(checks, args.device)
        if "protocols" in parts:
            check_protocols(checks, args.device, Path(args.results))
        if "memory" in parts:
            contexts = [int(c) for c in args.contexts.split(",")]
            paths = tuple(args.kernels.split(","))
            check_memory(
                checks,
                args.device,
                contexts,
                args.layers,
                args.techniques,
                paths=paths,
                deadline=deadline,
                kvpress=args.kvpress,
            )
        if "batching" in parts:
            if deadline is not None and time.monotonic() > deadline:
                print("batching: not run, past --deadline")
            else:
                check_batching(checks, args.device, args.layers, args.limit)
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{checks.total - checks.failed}/{checks.total} checks pass on {where}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
