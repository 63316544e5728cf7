"""What a decode step costs the host, per technique, side by side with plain transformers in one run
(issue 29; :mod:`kvbench.eval.stepcost` says how each figure is taken).

(1) Launches and bytes: on a random Llama with Llama-3.1-8B's attention shapes (32/8 heads of 128,
    2 layers), a needle-shaped case (--contexts tokens of prefill, compressed at --budget, then
    greedy steps): per layer per decode step, the aten operations that are not views (each at least
    one launch on a GPU), against plain transformers' (target: the full cache at most 1.0x, every
    technique at most 1.5x), the megabytes written at each context (target: no growth with the
    context beyond a few bytes of per-token state) and the host reads of device values (syncs).
(2) Host time: on a random Llama whose arithmetic is negligible (8 layers, hidden 64, 4/2 heads of
    16) at --host-context tokens and one thread, where a step costs what the host spends per
    operation, as a batch-1 step on a GPU: the mean decode step against plain transformers' (target:
    the full cache at most 1.0x, every technique at most 1.5x), the two sides' steps timed in turn
    (one of each, --steps of each per round; a mean, so that work done once in several steps, a
    group leaving the window or a compaction, counts at its amortized cost), the median ratio over
    --rounds, with the lowest and highest round beside it (how far one round strays on this machine).
(3) With --parts, where each side's host time goes, on (2)'s model after its rounds: per decode step,
    the cache's update (storing the step's keys and values), the attention function (reading them:
    SDPA, or kvbench's engine with its read selection), the technique hooks after the forward, and
    the rest (the model's own layers and the loop, the same on both sides); what a technique adds
    beyond transformers' step is in the first three.

    python scripts/bench_decode.py [--only scheduler/h2o,compressor/quantized] [--contexts 1000,2000]
        [--host-context 256] [--steps 32] [--rounds 3] [--skip-host] [--skip-counts] [--budget 0.5]
        [--parts]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from hydra import initialize_config_dir

from kvbench import config, models
from kvbench.eval import stepcost
from kvbench.paths import CONF_DIR

FULL = "full cache"
PLAIN = "transformers"
TARGET_FULL = 1.0
TARGET_TECH = 1.5


def _mark(ratio: float, target: float) -> str:
    return "!" if ratio > target else " "


def counts(names: list[str | None], contexts: list[int], budget: float) -> None:
    lm = models.load(stepcost.model_config(stepcost.LAUNCH_MODEL), "cpu")
    layers = lm.num_layers
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (max(contexts),), generator=gen).tolist()
    last = contexts[-1]
    model = stepcost.plain_model(lm)
    plain = {c: stepcost.decode_cost(stepcost.plain_run(lm, model, ids[:c]), layers) for c in contexts}
    base = plain[last].ops
    mb_cols = " ".join(f"{f'MB@{c}':>8s}" for c in contexts)
    print(
        f"(1) launches and bytes per layer per decode step: 32/8 heads of 128, budget {budget}, "
        f"steps 5-20 after a prefill of {', '.join(map(str, contexts))} tokens"
    )
    print(f"  {'stack':28s} {f'ops@{last}':>8s} {'ratio':>7s}  {mb_cols} {'syncs':>6s}")
    print(
        f"  {PLAIN:28s} {base:8.1f} {'':7s}  {' '.join(f'{plain[c].mb:8.2f}' for c in contexts)} "
        f"{plain[last].syncs:6.2f}"
    )
    meet = 0
    for name in names:
        label = name or FULL
        print(f"(1) counting {label}", file=sys.stderr, flush=True)
        try:
            stack = stepcost.technique_stack(lm, name, budget)
            cost = {
                c: stepcost.decode_cost(stepcost.kvbench_run(lm, stack, ids[:c]), layers) for c in contexts
            }
        except Exception as err:  # noqa: BLE001 - reported, the others go on
            print(f"  {label:28s} failed ({type(err).__name__}: {err})".splitlines()[0])
            continue
        ratio = cost[last].ops / base
        target = TARGET_FULL if name is None else TARGET_TECH
        meet += ratio <= target
        mbs = " ".join(f"{cost[c].mb:8.2f}" for c in contexts)
        print(
            f"  {label:28s} {cost[last].ops:8.1f} {ratio:6.2f}x{_mark(ratio, target)} "
            f"{mbs} {cost[last].syncs:6.2f}"
        )
    print(
        f"  {meet}/{len(names)} within their launch target "
        f"(full cache {TARGET_FULL}x, techniques {TARGET_TECH}x)"
    )


def host(names: list[str | None], context: int, steps: int, rounds: int, budget: float, parts: bool) -> None:
    lm = models.load(stepcost.model_config(stepcost.HOST_MODEL), "cpu")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (context,), generator=gen).tolist()
    model = stepcost.plain_model(lm)
    stacks = {}
    for name in names:  # bound (calibrations fitted) before any timing
        print(f"(2) building {name or FULL}", file=sys.stderr, flush=True)
        stacks[name] = stepcost.technique_stack(lm, name, budget, tiny=True)  # head_dim 16
    ratios: dict[str | None, list[float]] = {n: [] for n in names}
    plain_ms: list[float] = []
    mine_ms: dict[str | None, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        print(f"(2) round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        for name in names:  # the plain step beside each, so drift hits both alike
            p, k = stepcost.paired_steps(
                lambda: stepcost.plain_stepper(lm, model, ids),
                lambda n=name: stepcost.kvbench_stepper(lm, stacks[n], ids),
                steps,
            )
            ratios[name].append(k / p)
            plain_ms.append(p * 1e3)
            mine_ms[name].append(k * 1e3)
    print(
        f"(2) host time per decode step, {lm.num_layers} thin layers, {context}-token context, one thread, "
        f"mean of {steps} steps, median of {rounds} rounds: "
        f"transformers {statistics.median(plain_ms):.2f} ms"
    )
    print(f"  {'stack':28s} {'step ms':>8s} {'ratio':>7s}  rounds (lowest-highest)")
    meet = 0
    for name in names:
        ratio = statistics.median(ratios[name])
        target = TARGET_FULL if name is None else TARGET_TECH
        meet += ratio <= target
        print(
            f"  {name or FULL:28s} {statistics.median(mine_ms[name]):8.2f} "
            f"{ratio:6.2f}x{_mark(ratio, target)} {min(ratios[name]):.2f}-{max(ratios[name]):.2f}"
        )
    print(
        f"  {meet}/{len(names)} within their host-time target "
        f"(full cache {TARGET_FULL}x, techniques {TARGET_TECH}x)"
    )
    if parts:
        where(lm, model, stacks, ids, steps)


def where(lm, model, stacks: dict, ids: list[int], steps: int) -> None:
    """(3): each technique's step and transformers' beside it, timed in turn and in their parts
    (:func:`stepcost.paired_parts`), ms per step."""
    print(
        f"(3) where the host's time goes, ms per decode step ({steps} steps of each side in turn, timed "
        "in their parts): the cache's update, the attention function, the technique hooks after the "
        "forward, the rest; beyond: the step minus transformers' beside it"
    )
    head = " ".join(f"{c:>7s}" for c in ("step", "update", "attend", "hooks", "rest", "beyond"))
    print(f"  {'stack':28s} {head}")

    def row(label: str, p: stepcost.HostParts, beyond: str) -> None:
        cols = " ".join(f"{x:7.2f}" for x in (p.step, p.update, p.attention, p.hooks, p.rest))
        print(f"  {label:28s} {cols} {beyond:>7s}", flush=True)

    for name, stack in stacks.items():
        print(f"(3) timing the parts of {name or FULL}", file=sys.stderr, flush=True)
        plain, mine = stepcost.paired_parts(
            lambda: stepcost.plain_stepper(lm, model, ids),
            lambda s=stack: stepcost.kvbench_stepper(lm, s, ids),
            steps,
        )
        row(f"{PLAIN} (beside)", plain, "")
        row(name or FULL, mine, f"{mine.step - plain.step:+7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only", default=None, help="techniques, role/name, comma-separated (the full cache always runs)"
    )
    ap.add_argument("--contexts", default="1000,2000", help="(1): prefill lengths, comma-separated")
    ap.add_argument("--host-context", type=int, default=256, help="(2): prefill length")
    ap.add_argument("--steps", type=int, default=32, help="(2): timed decode steps of each side per round")
    ap.add_argument("--rounds", type=int, default=3, help="(2): rounds, each from a fresh prefill")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--skip-counts", action="store_true")
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--parts", action="store_true", help="(3): time each side's step in its parts, after (2)")
    args = ap.parse_args()
    known = stepcost.catalog()
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else known
    if unknown := sorted(set(only) - set(known)):
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    if args.parts and args.skip_host:
        raise SystemExit(
            "--parts times the host part (2)'s steps in their parts: it cannot go with --skip-host"
        )
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit(f"--rounds={args.rounds}, --steps={args.steps}: each must be >= 1")
    names: list[str | None] = [None, *only]
    config.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        if not args.skip_counts:
            torch.set_num_threads(2)
            counts(names, sorted(int(c) for c in args.contexts.split(",") if c.strip()), args.budget)
        if not args.skip_host:
            torch.set_num_threads(1)
            host(names, args.host_context, args.steps, args.rounds, args.budget, args.parts)


if __name__ == "__main__":
    main()
