"""What a decode step costs the host, per technique, side by side with plain transformers in one run
(issue 29; :mod:`kvbench.eval.stepcost` says how each figure is taken).

(1) Launches and bytes: on a random Llama with Llama-3.1-8B's attention shapes (32/8 heads of 128,
    2 layers), a needle-shaped case (--contexts tokens of prefill, compressed at --budget, then
    greedy steps): per layer per decode step, the aten operations that are not views (each at least
    one launch on a GPU), against plain transformers' (target: the full cache at most 1.0x, every
    technique at most 1.5x), the megabytes written at each context (target: no growth with the
    context beyond a few bytes of per-token state) and the host reads of device values (syncs).
    In float32 by default; --dtype bfloat16 (or float16) counts the same in the dtype users run on
    a GPU, where a float32 copy of what a step reads would show as bytes growing with the context.
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
(4) With --instructions, the host's work counted, not timed: on (2)'s model, the instructions the
    host executes per decode step (valgrind's callgrind, --instr-steps steps after a warm-up, each
    stack and transformers in a process of its own, two at a time), their ratio to transformers'
    and what each stack adds beyond transformers' step, split by where it runs: the Python
    interpreter, torch (its dispatch, allocation and the operations' own loops) and the C library
    (memory allocation). Repeatable to about 0.2 % from run to run, whatever else the machine does,
    where a timed ratio strays by 0.05x: for comparing two versions of the code side by side. An
    instruction is not a time (a cache miss or a branch costs more than it counts), so the targets
    stay (2)'s. Needs valgrind (Debian's package); says so and skips (4) without it.

    python scripts/bench_decode.py [--only scheduler/h2o,compressor/quantized] [--contexts 1000,2000]
        [--host-context 256] [--steps 32] [--rounds 3] [--skip-host] [--skip-counts] [--budget 0.5]
        [--dtype float32|bfloat16|float16]
        [--parts] [--instructions] [--instr-steps 20]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def counts(names: list[str | None], contexts: list[int], budget: float, dtype: str = "float32") -> None:
    lm = models.load(stepcost.model_config({**stepcost.LAUNCH_MODEL, "dtype": dtype}), "cpu")
    layers = lm.num_layers
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (max(contexts),), generator=gen).tolist()
    last = contexts[-1]
    model = stepcost.plain_model(lm)
    plain = {c: stepcost.decode_cost(stepcost.plain_run(lm, model, ids[:c]), layers) for c in contexts}
    base = plain[last].ops
    mb_cols = " ".join(f"{f'MB@{c}':>8s}" for c in contexts)
    print(
        f"(1) launches and bytes per layer per decode step: 32/8 heads of 128, {dtype}, budget {budget}, "
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


# (4): where an instruction runs, by the file name of its object (the split printed)
_PLACES = (("python", ("libpython",)), ("torch", ("libtorch", "libc10")), ("libc", ("libc.so", "ld-linux")))


def _instr_child(name: str, steps: int, marks: Path, context: int, budget: float) -> None:
    """(4)'s measured process, run under callgrind with its instrumentation off: warm up, then
    ``steps`` decode steps between the marks the parent answers by turning it on and off."""
    torch.set_num_threads(1)
    config.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        lm = models.load(stepcost.model_config(stepcost.HOST_MODEL), "cpu")
        ids = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(1)).tolist()
        if name == PLAIN:
            step = stepcost.plain_stepper(lm, stepcost.plain_model(lm), ids)
        else:
            stack = stepcost.technique_stack(lm, None if name == FULL else name, budget, tiny=True)
            step = stepcost.kvbench_stepper(lm, stack, ids)
    for _ in range(8):
        step()

    def mark(what: str, wait: str) -> None:
        (marks / what).touch()
        while not (marks / wait).exists():
            time.sleep(0.02)

    mark("ready", "go")
    for _ in range(steps):
        step()
    mark("done", "end")


def _split(out: Path) -> dict[str, int]:
    """Instructions of a callgrind output file, in all and by :data:`_PLACES` (``callgrind_annotate``)."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(out)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    split = dict.fromkeys(["all", *(p for p, _ in _PLACES), "other"], 0)
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \(.*?\)\s+(.*)$", line)
        if not m:
            continue
        n, where = int(m.group(1).replace(",", "")), m.group(2)
        if where.strip() == "PROGRAM TOTALS":
            split["all"] = n
            continue
        obj = re.search(r"\[([^\]]+)\]\s*$", where)
        lib = Path(obj.group(1)).name if obj else ""
        place = next((p for p, keys in _PLACES if any(lib.startswith(k) for k in keys)), "other")
        split[place] += n
    return split


def _instr_run(name: str, steps: int, context: int, budget: float, marks: Path) -> subprocess.Popen:
    """(4)'s measured process for ``name``, under callgrind, its marks and output in ``marks``."""
    marks.mkdir()
    child = [sys.executable, __file__, "--instr-child", name, "--instr-steps", str(steps)]
    child += ["--instr-marks", str(marks), "--host-context", str(context), "--budget", str(budget)]
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={marks}/out"]
    with open(marks / "log", "w") as log:  # the child keeps its own copy of the file
        return subprocess.Popen([*cmd, *child], stdout=log, stderr=subprocess.STDOUT)


def _instr_drive(name: str, proc: subprocess.Popen, marks: Path) -> dict[str, int]:
    """Turn the instrumentation of ``proc`` on and off at its marks; its split per step."""

    def wait(what: str) -> None:
        while not (marks / what).exists():
            if proc.poll() is not None:
                tail = (marks / "log").read_text()[-2000:]
                raise RuntimeError(f"{name}: the measured process ended (exit {proc.returncode}): {tail}")
            time.sleep(0.05)

    wait("ready")
    subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True, check=True)
    (marks / "go").touch()
    wait("done")
    subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], capture_output=True, check=True)
    (marks / "end").touch()
    proc.wait()
    return _split(marks / "out")


def instructions(names: list[str | None], context: int, steps: int, budget: float) -> None:
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        print("(4) skipped: valgrind is not installed (apt-get install valgrind)")
        return
    labels = [PLAIN, *(n or FULL for n in names)]
    splits: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory(prefix="kvbench-instr-") as tmp:
        work = Path(tmp)
        for i in range(0, len(labels), 2):  # two processes at a time: one a core
            batch = labels[i : i + 2]
            print(f"(4) counting {', '.join(batch)}", file=sys.stderr, flush=True)
            marks = {n: work / re.sub(r"\W", "_", n) for n in batch}
            procs = {n: _instr_run(n, steps, context, budget, marks[n]) for n in batch}
            for n, proc in procs.items():
                splits[n] = {k: v // steps for k, v in _instr_drive(n, proc, marks[n]).items()}
    plain = splits[PLAIN]
    places = [p for p, _ in _PLACES] + ["other"]
    print(
        f"(4) host instructions per decode step, {context}-token context, one thread, {steps} steps counted "
        f"(callgrind): transformers {plain['all'] / 1e6:.2f} M; beyond transformers', M per step, by where "
        "they run"
    )
    head = " ".join(f"{p:>7s}" for p in places)
    print(f"  {'stack':28s} {'M/step':>7s} {'ratio':>6s} {head}")
    for n in labels[1:]:
        row = splits[n]
        beyond = " ".join(f"{(row[p] - plain[p]) / 1e6:+7.2f}" for p in places)
        print(f"  {n:28s} {row['all'] / 1e6:7.2f} {row['all'] / plain['all']:5.2f}x {beyond}")


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
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="(1): the model's dtype",
    )
    ap.add_argument("--skip-counts", action="store_true")
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--parts", action="store_true", help="(3): time each side's step in its parts, after (2)")
    ap.add_argument("--instructions", action="store_true", help="(4): count the host's instructions per step")
    ap.add_argument("--instr-steps", type=int, default=20, help="(4): decode steps counted per stack")
    ap.add_argument("--instr-child", default=None, help=argparse.SUPPRESS)  # (4)'s measured process
    ap.add_argument("--instr-marks", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.instr_child is not None:
        _instr_child(args.instr_child, args.instr_steps, args.instr_marks, args.host_context, args.budget)
        return
    known = stepcost.catalog()
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else known
    if unknown := sorted(set(only) - set(known)):
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    if args.parts and args.skip_host:
        raise SystemExit(
            "--parts times the host part (2)'s steps in their parts: it cannot go with --skip-host"
        )
    if args.rounds < 1 or args.steps < 1 or args.instr_steps < 1:
        raise SystemExit(
            f"--rounds={args.rounds}, --steps={args.steps}, --instr-steps={args.instr_steps}: "
            "each must be >= 1"
        )
    names: list[str | None] = [None, *only]
    config.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        if not args.skip_counts:
            torch.set_num_threads(2)
            contexts = sorted(int(c) for c in args.contexts.split(",") if c.strip())
            counts(names, contexts, args.budget, args.dtype)
        if not args.skip_host:
            torch.set_num_threads(1)
            host(names, args.host_context, args.steps, args.rounds, args.budget, args.parts)
    if args.instructions:
        instructions(names, args.host_context, args.instr_steps, args.budget)


if __name__ == "__main__":
    main()
