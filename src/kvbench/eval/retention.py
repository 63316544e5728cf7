"""Where the kept tokens went: per layer and KV head, the share of the context still stored, and the
share of the needle's tokens among them (needle protocol, measured right after the context's prefill
and compression, before the question).

Counted from the stored positions themselves (a merged unit counts every token it merged), so a
technique that keeps everything (a router, ``quest``, ``flexgen``'s tiers) reads 1.0.
"""

from __future__ import annotations

import torch

from kvbench.cache.engine import KVCache
from kvbench.cache.segments import flat_rows


def _row_positions(store, seq: int) -> list[torch.Tensor]:
    """Stored original positions of sequence ``seq``, one tensor per KV head."""
    rows = range(seq * store.kv_heads, (seq + 1) * store.kv_heads)
    parts: list[list[torch.Tensor]] = [[] for _ in rows]
    for seg in store.segments:
        unit_rows, pos = flat_rows(seg)
        merged = seg.members()
        if merged is None:
            owner = unit_rows
        else:  # every member position belongs to its unit's head-row
            pos, owner = merged[0], unit_rows[merged[1]]
        for i, r in enumerate(rows):
            parts[i].append(pos[owner == r])
    return [torch.cat(p).unique() if p else torch.empty(0, dtype=torch.long) for p in parts]


def retention(
    cache: KVCache, context_len: int, needle: list[int] | None, seq: int = 0
) -> tuple[list[list[float]], list[list[float]] | None]:
    """``(kept[layer][head], needle_kept[layer][head])`` of sequence ``seq`` of the batch: shares of
    the context and of the needle tokens stored; the second is None when the needle's tokens are
    unknown."""
    kept, found = [], []
    span = torch.tensor(needle, dtype=torch.long) if needle else None
    for store in cache.stores:
        rows = _row_positions(store, seq)
        kept.append([round(float((p < context_len).sum()) / context_len, 4) for p in rows])
        if span is not None:
            found.append([round(float(torch.isin(span, p.cpu()).float().mean()), 4) for p in rows])
    return kept, (found if span is not None else None)


def needle_span(head: list[int], needle_ids: list[int]) -> list[int] | None:
    """Positions of the needle in ``head``: where its tokens, less the first and last (which may
    merge with their neighbours), occur; widened by one on each side. None if not found."""
    inner = needle_ids[1:-1]
    if not inner:
        return None
    n = len(inner)
    for i in range(len(head) - n + 1):
        if head[i : i + n] == inner:
            return list(range(max(0, i - 1), min(len(head), i + n + 1)))
    return None
