"""Plots of result records (matplotlib, no display): needle heatmaps and the score-compression view.

Pure functions of records, like the tables: each returns a matplotlib Figure, or None when the
records do not have the axes the plot needs. Callers save or log it and close it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvbench.report.records import merge_seeds  # noqa: E402
from kvbench.report.tables import qualified_stack  # noqa: E402


def stack_name(record: dict) -> str:
    """Role-qualified stack name, e.g. ``compressor/quantized + scheduler/h2o``; ``full cache``."""
    return qualified_stack(record, empty="full cache")


def needle_grid(record: dict) -> tuple[list[int], list[float], list[list[float | None]]] | None:
    """Accuracy per (context length, depth), averaged over haystack offsets; None if not a needle cell."""
    examples = record.get("examples") or []
    if not examples or "depth" not in examples[0] or "length" not in examples[0]:
        return None
    hits: dict[tuple[int, float], list[float]] = defaultdict(list)
    for case in examples:
        hits[(int(case["length"]), float(case["depth"]))].append(float(case["correct"]))
    lengths = sorted({k[0] for k in hits})
    depths = sorted({k[1] for k in hits})
    grid = [
        [sum(hits[(n, d)]) / len(hits[(n, d)]) if (n, d) in hits else None for n in lengths] for d in depths
    ]
    return lengths, depths, grid


def needle_heatmap(record: dict) -> Figure | None:
    """Needle accuracy as a depth x context-length heatmap (cells annotated), or None."""
    found = needle_grid(record)
    if found is None:
        return None
    lengths, depths, grid = found
    values = [[float("nan") if v is None else v for v in row] for row in grid]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.5 * len(depths)))
    image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context tokens")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v is not None:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    n = len(record.get("examples") or [])
    ax.set_title(f"{stack_name(record)}\nneedle accuracy, n={n}", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.05)
    fig.tight_layout()
    return fig


def _compression(record: dict) -> float | None:
    metrics = record.get("metrics") or {}
    value = metrics.get("compression_mean")
    return value if value is not None else metrics.get("compression_prefill")


def pareto_front(points: Sequence[tuple[float, float]], higher_is_better: bool) -> list[int]:
    """Indices of the points no other point beats on both compression (higher) and score."""
    front = []
    for i, (c, s) in enumerate(points):
        beaten = any(
            c2 >= c and (s2 >= s if higher_is_better else s2 <= s) and (c2, s2) != (c, s)
            for j, (c2, s2) in enumerate(points)
            if j != i
        )
        if not beaten:
            front.append(i)
    return front


def pareto(records: Sequence[dict]) -> Figure | None:
    """Score against achieved compression for every done stack of one model and dataset.

    The frontier is drawn, the full cache is a star and ``random`` stacks (the sanity floor) are
    crosses. A setting run over several seeds is one point, its mean, with the seeds' range as an
    error bar. None when fewer than two stacks have both numbers.
    """
    done = merge_seeds(
        [
            r
            for r in records
            if r.get("status") == "done"
            and _compression(r) is not None
            and ((r.get("metrics") or {}).get("score") or {}).get("value") is not None
        ]
    )
    if len(done) < 2:
        return None
    score: dict[str, Any] = done[0]["metrics"]["score"]
    higher = bool(score.get("higher_is_better"))
    points = [(float(_compression(r) or 0.0), float(r["metrics"]["score"]["value"])) for r in done]
    front = set(pareto_front(points, higher))
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for i, (r, (c, s)) in enumerate(zip(done, points)):
        name = stack_name(r)
        seeds = (r.get("_seeds") or {}).get("n")
        if name == "full cache":
            ax.scatter([c], [s], marker="*", s=160, color="black", zorder=3, label="full cache")
        elif "/random" in name:
            ax.scatter([c], [s], marker="x", s=60, color="tab:red", zorder=3)
        else:
            ax.scatter([c], [s], s=28, color="tab:blue" if i in front else "tab:gray", zorder=2)
        if span := (r.get("_seeds") or {}).get("score"):
            ax.errorbar([c], [s], yerr=[[s - span[0]], [span[1] - s]], fmt="none", color="gray", lw=0.8)
        if i in front or name == "full cache" or "/random" in name:
            label = f"{name} ({seeds} seeds)" if seeds else name
            ax.annotate(label, (c, s), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ordered = sorted(front, key=lambda i: points[i][0])
    ax.plot([points[i][0] for i in ordered], [points[i][1] for i in ordered], color="tab:blue", lw=1)
    ax.set_xlabel("compression × (16-bit reference bytes / stored bytes)")
    ax.set_ylabel(f"{score.get('name')} ({'higher' if higher else 'lower'} is better)")
    model = (done[0].get("model") or {}).get("name")
    dataset = (done[0].get("dataset") or {}).get("name")
    floor = ", random as ×" if any("/random" in stack_name(r) for r in done) else " (no random stack swept)"
    ax.set_title(f"{model} · {dataset}: {len(done)} stacks, frontier in blue{floor}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def categories(records: Sequence[dict]) -> Figure | None:
    """LongBench: each category's mean score against achieved compression, a series per category.

    One marker per stack in each series (a setting over seeds is its mean), not joined: the points
    are different stacks. Each stack is named once, beside its best category. None when the records
    have no categories or fewer than two stacks have them.
    """
    done = merge_seeds(
        [
            r
            for r in records
            if r.get("status") == "done"
            and _compression(r) is not None
            and (r.get("metrics") or {}).get("categories")
        ]
    )
    if len(done) < 2:
        return None
    names = list(dict.fromkeys(c for r in done for c in r["metrics"]["categories"]))
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    markers = itertools.cycle("osD^vP*X")
    for name in names:
        points = sorted(
            (float(_compression(r) or 0.0), float(v))
            for r in done
            if isinstance(v := r["metrics"]["categories"].get(name), int | float)
        )
        ax.plot([p[0] for p in points], [p[1] for p in points], ls="none", marker=next(markers), label=name)
    for r in done:
        scores = [v for v in r["metrics"]["categories"].values() if isinstance(v, int | float)]
        if scores:
            where = (float(_compression(r) or 0.0), max(scores))
            ax.annotate(stack_name(r), where, fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("compression × (16-bit reference bytes / stored bytes)")
    ax.set_ylabel("category mean score (higher is better)")
    model = (done[0].get("model") or {}).get("name")
    dataset = (done[0].get("dataset") or {}).get("name")
    counted = f"{len(names)} categor{'y' if len(names) == 1 else 'ies'}"
    ax.set_title(f"{model} · {dataset}: {counted}, {len(done)} stacks", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def throughput_vs_compression(records: Sequence[dict]) -> Figure | None:
    """Decode throughput against achieved compression, one point per stack; None if < 2 stacks."""
    points = [
        (float(c), float(t), stack_name(r))
        for r in records
        if r.get("status") == "done"
        and (c := _compression(r)) is not None
        and (t := (r.get("metrics") or {}).get("throughput_tok_s")) is not None
    ]
    if len(points) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for c, t, name in points:
        marker, color = ("*", "black") if name == "full cache" else ("o", "tab:blue")
        ax.scatter([c], [t], marker=marker, s=120 if marker == "*" else 24, color=color)
    ax.set_xlabel("compression ×")
    ax.set_ylabel("decode throughput (tokens/s)")
    ax.set_title(f"throughput against compression: {len(points)} stacks (full cache: star)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def memory_vs_context(records: Sequence[dict]) -> Figure | None:
    """Stored KV bytes after prefill against context length, a line per stack (needle cells)."""
    lines = []
    for r in records:
        cases = [c for c in r.get("examples") or [] if "context_tokens" in c and "bytes_prefill" in c]
        if r.get("status") != "done" or not cases:
            continue
        by_length: dict[int, list[float]] = defaultdict(list)
        for c in cases:
            by_length[int(c["context_tokens"])].append(float(c["bytes_prefill"]) / 2**20)
        xs = sorted(by_length)
        if len(xs) >= 2:
            lines.append((stack_name(r), xs, [sum(by_length[x]) / len(by_length[x]) for x in xs]))
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for name, xs, ys in lines:
        ax.plot(xs, ys, marker="o", ms=3, lw=1, label=name, color="black" if name == "full cache" else None)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("KV cache after prefill (MB)")
    ax.set_title("KV memory against context length", fontsize=9)
    if len(lines) <= 12:
        ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _mean_map(cases: Sequence[dict], key: str) -> list[list[float]] | None:
    maps = [c[key] for c in cases if c.get(key)]
    if not maps:
        return None
    layers, heads = len(maps[0]), len(maps[0][0])
    return [[sum(m[i][j] for m in maps) / len(maps) for j in range(heads)] for i in range(layers)]


def retention_map(record: dict) -> Figure | None:
    """Per layer x KV head: the share of the context a needle cell kept, and of the needle's tokens."""
    cases = record.get("examples") or []
    kept = _mean_map(cases, "kept_by_layer_head")
    if kept is None:
        return None
    needle = _mean_map(cases, "needle_kept_by_layer_head")
    panels = [("context tokens kept", kept)] + ([("needle tokens kept", needle)] if needle else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(2.2 + 2.4 * len(panels), 1.5 + 0.12 * len(kept)))
    for ax, (title, grid) in zip(list(axes) if len(panels) > 1 else [axes], panels):
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax, fraction=0.08)
    fig.suptitle(f"{stack_name(record)}: mean over {len(cases)} needle cases", fontsize=9)
    fig.tight_layout()
    return fig
