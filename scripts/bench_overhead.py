"""Overhead of kvbench, measured side by side in one run on the embedded model.

(a) kvbench with the stack `none` against plain transformers (SDPA, DynamicCache) on the same
    prefill and greedy decode work: target at most 1.05x.
(b) a six-cell multirun in one process against six separate processes, each cell a perplexity of
    two 512-token windows: target at most 0.5x.
(c) a needle cell and a LongBench-format cell (kvbench's synthetic set) through H2O at budget 0.5,
    at dataset.batch_size 8 against 1: wall time of each, and whether the scores agree.
(d) per technique: every technique of the catalog (each YAML of conf/router, conf/compressor and
    conf/scheduler but none.yaml and chain.yaml, whose stages are empty by default), built as a cell
    builds it (Hydra compose, validate, bind on the model, calibrations fitted before any timing),
    alone at --budget, at each context length: prefill, then --decode greedy steps, each timed with
    the stack's after_forward inside. Its mean decode step (the first discarded as warm-up) against
    the full cache's, measured first and last at each length (their mean, and their spread to show
    drift): target at most 1.5x, `!` marks those above. Cell: prefill plus 12 decode steps (a needle
    case's work) against the full cache's, target at most 1.3x. Store share: the part of the decode step
    spent in kvbench's cache engine (KVCache.update, attend, after_forward; attend includes the
    attention computation itself, so the full cache's share is the floor to compare with).
    --rounds N repeats the whole pass and prints each figure's median over the rounds, every ratio
    taken within its own round (on a machine that is not quiet a single ratio moves by ~0.1x).

    python scripts/bench_overhead.py [--prefill 512] [--decode 32] [--repeats 3] [--skip-b] [--skip-c]
        [--techniques]
    python scripts/bench_overhead.py --only-d [--contexts 512,2048] [--decode 32] [--budget 0.5]
        [--only scheduler/h2o,compressor/quantized] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]


def _conf_dir() -> Path:
    """The Hydra configs: the checkout's ``conf/``, else the one kvbench ships (``CONF_DIR``)."""
    if (ROOT / "conf").is_dir():
        return ROOT / "conf"
    try:
        from kvbench.paths import CONF_DIR
    except ImportError:
        from kvbench.stack import CONF_DIR
    return Path(CONF_DIR)


CONF = _conf_dir()
MODEL_YAML = CONF / "model" / "smollm2_135m.yaml"
ROLES = ("router", "compressor", "scheduler")
FULL = "full cache"
TARGET_D = 1.5
TARGET_CELL = 1.3
CELL_STEPS = 12  # a needle case: a prefill of the context, then 12 new tokens
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
        # the last position's logits only, as kvbench's loop asks for them (logits_to_keep)
        cached = {lm.cache_arg: cache, "use_cache": True}
        out = lm.model(input_ids=torch.tensor([ids]), **cached, logits_to_keep=1)
        tok = out.logits[0, -1].argmax()
        for _ in range(decode):
            out = lm.model(input_ids=tok.view(1, 1), **cached)
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
    logits = loop.step(lm, cache, ids, keep=1)
    loop.greedy(lm, cache, logits[-1], decode + 1, [])
    return time.perf_counter() - start


def bench_a(prefill: int, decode: int, repeats: int) -> float:
    from kvbench import models
    from kvbench.data import load_text

    cfg = OmegaConf.load(MODEL_YAML)
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
        f"kvbench(none) {k:.3f} s, ratio {k / p:.3f}x (target <= 1.05x)"
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

    ds = OmegaConf.load(CONF / "dataset" / f"{name}.yaml")
    for key, value in {**over, "batch_size": batch_size}.items():
        ds[key] = value
    proto = protocol.get(ds.task)
    data = proto.load(ds)
    stack = Stack(
        scheduler=H2OScheduler(), budget=Budget(fraction=0.5, budget_tokens=None, sinks=4, window=32)
    )
    stack.bind(BindContext.for_model(lm))
    start = time.perf_counter()
    result = proto.evaluate(lm, stack, data.data, ds, None)
    return time.perf_counter() - start, result.metrics.score.value


def bench_c() -> None:
    from kvbench import models

    lm = models.load(OmegaConf.load(MODEL_YAML), "cpu")
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


def catalog() -> list[str]:
    """Every technique as ``role/name``: each YAML of the three roles but ``none`` and ``chain``."""
    return [
        f"{role}/{p.stem}"
        for role in ROLES
        for p in sorted((CONF / role).glob("*.yaml"))
        if p.stem not in ("none", "chain")
    ]


def _bind_context(lm, budget, seed: int):
    """``BindContext.for_model`` whether or not it takes the budget (the stack sets it on bind)."""
    from kvbench.roles import BindContext

    params = inspect.signature(BindContext.for_model).parameters
    return BindContext.for_model(lm, budget, seed) if "budget" in params else BindContext.for_model(lm, seed)


def build_cell_stack(lm, technique: str | None, budget: float, model: str = "smollm2_135m"):
    """The stack of a real cell with ``technique`` alone (None: the full cache): composed, validated, bound.

    ``model`` names the config the cell validates against (``tiny_random`` where the embedded GGUF
    package is not installed, as on a GPU node); the stack is bound to ``lm`` either way. Needs an
    active ``hydra.initialize_config_dir``. Binding may fit a calibration (cached on disk).
    """
    from hydra import compose

    from kvbench import config

    overrides = [f"budget={budget}", "dataset=pydoc", f"model={model}", "device=cpu"]
    if technique is not None:
        role, name = technique.split("/", 1)
        overrides.insert(0, f"{role}={name}")
    cfg = compose("config", overrides=overrides)
    stack = config.validate(cfg)
    stack.bind(_bind_context(lm, stack.budget, int(cfg.seed)))
    return stack


class EngineClock:
    """Time spent in ``KVCache.update``, ``attend`` and ``after_forward``, by patching the class."""

    NAMES = ("update", "attend", "after_forward")

    def __init__(self):
        self.total = 0.0

    @contextlib.contextmanager
    def installed(self):
        from kvbench.cache.engine import KVCache

        originals = {name: KVCache.__dict__[name] for name in self.NAMES}

        def timed(fn):
            def wrapper(*a, **kw):
                start = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.total += time.perf_counter() - start

            return wrapper

        for name, fn in originals.items():
            setattr(KVCache, name, timed(fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(KVCache, name, fn)


def time_stack(lm, stack, ids: list[int], decode: int, clock: EngineClock) -> dict[str, float]:
    """Prefill ``ids``, then ``decode`` greedy steps one token at a time, each timed with after_forward.

    Returns the prefill time (s), the mean decode step (s) after the first (warm-up) and the
    share of those steps spent in the cache engine.
    """
    from kvbench.eval import loop

    cache = loop.new_cache(lm, stack)
    start = time.perf_counter()
    logits = loop.forward(lm, cache, ids, keep=1)  # as a needle cell: the last position's logits
    cache.after_forward()
    prefill = time.perf_counter() - start
    tok = int(logits[-1].argmax())
    steps, engine = [], []
    for _ in range(decode):
        before = clock.total
        start = time.perf_counter()
        logits = loop.forward(lm, cache, [tok])
        cache.after_forward()
        steps.append(time.perf_counter() - start)
        engine.append(clock.total - before)
        tok = int(logits[-1].argmax())
    steps, engine = (steps[1:], engine[1:]) if len(steps) > 1 else (steps, engine)
    mean = sum(steps) / len(steps)
    return {"prefill": prefill, "decode": mean, "share": sum(engine) / sum(steps)}


def _cell(r: dict[str, float]) -> float:
    return r["prefill"] + CELL_STEPS * r["decode"]


def _row(name: str, r: dict[str, float], ratio: float = 1.0, cell: float = 1.0, full: bool = False) -> str:
    mark = "!" if ratio > TARGET_D else " "
    cmark = "!" if cell > TARGET_CELL else " "
    rtxt = " " * 8 if full else f"{ratio:6.2f}x{mark}"
    ctxt = " " * 8 if full else f"{cell:6.2f}x{cmark}"
    return f"  {name:28s} {r['decode'] * 1e3:9.2f} {rtxt} {r['prefill']:9.3f} {ctxt} {r['share'] * 100:7.1f}%"


def _median(values: list[float]) -> float:
    return statistics.median(values)


def bench_d(contexts: list[int], decode: int, budget: float, only: list[str] | None, rounds: int = 1) -> None:
    """Each technique alone against the full cache, per context length (see the module docstring).

    ``rounds`` > 1 repeats the whole pass (full cache first, every technique, full cache last) and
    prints each figure's median over the rounds, each ratio taken within its own round: a machine
    that is not quiet moves single ratios by about 0.1x."""
    from hydra import initialize_config_dir

    from kvbench import config, models
    from kvbench.data import load_text

    names = catalog()
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise SystemExit(f"--only: unknown {', '.join(unknown)}; known: {', '.join(names)}")
        names = [n for n in names if n in only]
    lm = models.load(OmegaConf.load(MODEL_YAML), "cpu")
    text = load_text({"name": "pydoc", "source": "pydoc"})
    ids = lm.codec.encode(text[: max(20000, 8 * max(contexts))])
    if len(ids) < max(contexts):
        raise SystemExit(f"the pydoc text gave {len(ids)} tokens, fewer than {max(contexts)}")
    config.register()
    clock = EngineClock()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"), clock.installed():
        failed: dict[str, str] = {}
        # Build and bind everything first: a calibration is fitted here, never inside a timing.
        for name in names:
            print(f"(d) building {name}", file=sys.stderr, flush=True)
            try:
                build_cell_stack(lm, name, budget)
            except Exception as err:  # noqa: BLE001 - reported, the others go on
                failed[name] = f"build: {type(err).__name__}: {err}".splitlines()[0]
        time_stack(lm, build_cell_stack(lm, None, budget), ids[:64], 2, clock)  # warm-up
        for ctx in contexts:
            ctx_ids = ids[:ctx]
            errors = dict(failed)
            refs, runs, spreads = [], [], []  # per round: the full cache, the techniques, the drift
            for _ in range(rounds):
                full = [time_stack(lm, build_cell_stack(lm, None, budget), ctx_ids, decode, clock)]
                rows: dict[str, dict[str, float]] = {}
                for name in names:
                    if name in errors:
                        continue
                    try:
                        stack = build_cell_stack(lm, name, budget)  # its calibration is cached by now
                        rows[name] = time_stack(lm, stack, ctx_ids, decode, clock)
                    except Exception as err:  # noqa: BLE001 - reported, the others go on
                        errors[name] = f"run: {type(err).__name__}: {err}".splitlines()[0]
                full.append(time_stack(lm, build_cell_stack(lm, None, budget), ctx_ids, decode, clock))
                refs.append({k: (full[0][k] + full[1][k]) / 2 for k in full[0]})
                spreads.append(abs(full[0]["decode"] - full[1]["decode"]) / refs[-1]["decode"])
                runs.append(rows)
            ref = {k: _median([r[k] for r in refs]) for k in refs[0]}
            spread = " ".join(f"{x * 100:.1f}%" for x in spreads)
            over = f", median of {rounds} rounds" if rounds > 1 else ""
            print(
                f"(d) context {ctx}, decode {decode} (mean of {max(decode - 1, 1)} steps), budget {budget}"
                f"{over}: full cache {ref['decode'] * 1e3:.2f} ms (first-to-last spread {spread})"
            )
            print(
                f"  {'technique':28s} {'decode ms':>9s} {'ratio':>8s} {'prefill s':>9s} "
                f"{'cell':>8s} {'store':>8s}"
            )
            print(_row(FULL, ref, full=True))
            ratios, cells = {}, {}
            for name in names:
                if name in errors:
                    print(f"  {name:28s} failed ({errors[name]})")
                    continue
                mine = [rows[name] for rows in runs]
                ratios[name] = _median([r["decode"] / f["decode"] for r, f in zip(mine, refs)])
                cells[name] = _median([_cell(r) / _cell(f) for r, f in zip(mine, refs)])
                row = {k: _median([r[k] for r in mine]) for k in mine[0]}
                print(_row(name, row, ratios[name], cells[name]))
            meet = sum(r <= TARGET_D for r in ratios.values())
            worst_cell = max(cells, key=cells.get) if cells else None
            worst = max(ratios, key=ratios.get) if ratios else None
            worst_txt = f"worst {ratios[worst]:.2f}x ({worst})" if worst else "none ran"
            fail_txt = f", {len(errors)} failed" if errors else ""
            print(
                f"  {meet}/{len(names)} techniques at most {TARGET_D}x the full cache's decode step; "
                f"{worst_txt}{fail_txt}"
            )
            if worst_cell:
                print(
                    f"  {sum(c <= TARGET_CELL for c in cells.values())}/{len(names)} at most {TARGET_CELL}x "
                    f"the full cache's cell (prefill + {CELL_STEPS} steps); worst {cells[worst_cell]:.2f}x "
                    f"({worst_cell})"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--skip-c", action="store_true")
    ap.add_argument("--only-c", action="store_true", help="run (c) alone")
    ap.add_argument("--techniques", action="store_true", help="also run (d), per technique")
    ap.add_argument("--only-d", action="store_true", help="run (d) alone")
    ap.add_argument("--contexts", default="512,2048", help="(d): context lengths, comma-separated")
    ap.add_argument("--budget", type=float, default=0.5, help="(d): the stack-wide budget")
    ap.add_argument("--only", default=None, help="(d): techniques to run, role/name, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="(d): repeat the pass, print medians")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds}: must be >= 1")
    torch.set_num_threads(2)
    if not args.only_d:
        if not args.only_c:
            bench_a(args.prefill, args.decode, args.repeats)
            if not args.skip_b:
                bench_b()
        if not args.skip_c:
            bench_c()
    if args.techniques or args.only_d:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
        only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
        bench_d(contexts, args.decode, args.budget, only, args.rounds)


if __name__ == "__main__":
    main()
