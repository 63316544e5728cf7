"""Precompute a model's calibration artifacts (lora bases, DuoAttention gates, RankKV layer ranks).

Runs the same functions and the same on-disk store as a benchmark run, so a run with the same
settings finds the artifacts instead of computing them. Prints one line per artifact: its kind,
path and sha256.

    python scripts/calibrate.py [--model smollm2_135m] [--what lora,duo,rankkv] \
        [--key-rank 32 --value-rank 32] [--steps 50] [--device cpu] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from omegaconf import OmegaConf

from kvbench import calibration, models
from kvbench.calibration.artifacts import CALIBRATION_TOKENS, LORA_TOKENS

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("lora", "duo", "rankkv")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2_135m", help="a conf/model/<name>.yaml")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="the model dtype of the runs to serve (default: the YAML's)")
    p.add_argument("--what", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--key-rank", type=int, default=32)
    p.add_argument("--value-rank", type=int, default=32)  # conf/compressor/lora.yaml
    p.add_argument("--lora-tokens", type=int, default=LORA_TOKENS)
    p.add_argument("--rank-tokens", type=int, default=CALIBRATION_TOKENS)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--samples", type=int, default=8, help="passkey samples for the duo fit")
    p.add_argument("--length", type=int, default=1024, help="tokens of calibration text per passkey sample")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--l1", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.what = [w.strip() for w in args.what.split(",") if w.strip()]
    unknown = sorted(set(args.what) - set(KINDS))
    if unknown:
        p.error(f"--what {','.join(unknown)}: allowed {','.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")
    if args.dtype:  # artifacts are keyed by the model as loaded, dtype included
        cfg.dtype = args.dtype
    lm = models.load(cfg, args.device)
    records = []
    for kind in args.what:
        start = time.perf_counter()
        if kind == "lora":
            _, rec = calibration.lora_artifact(lm, args.key_rank, args.value_rank, args.lora_tokens)
        elif kind == "rankkv":
            _, rec = calibration.rankkv_artifact(lm, args.rank_tokens)
        else:
            _, rec = calibration.duo_artifact(
                lm,
                sinks=args.sinks,
                window=args.window,
                samples=args.samples,
                length=args.length,
                steps=args.steps,
                lr=args.lr,
                l1=args.l1,
                seed=args.seed,
                progress=True,
            )
        print(f"{kind}: {rec['path']} sha256={rec['sha256'][:16]} ({time.perf_counter() - start:.1f} s)")
        records.append(rec)
    return records


if __name__ == "__main__":
    main()
