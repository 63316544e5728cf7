"""The technique catalog: its docs generated from the YAMLs, and every technique at a matched compression.

Docs. ``--write`` regenerates, from ``conf/<role>/*.yaml`` alone, ``docs/techniques.md`` (one line
per technique: its leading comment, paper, knobs and example) and the option table of README.md
between ``<!-- catalog:start -->`` and ``<!-- catalog:end -->`` (each technique's name and the first
clause of its leading comment); ``--check`` exits 1 naming the stale files (tests/test_catalog.py
runs it). It loads neither torch nor the model:

    python scripts/catalog_table.py --write
    python scripts/catalog_table.py --check

Benchmark. For each technique a knob is tuned (bisection on a continuous knob, or the closest of a
list) until the measured compression at the end of a 512-token prefill of the evaluated text is within
``--tolerance`` of ``--target``; techniques that keep every token (routers, ``quest``) are
matched on the fraction of stored bytes each query reads instead, and ``flexgen`` is lossless
placement (compression 1x by definition). A technique missing from ``CATALOG`` below is tuned on
the budget if it evicts tokens, and otherwise run at its YAML's defaults. Then each matched stack
runs the perplexity and the needle protocols through kvbench's runner (records in
``results/<name>/``), and a markdown table is printed from those records (and written to
``results/<name>/CATALOG.md``): achieved compression, reads, KV hit, fidelity, ΔPPL and needle
accuracy with their intervals.

    python scripts/catalog_table.py --target 1.5 --dtype bfloat16
    python scripts/catalog_table.py --name catalog --table-only   # re-render from the records
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_technique_docs  # noqa: E402  (docs/techniques.md's renderer; tests/test_docs.py runs it too)

ROLES = ("router", "compressor", "scheduler")
WRITE = "python scripts/catalog_table.py --write"
ROLE_TEXT = {
    "router": "which experts/shards of the cache a query reads",
    "compressor": "how kept tokens are stored, or which are kept once",
    "scheduler": "which tokens stay, are read, or where they live",
}
README_START, README_END = "<!-- catalog:start", "<!-- catalog:end -->"


def technique_yamls(role: str) -> list[Path]:
    """Every technique YAML of a role (its file stem is the technique's name), ``none`` aside."""
    return [p for p in sorted((ROOT / "conf" / role).glob("*.yaml")) if p.stem != "none"]


def first_clause(path: Path) -> str:
    """The leading comment's first clause: up to its first ``: `` or ``. `` outside parentheses."""
    what = gen_technique_docs.describe(path)["what"]
    depth = 0
    for i, ch in enumerate(what):
        depth += (ch == "(") - (ch == ")")
        if depth or what[i + 1 : i + 2] not in (" ", ""):
            continue
        if ch == ":" or ch == "." and not what[: i + 1].endswith(("e.g.", "i.e.")):
            return what[:i]
    return what.rstrip(".")


def readme_block() -> str:
    """README.md's option table, markers included."""
    lines = [
        f"{README_START} (generated from conf/<role>/*.yaml by `{WRITE}`) -->",
        "",
        "| role | option | what it is ([docs/techniques.md](docs/techniques.md) has the rest) |",
        "|---|---|---|",
    ]
    for role in ROLES:
        for i, path in enumerate(technique_yamls(role)):
            head = f"{role}: {ROLE_TEXT[role]}" if i == 0 else ""
            lines.append(f"| {head} | `{path.stem}` | {first_clause(path)} |")
    return "\n".join([*lines, "", README_END])


def catalog_docs() -> dict[Path, str]:
    """What ``--write`` writes: docs/techniques.md and README.md with its option table regenerated."""
    readme = (ROOT / "README.md").read_text()
    start, end = readme.find(README_START), readme.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md: no {README_START} -->...{README_END} markers around the option table")
    readme = readme[:start] + readme_block() + readme[end + len(README_END) :]
    return {ROOT / "docs" / "techniques.md": gen_technique_docs.render(), ROOT / "README.md": readme}


def write_docs(check: bool) -> int:
    stale = [p for p, text in catalog_docs().items() if not p.exists() or p.read_text() != text]
    if check:
        if stale:
            names = " and ".join(str(p.relative_to(ROOT)) for p in stale)
            print(f"{names} stale against conf/<role>/*.yaml: run {WRITE}")
        return 1 if stale else 0
    for path, text in catalog_docs().items():
        if path in stale:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__" and {"--write", "--check"} & set(sys.argv):
    sys.exit(write_docs(check="--check" in sys.argv))  # the docs need neither torch nor a model

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.utils import get_class  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))

from kvbench import config, models, run  # noqa: E402
from kvbench.data import load_text  # noqa: E402
from kvbench.eval import loop  # noqa: E402
from kvbench.report.tables import render_table  # noqa: E402
from kvbench.roles import BindContext  # noqa: E402

# (role, name, tuning): tuning is ("budget", lo, hi) for a bisection on the stack budget,
# ("knob", key, [values]) for the closest value of a technique knob, ("reads", key, [values])
# to match the read fraction, or None (nothing to tune); an optional fourth item holds fixed knobs.
CATALOG: list[tuple[str, str, tuple | None]] = [
    ("scheduler", "streaming_llm", ("budget", 0.05, 1.0)),
    ("scheduler", "h2o", ("budget", 0.05, 1.0)),
    ("scheduler", "lru", ("budget", 0.05, 1.0)),
    ("scheduler", "lru_plus", ("budget", 0.05, 1.0)),
    ("scheduler", "adakv", ("budget", 0.05, 1.0)),
    ("scheduler", "duo_attention", ("budget", 0.05, 1.0)),
    ("scheduler", "quest", ("reads", "budget", [0.5, 0.6, 0.667, 0.75])),
    ("scheduler", "flexgen", None),
    ("compressor", "snapkv", ("budget", 0.05, 1.0)),
    ("compressor", "pyramidkv", ("budget", 0.05, 1.0)),
    ("compressor", "chunkkv", ("budget", 0.05, 1.0)),
    ("compressor", "fastv", ("budget", 0.01, 1.0)),
    ("compressor", "random", ("budget", 0.05, 1.0)),
    ("compressor", "distillation", ("budget", 0.05, 1.0)),
    ("compressor", "pikv", ("budget", 0.05, 1.0)),
    ("compressor", "quantized", ("knob", "bits", [8, 4, 3, 2])),
    ("compressor", "pyramid", ("knob", "bits_min", [8, 4, 3, 2])),
    ("compressor", "svd", ("knob", "key_rank", [4, 8, 12, 16, 24, 32, 48])),
    ("compressor", "lora", ("knob", "key_rank", [4, 8, 12, 16, 24, 32, 48])),
    ("compressor", "lora_plus_plus", ("knob", "key_rank", [4, 8, 12, 16, 24, 32, 48])),
    ("compressor", "pruning", ("knob", "keep_ratio", [0.1, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6])),
    ("router", "base", ("reads", "router.top_k", [4, 5, 6])),
    ("router", "topk_balanced", ("reads", "router.top_k", [4, 5, 6])),
    ("router", "adaptive", ("reads", "router.temperature", [1.5, 2, 2.5, 3, 3.5, 4], ["router.k_max=8"])),
    ("router", "pikv", ("reads", "router.top_k", [4, 5, 6])),
    ("router", "eplb", ("reads", "router.top_k", [4, 5, 6])),
    ("router", "hierarchical", ("reads", "router.top_k", [8, 9, 10, 11], ["router.top_groups=3"])),
]


def catalog() -> list[tuple[str, str, tuple | None]]:
    """``CATALOG``, then every technique YAML it does not list: tuned on the budget if it evicts tokens
    (its class's flags), else run at its YAML's defaults."""
    listed = {(role, name) for role, name, _ in CATALOG}
    extra = []
    for role in ROLES:
        for path in technique_yamls(role):
            if path.stem != "chain" and (role, path.stem) not in listed:
                flags = get_class(yaml.safe_load(path.read_text())["_target_"]).flags
                extra.append((role, path.stem, ("budget", 0.05, 1.0) if flags.evicts_tokens else None))
    return [*CATALOG, *extra]


def compose_cell(overrides: list[str]):
    return compose("config", overrides=overrides)


def measure(cfg, lm, ids) -> tuple[float, float | None]:
    """Compression at the end of the prefill, and the read fraction of one scored chunk."""
    stack = config.validate(cfg)
    stack.bind(BindContext.for_model(lm, int(cfg.seed)))
    cache = loop.new_cache(lm, stack)
    loop.step(lm, cache, ids[: cfg.dataset.prefill])
    compression = cache.reference_bytes() / cache.nbytes()
    loop.step(lm, cache, ids[cfg.dataset.prefill : cfg.dataset.prefill + cfg.dataset.chunk])
    m = stack.metrics()
    reads = None
    for tech in m.values():
        reads = tech.get("read_fraction", tech.get("routable_read_fraction", reads))
    return compression, reads


def bisect(
    cell: list[str], key: str, lo: float, hi: float, lm, ids, target: float, tol: float, integer=False
):
    """Bisect one knob whose larger values keep more (lower compression); the closest trial."""
    best = None
    for _ in range(8):
        mid = (lo + hi) // 2 if integer else round((lo + hi) / 2, 4)
        over = [*cell, f"{key}={int(mid) if integer else mid}"]
        got = measure(compose_cell(over), lm, ids)
        if best is None or abs(got[0] - target) < abs(best[1][0] - target):
            best = (over, got)
        if abs(got[0] / target - 1) <= tol / 2 or (integer and hi - lo <= 1):
            break
        lo, hi = (mid, hi) if got[0] > target else (lo, mid)
    return best


def tune(base: list[str], role: str, name: str, tuning, lm, ids, target: float, tol: float):
    """The overrides that bring the measured compression (or reads) closest to the target.

    A discrete knob (bits, ranks) rarely lands within the tolerance; then its smallest setting
    that still compresses at least ``target`` is kept, and the full-precision window (KIVI's
    residual length R, the one window of docs/methods.md) is bisected to bring it down to the target.
    """
    cell = [*base, f"{role}={name}", *(tuning[3] if tuning and len(tuning) > 3 else [])]  # fixed knobs
    if tuning is None:
        return cell, measure(compose_cell(cell), lm, ids)
    kind = tuning[0]
    if kind == "budget":
        best = bisect(cell, "budget", tuning[1], tuning[2], lm, ids, target, tol)
        if best[1][0] > target * (1 + tol / 2):  # it also quantizes (pikv): even budget 1 compresses more
            window = next(int(o.split("=")[1]) for o in base if o.startswith("window="))
            over = [*(o for o in cell if not o.startswith("window=")), "budget=1.0"]
            return bisect(over, "window", window, len(ids) - 64, lm, ids, target, tol, integer=True)
        return best
    key, values = tuning[1], tuning[2]
    full_key = key if "." in key or key == "budget" else f"{role}.{key}"
    trials = []
    for value in values:
        over = [*cell, f"{full_key}={value}"]
        got = measure(compose_cell(over), lm, ids)
        if kind == "reads":
            trials.append((abs((got[1] or 1.0) - 1 / target), over, got))
        else:
            trials.append((abs(got[0] - target), over, got))
    if kind == "knob":
        above = [t for t in trials if t[2][0] >= target]
        pick = min(above, key=lambda t: t[2][0]) if above else min(trials, key=lambda t: t[0])
        if abs(pick[2][0] / target - 1) > tol / 2 and above:
            window = next(int(o.split("=")[1]) for o in base if o.startswith("window="))
            over = [o for o in pick[1] if not o.startswith("window=")]
            return bisect(over, "window", window, len(ids) - 64, lm, ids, target, tol, integer=True)
        return pick[1], pick[2]
    trials.sort(key=lambda t: t[0])
    return trials[0][1], trials[0][2]


def _fmt(x, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def technique_of(record: dict) -> str:
    names = [
        f"{r}/{n}"
        for r in ("router", "compressor", "scheduler")
        if (n := record["stack"].get(r)) not in (None, "none")
    ]
    return names[0] if names else "full cache"


def _same_number(a, b: str) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def settings_match(record: dict, overrides: list[str]) -> bool:
    """True when every ``key=value`` override holds in the record's resolved config."""
    for item in overrides:
        key, value = item.split("=", 1)
        node = record["config"]
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None or str(node) != value and not _same_number(node, value):
            return False
    return True


def catalog_table(records: list[dict], matched: dict[str, dict]) -> str:
    """One row per technique: its matched settings, then perplexity and needle figures side by side.

    Compression is 16-bit reference bytes / stored bytes at the end of the prefill (perplexity
    windows), and at the end of each needle context; reads are the fraction of visible stored tokens
    a query attends to, and the bytes it reads per decode step summed over layers.
    """
    by: dict[str, dict[str, dict]] = {}
    for r in records:
        tech = technique_of(r)
        if tech in matched and not settings_match(r, matched[tech]["overrides"][1:]):
            continue  # an earlier tuning of the same technique
        by.setdefault(tech, {})[r["dataset"]["task"]] = r
    head = (
        "| technique | settings | compression (ppl / needle) | reads: fraction, KB/step | KV hit "
        "| KL | top-1 | PPL | ΔPPL % [95% CI] | needle % [95% CI] (n) |"
    )
    lines = [head, "|" + "---|" * 10]
    for tech in ["full cache", *matched]:
        ppl, ndl = by.get(tech, {}).get("perplexity"), by.get(tech, {}).get("needle")
        if ppl is None:
            continue
        m = ppl["metrics"]
        tm = next(iter(m.get("techniques", {}).values()), {})
        frac = tm.get("read_fraction")
        kb = tm.get("bytes_read_per_step")
        drop = m.get("accuracy_drop") or {}
        nd = ndl["metrics"] if ndl else {}
        score = nd.get("score") or {}
        needle = (
            f"{100 * score['value']:.0f} [{100 * score['ci_low']:.0f}, {100 * score['ci_high']:.0f}] "
            f"({nd['n_examples']})"
            if score
            else "—"
        )
        ci = f" [{drop['ci_low']:+.1f}, {drop['ci_high']:+.1f}]" if drop else ""
        lines.append(
            f"| {tech} | {' '.join(matched.get(tech, {}).get('overrides', [])[1:]) or '—'} "
            f"| {_fmt(m['compression_prefill'], '.2f')} / {_fmt(nd.get('compression_prefill'), '.2f')} "
            f"| {_fmt(frac, '.2f')}, {_fmt(kb / 1024 if kb else None, '.0f')} "
            f"| {_fmt(m.get('kv_hit'))} | {_fmt(m.get('kl'), '.4f')} | {_fmt(m.get('top1_agreement'))} "
            f"| {m['score']['value']:.3f} | {_fmt(drop.get('value'), '+.2f')}{ci} | {needle} |"
        )
    return "\n".join(lines)


def render_saved(name: str) -> str:
    out = ROOT / "results" / name
    matched = json.loads((out / "matched.json").read_text())
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "matched.json"]
    records = [r for r in records if r.get("status") == "done"]
    table = catalog_table(records, matched)
    (out / "CATALOG.md").write_text(table + "\n")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=float, default=1.5, help="compression to match (x, vs 16-bit K/V)")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--name", default="catalog")
    ap.add_argument("--only", default="", help="comma list of role/name to run (default: all)")
    ap.add_argument("--skip-needle", action="store_true")
    ap.add_argument("--table-only", action="store_true", help="re-render results/<name>/CATALOG.md")
    ap.add_argument("--write", action="store_true", help="regenerate docs/techniques.md and README's table")
    ap.add_argument("--check", action="store_true", help="exit 1 if either is stale")
    args = ap.parse_args()
    if args.table_only:
        print(render_saved(args.name))
        return

    config.register()
    base = [f"model.dtype={args.dtype}", f"name={args.name}", "window=32", "sinks=4"]
    ppl = ["dataset=pydoc", "dataset.windows=8"]  # 8 windows x 8 chunks x 32 = 2048 scored tokens
    needle = ["dataset=needle"]  # the default grid: 3 lengths x 5 depths x 2 haystack offsets
    wanted = {w for w in args.only.split(",") if w}
    out = ROOT / "results" / args.name
    out.mkdir(parents=True, exist_ok=True)
    saved = ROOT / "results" / args.name / "matched.json"
    matched: dict[str, dict] = json.loads(saved.read_text()) if saved.exists() else {}  # --only adds
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        probe_cfg = compose_cell([*base, *ppl])
        lm = models.load(probe_cfg.model, "cpu")
        ids = lm.codec.encode(load_text(probe_cfg.dataset))[: probe_cfg.dataset.prefill + 64]
        records = []
        for role, name, tuning in catalog():
            if wanted and f"{role}/{name}" not in wanted:
                continue
            cell, (compression, reads) = tune(
                [*base, *ppl], role, name, tuning, lm, ids, args.target, args.tolerance
            )
            knobs = [o for o in cell if o not in base and o not in ppl]
            matched[f"{role}/{name}"] = {
                "overrides": knobs,
                "prefill_compression": compression,
                "read_fraction": reads,
            }
            print(f"{role}/{name}: {knobs} -> {compression:.3f}x reads {reads}", flush=True)
            records.append(run.run(compose_cell(cell)))
            if not args.skip_needle:
                keys = {o.split("=")[0] for o in knobs}
                kept = [o for o in base if o.split("=")[0] not in keys]
                records.append(run.run(compose_cell([*kept, *needle, *knobs])))
        for tag in ("perplexity", "needle"):
            if args.skip_needle and tag == "needle":
                continue
            base_cfg = compose_cell([*base, *(ppl if tag == "perplexity" else needle)])
            records.append(run.run(base_cfg))
    (out / "matched.json").write_text(json.dumps(matched, indent=2))
    print(render_table([r for r in records if r is not None]))
    print(render_saved(args.name))
    bad = [
        k
        for k, v in matched.items()
        if math.isfinite(v["prefill_compression"])
        and v["read_fraction"] is None
        and abs(v["prefill_compression"] / args.target - 1) > args.tolerance
    ]
    if bad:
        print(f"not matched within {args.tolerance:.0%}: {', '.join(bad)}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
