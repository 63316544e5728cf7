"""Reading result records: fields, the command that reruns a cell, and settings repeated over seeds.

Pure functions of records (the schema written by ``kvbench.results``), shared by the tables, the
sanity checks and the plots.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def _get(record: Any, *keys: str) -> Any:
    """Returns ``record[k0][k1]...``, or None where a level is missing or not a dict."""
    for key in keys:
        if not isinstance(record, dict):
            return None
        record = record.get(key)
    return record


def repeat_key(record: dict) -> str:
    """What a cell measures, its seeds left out: records with one key repeat one setting over seeds.

    The run's ``seed`` and every technique's ``seed`` knob are left out of the record's identity.
    A record without an identity is its own setting (its cell id).
    """
    ident = record.get("identity")
    if not isinstance(ident, dict) or not ident:
        return f"cell:{record.get('cell_id')}"
    ident = {k: v for k, v in ident.items() if k != "seed"}
    if isinstance(stack := ident.get("stack"), dict):
        ident["stack"] = {
            role: {k: v for k, v in node.items() if k != "seed"} if isinstance(node, dict) else node
            for role, node in stack.items()
        }
    return json.dumps([ident, record.get("stack")], sort_keys=True, default=str)


def _numbers(values: Sequence[Any]) -> list[float] | None:
    """The values as floats when every one is a number, else None (a seed that did not measure it)."""
    numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return numbers if numbers and len(numbers) == len(values) else None


def _mean(values: Sequence[Any]) -> float | None:
    numbers = _numbers(values)
    return sum(numbers) / len(numbers) if numbers else None


def _span(values: Sequence[Any]) -> list[float] | None:
    numbers = _numbers(values)
    return [min(numbers), max(numbers)] if numbers else None


def _mean_value(values: Sequence[Any]) -> Any:
    """The seeds' values of one metric as one: numbers and ``value`` fields averaged, mappings
    merged key by key (a LongBench task's score, a bucket's); intervals over examples are dropped."""
    first = values[0]
    if isinstance(first, dict) and "value" in first:
        inner = [v.get("value") if isinstance(v, dict) else None for v in values]
        merged = {**first, "value": _mean(inner)}
        merged.update({k: None for k in ("ci_low", "ci_high") if k in first})
        return merged
    if isinstance(first, dict):
        return {k: _mean_value([v.get(k) if isinstance(v, dict) else None for v in values]) for k in first}
    if isinstance(first, int | float) and not isinstance(first, bool):
        return first if all(v == first for v in values) else _mean(values)  # n_examples stays an int
    return first


def _mean_metrics(group: Sequence[dict]) -> dict[str, Any]:
    """Metrics averaged over seeds (see :func:`_mean_value`)."""
    return _mean_value([r.get("metrics") or {} for r in group])


def merge_seeds(records: Sequence[dict]) -> list[dict]:
    """One record per setting: done records that differ only in their seeds become one.

    A merged record is a copy of the first seed's record with the metrics averaged over the seeds
    and ``_seeds``: ``n``, the seeds' ``cell_ids`` and ``commands``, and the ``score`` and ``drop``
    ranges ``[min, max]`` over them. Refusals and flags of any seed carry over. Order is kept.

    Args:
        records: Done records (of one model and dataset, usually).

    Returns:
        The records, repeats over seeds merged.
    """
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(repeat_key(record), []).append(record)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        seeds = {
            "n": len(group),
            "cell_ids": sorted(str(r.get("cell_id")) for r in group),
            "commands": {str(r.get("cell_id")): cell_command(r) for r in group},
            "score": _span([_get(r, "metrics", "score", "value") for r in group]),
            "drop": _span([_get(r, "metrics", "accuracy_drop", "value") for r in group]),
        }
        refused = {k: v for r in group for k, v in (r.get("_refused") or {}).items()}
        flag = next((r["_flag"] for r in group if r.get("_flag")), None)
        merged = {**group[0], "metrics": _mean_metrics(group), "_seeds": seeds}
        out.append({**merged, "_refused": refused, "_flag": flag})
    return out


def cell_ids(record: dict) -> list[str]:
    """The config hashes behind a row: the record's cell id, or every seed's of a merged record."""
    return list(_get(record, "_seeds", "cell_ids") or [str(record.get("cell_id"))])


def cell_command(record: dict) -> str | None:
    """The command that reruns one cell (its overrides), as recorded by the runner."""
    command = record.get("command")
    return f"python -m kvbench {command}".rstrip() if isinstance(command, str) else None


def commands_by_cell(record: dict) -> dict[str, str | None]:
    """``{cell id: command}`` of a record, or of each seed of a merged one."""
    return _get(record, "_seeds", "commands") or {str(record.get("cell_id")): cell_command(record)}
