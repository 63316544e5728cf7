"""RankKV's seed table: method x layer allocation x budget, when a folder sweeps allocations.

A pure function of the records, like :mod:`kvbench.report.tables`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbench.report.records import _get, merge_seeds
from kvbench.report.tables import ATTN, DASH, ROLES, _first, _fixed, _n, format_score, with_settings


def _allocation(record: dict) -> tuple[str, str] | None:
    """``(role/technique, allocation)`` of the technique that splits its budget across layers."""
    for role in ROLES:
        allocation = _get(record, "config", role, "allocation")
        if allocation is not None:
            return f"{role}/{_get(record, 'stack', role)}", str(allocation)
    return None


def allocation_records(records: Sequence[dict]) -> list[dict]:
    """The done records of techniques that split their budget across layers (RankKV's table)."""
    return [r for r in records if r.get("status") == "done" and _allocation(r) is not None]


def render_allocations(records: Sequence[dict]) -> str | None:
    """RankKV's table, method x allocation x budget, when the records sweep two allocations or more.

    Columns as in RankKV's seed table: perplexity (or the task score), TTFT, TPOT, throughput,
    peak memory and the KV cache's stored MB; beside TPOT, kvbench's decode attention per layer
    (``decode_attn_ms``). None when there is nothing to compare.
    """
    rows = [(a, r) for r in merge_seeds(allocation_records(records)) if (a := _allocation(r)) is not None]
    if len({a[1] for a, _ in rows}) < 2:
        return None
    header = ["Method", "Allocation", "Budget", _first(records, "metrics", "score", "name") or "Score"]
    header += ["TTFT (s)", "TPOT (ms)", ATTN, "Throughput (tok/s)", "Peak memory (MB)", "KV cache (MB)", "n"]
    order = {"uniform": 0, "pyramid": 1, "rankkv": 2, "random": 3, "inverse": 4}
    key = lambda item: (item[0][0], float(_get(item[1], "config", "budget") or 0), order.get(item[0][1], 9))
    table, ordered = [], []
    for (method, allocation), r in sorted(rows, key=key):
        ordered.append(r)
        m = r.get("metrics") or {}
        table.append(
            [
                method,
                allocation,
                str(_get(r, "config", "budget") or DASH),
                format_score(m.get("score")),
                _fixed(m.get("ttft_s"), 3),
                _fixed(m.get("tpot_s"), 1, scale=1000.0),
                _fixed(m.get("decode_attn_ms"), 3),
                _fixed(m.get("throughput_tok_s"), 1),
                _fixed(m.get("peak_memory_mb"), 0),
                _fixed(m.get("kv_mem_mb_peak"), 2),
                _n(r),
            ]
        )
    columns = {"budget", *(f"{role}.allocation" for role in ROLES)}  # shown in their own columns
    return "### Layer allocation (RankKV's table)\n\n" + with_settings(
        header, table, "lllrrrrrrrr", ordered, columns
    )
