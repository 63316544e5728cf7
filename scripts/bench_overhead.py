"""Overhead of kvbench, measured side by side in one run on the embedded model.

(a) kvbench with the stack `none` against plain transformers (SDPA, DynamicCache) on the same
    prefill and greedy decode work: target at most 1.10x.
(b) a six-cell multirun in one process against six separate processes, each cell a perplexity of
    two 512-token windows: target at most 0.5x.
(c) a needle cell and a LongBench-format cell (kvbench's synthetic set) through H2O at budget 0.5,
    at dataset.batch_size 8 against 1: wall time of each, and whether the scores agree.

    python scripts/bench_overhead.py [--prefill 512] [--decode 32] [--repeats 3] [--skip-b] [--skip-c]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
CELLS = [
    ("none", "none"),
    ("none", "streaming_llm"),
    ("none", "h2o"),
    ("quantized", "none"),
    ("quantized", "streaming_llm"),
    ("quantized", "h2o"),
]


def plain_run(lm, ids, decode: int) -> float:
    lm.model.set_attn_implementation("sdpa")
    start = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache(config=lm.model.config)
        out = lm.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        tok = out.logits[0, -1].argmax()
        for _ in range(decode):
            out = lm.model(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True)
            tok = out.logits[0, -1].argmax()
    lm.model.set_attn_implementation("kvbench")
    return time.perf_counter() - start


def kvbench_run(lm, ids, decode: int) -> float:
    from kvbench.eval import loop
    from kvbench.stack import Stack

    stack = Stack()
    stack.bind(lm.num_layers)
    start = time.perf_counter()
    cache = loop.new_cache(lm, stack)
    logits = loop.step(lm, cache, ids)
    loop.greedy(lm, cache, logits[-1], decode + 1, [])
    return time.perf_counter() - start


def bench_a(prefill: int, decode: int, repeats: int) -> float:
    from kvbench import models
    from kvbench.data import load_text

    cfg = OmegaConf.load(ROOT / "conf" / "model" / "smollm2_135m.yaml")
    lm = models.load(cfg, "cpu")
    ids = lm.codec.encode(load_text({"name": "pydoc", "source": "pydoc"})[:20000])[:prefill]
    plain_run(lm, ids, 2), kvbench_run(lm, ids, 2)  # warm-up
    plain, ours = [], []
    for _ in range(repeats):  # interleaved, so drift hits both sides alike
        plain.append(plain_run(lm, ids, decode))
        ours.append(kvbench_run(lm, ids, decode))
    p, k = min(plain), min(ours)
    print(
        f"(a) prefill {prefill} + decode {decode}, best of {repeats}: transformers {p:.3f} s, "
        f"kvbench(none) {k:.3f} s, ratio {k / p:.3f}x (target <= 1.10x)"
    )
    return k / p


def _cli(args: list[str], env: dict) -> None:
    subprocess.run(
        [sys.executable, "-m", "kvbench", *args],
        check=True,
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def bench_b() -> float:
    common = ["dataset=pydoc", "dataset.windows=2", "dataset.chunks_per_window=4", "force=true"]
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-bench-"))
    env = {**os.environ, "KVBENCH_HYDRA_DIR": str(tmp / "hydra")}
    times = []
    for arm in ("one", "six"):
        shutil.rmtree(
            Path(env.get("KVBENCH_CACHE", Path.home() / ".cache/kvbench")) / "baselines", ignore_errors=True
        )  # both arms compute their baseline once
        start = time.perf_counter()
        if arm == "one":
            _cli(
                [
                    "-m",
                    *common,
                    "compressor=none,quantized",
                    "scheduler=none,streaming_llm,h2o",
                    f"results_dir={tmp / arm}",
                ],
                env,
            )
        else:
            for comp, sched in CELLS:
                _cli([*common, f"compressor={comp}", f"scheduler={sched}", f"results_dir={tmp / arm}"], env)
        times.append(time.perf_counter() - start)
    shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"(b) six cells (2 windows of 512 tokens each): one process {times[0]:.1f} s, "
        f"six processes {times[1]:.1f} s, ratio {times[0] / times[1]:.3f}x (target <= 0.5x)"
    )
    return times[0] / times[1]


def _cell_time(lm, name: str, batch_size: int, **over) -> tuple[float, float]:
    """Wall time and score of one cell of dataset ``name`` through H2O at budget 0.5."""
    from kvbench.eval import protocol
    from kvbench.roles import BindContext, Budget
    from kvbench.schedulers.h2o import H2OScheduler
    from kvbench.stack import Stack

    ds = OmegaConf.load(ROOT / "conf" / "dataset" / f"{name}.yaml")
    for key, value in {**over, "batch_size": batch_size}.items():
        ds[key] = value
    proto = protocol.get(ds.task)
    data = proto.load(ds)
    stack = Stack(scheduler=H2OScheduler(), budget=Budget(budget=0.5))
    stack.bind(BindContext.for_model(lm, stack.budget))
    start = time.perf_counter()
    result = proto.evaluate(lm, stack, data.data, ds, None)
    return time.perf_counter() - start, result.metrics.score.value


def bench_c() -> None:
    from kvbench import models

    lm = models.load(OmegaConf.load(ROOT / "conf" / "model" / "smollm2_135m.yaml"), "cpu")
    cells = {
        "needle": {"lengths": [300, 500], "offsets": 2},  # 20 cases
        "longbench_synthetic": {"limit": 8},  # 24 examples
    }
    for name, over in cells.items():
        one, score_one = _cell_time(lm, name, 1, **over)
        eight, score_eight = _cell_time(lm, name, 8, **over)
        print(
            f"(c) {name} through h2o at 0.5: batch 1 {one:.1f} s, batch 8 {eight:.1f} s, "
            f"ratio {eight / one:.3f}x; score {score_one:.4g} vs {score_eight:.4g}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--skip-c", action="store_true")
    ap.add_argument("--only-c", action="store_true", help="run (c) alone")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if not args.only_c:
        bench_a(args.prefill, args.decode, args.repeats)
        if not args.skip_b:
            bench_b()
    if not args.skip_c:
        bench_c()


if __name__ == "__main__":
    main()
