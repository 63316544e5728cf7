"""Checks on results before a report shows them: numbers that cannot be right are refused, with why.

Refused (the table shows ``refused`` instead of the number, and the reason is listed):
- a perplexity of exactly 1.0;
- a score identical, to 12 significant digits, to that of another stack of the same model and
  dataset that stores a different number of bytes (a lossless technique stores the same bytes);
- a compression that disagrees with the stored bytes: compression x stored MB is the 16-bit
  reference MB, the same for every cell of one model and dataset protocol;
- an accuracy drop against a baseline that scored other examples than the cell (its record in
  the folder has another example or token count).

Flagged, not hidden: a stack whose score is worse than a ``random`` stack's at equal bytes
(compression within 10 %). Where either ran over several seeds, their means over the seeds are
compared, and every seed's cell carries the flag.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from kvbench.report.records import _get, cell_ids, merge_seeds, repeat_key
from kvbench.report.tables import ROLES, qualified_stack

_SAME_DIGITS = 1e-12
_BYTES_TOLERANCE = 0.01
_EQUAL_BYTES = 0.10


def _group_key(record: dict) -> tuple[str, str]:
    dataset = _get(record, "identity", "dataset") or _get(record, "dataset") or {}
    protocol = {k: v for k, v in dataset.items() if k != "name"} if isinstance(dataset, dict) else {}
    return str(_get(record, "model", "name")), repr(sorted(protocol.items(), key=lambda kv: kv[0]))


def _score(record: dict) -> float | None:
    value = _get(record, "metrics", "score", "value")
    return float(value) if isinstance(value, int | float) else None


def _compression(record: dict) -> float | None:
    value = _get(record, "metrics", "compression_prefill")
    return float(value) if isinstance(value, int | float) else None


def _name(record: dict) -> str:
    return qualified_stack(record, empty="full cache")


def _is_random(record: dict) -> bool:
    return any(_get(record, "stack", r) == "random" for r in ROLES)


def refusals(records: Sequence[dict]) -> dict[str, dict[str, str]]:
    """``{cell_id: {"score" | "compression" | "accuracy_drop": reason}}`` for the numbers refused."""
    out: dict[str, dict[str, str]] = defaultdict(dict)
    done = [r for r in records if r.get("status") == "done"]
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in done:
        groups[_group_key(r)].append(r)
    for group in groups.values():
        _exact_one(group, out)
        _identical_scores(group, out)
        _bytes_agree(group, out)
        _baseline_examples(group, out)
    return dict(out)


def _exact_one(group: list[dict], out: dict[str, dict[str, str]]) -> None:
    for r in group:
        if _get(r, "metrics", "score", "name") == "perplexity" and _score(r) == 1.0:
            out[r["cell_id"]]["score"] = (
                "perplexity is exactly 1.0: no language model predicts real text perfectly"
            )


def _identical_scores(group: list[dict], out: dict[str, dict[str, str]]) -> None:
    scored: list[tuple[dict, float, float]] = []
    for r in group:
        s, b = _score(r), _get(r, "metrics", "kv_mem_mb_prefill")
        if s is not None and isinstance(b, int | float) and b > 0:
            scored.append((r, s, float(b)))
    for i, (a, sa, ba) in enumerate(scored):
        for b, sb, bb in scored[i + 1 :]:
            if abs(sa - sb) <= _SAME_DIGITS * max(abs(sa), 1.0) and abs(ba - bb) > 0.01 * max(ba, bb):
                smaller = a if ba < bb else b
                other = b if smaller is a else a
                out[smaller["cell_id"]]["score"] = (
                    f"score {sa!r} is identical to 12 digits to {_name(other)}'s (cell {other['cell_id']}), "
                    "which stores other bytes: the compressed cache was not read"
                )


def _bytes_agree(group: list[dict], out: dict[str, dict[str, str]]) -> None:
    implied = {
        r["cell_id"]: c * m
        for r in group
        if (c := _compression(r)) is not None
        and isinstance(m := _get(r, "metrics", "kv_mem_mb_prefill"), int | float)
    }
    if len(implied) < 3:
        return
    typical = statistics.median(implied.values())
    for r in group:
        value = implied.get(r["cell_id"])
        if value is not None and abs(value - typical) > _BYTES_TOLERANCE * typical:
            out[r["cell_id"]]["compression"] = (
                f"compression x stored bytes implies {value:.3f} MB of 16-bit reference cache, "
                f"the other cells {typical:.3f} MB: the compression disagrees with the stored bytes"
            )


def _baseline_examples(group: list[dict], out: dict[str, dict[str, str]]) -> None:
    baselines = [r for r in group if not _get(r, "stack", "order")]
    if len({repeat_key(r) for r in baselines}) != 1:  # none, or two settings: no one baseline
        return
    base = baselines[0]
    for r in group:
        if r is base or _get(r, "metrics", "accuracy_drop") is None:
            continue
        for key in ("n_examples", "n_scored_tokens"):
            mine, theirs = _get(r, "metrics", key), _get(base, "metrics", key)
            if mine is not None and theirs is not None and mine != theirs:
                out[r["cell_id"]]["accuracy_drop"] = (
                    f"its baseline (cell {base['cell_id']}) has {key}={theirs}, this cell {mine}: "
                    "a drop against other examples means nothing"
                )


def flags(records: Sequence[dict]) -> dict[str, str]:
    """``{cell_id: reason}`` for stacks worse than a ``random`` stack at equal bytes."""
    out: dict[str, str] = {}
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        if r.get("status") == "done" and _score(r) is not None and _compression(r):
            groups[_group_key(r)].append(r)
    for group in groups.values():
        group = merge_seeds(group)
        randoms = [r for r in group if _is_random(r)]
        for r in group:
            if _is_random(r) or not _get(r, "stack", "order"):
                continue
            higher = bool(_get(r, "metrics", "score", "higher_is_better"))
            for floor in randoms:
                c, cf = _compression(r) or 0.0, _compression(floor) or 0.0
                s, sf = _score(r) or 0.0, _score(floor) or 0.0  # both set: filtered above
                worse = s < sf if higher else s > sf
                if abs(c - cf) <= _EQUAL_BYTES * max(c, cf) and worse:
                    seeds = " (means over seeds)" if r.get("_seeds") or floor.get("_seeds") else ""
                    reason = (
                        f"worse than {_name(floor)} at equal bytes{seeds} ({s:.4g} vs {sf:.4g} at "
                        f"{c:.2f}x vs {cf:.2f}x compression)"
                    )
                    out.update(dict.fromkeys(cell_ids(r), reason))
                    break
    return out


def render(records: Sequence[dict]) -> str | None:
    """The ``Sanity checks`` section: each refused number and each flag with its reason; None if clean."""
    refused = refusals(records)
    flagged = flags(records)
    if not refused and not flagged:
        return None
    by_id = {str(r.get("cell_id")): r for r in records}
    lines = ["## Sanity checks", ""]
    for cell_id in sorted(refused):
        for what, reason in sorted(refused[cell_id].items()):
            lines.append(f"- refused {what} of {_name(by_id[cell_id])} (cell `{cell_id}`): {reason}")
    by_stack: dict[tuple[str, str], list[str]] = defaultdict(list)  # one line for a stack's seeds
    for cell_id in sorted(flagged):
        by_stack[(_name(by_id[cell_id]), flagged[cell_id])].append(f"`{cell_id}`")
    for (name, reason), cells in by_stack.items():
        cell = "cells" if len(cells) > 1 else "cell"
        lines.append(f"- flagged {name} ({cell} {', '.join(cells)}): {reason}")
    return "\n".join(lines)


def annotate(records: Sequence[dict]) -> list[dict]:
    """Copies of ``records`` carrying ``_refused`` and ``_flag`` for the tables to show."""
    refused = refusals(records)
    flagged = flags(records)
    out = []
    for r in records:
        cell_id = str(r.get("cell_id"))
        extra = {"_refused": refused.get(cell_id, {}), "_flag": flagged.get(cell_id)}
        out.append({**r, **extra})
    return out
