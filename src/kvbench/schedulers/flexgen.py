"""FlexGen: the KV cache split between a fast and a slow tier by head-rows (arXiv:2303.06865).

FlexGen places ``fast_percent`` percent of the cache on the GPU and the rest on the CPU, the
split taken along the batch × heads dimension; attention over the CPU part is computed on the
CPU, so per decode step only the new tokens' keys and values, the queries and the attention
outputs of the slow heads cross tiers, never the cache. Nothing is evicted: the technique is
lossless.

Here the first ``floor(fast_percent × B·H / 100)`` head-rows (batch-major, as FlexGen's
``int(len × percent)`` split) form the fast tier, the store's device; the rest form the slow
tier, CPU memory (pinned when CUDA is available; on a CPU-only machine both tiers are host
memory). Tier bytes come from the real per-row byte counts of the store's segments (per-token
data fields × the row's tokens, plus a grouped segment's per-group fields × the row's groups);
``store.side`` metadata (not per row) is counted in the fast tier, so fast + slow = stored bytes.

Per forward (a step: a decode step or a scoring chunk) it measures the bytes that cross tiers:
the new tokens' K and V of slow rows (at the store's dtype, as the model produced them), and the
slow heads' query vectors sent to the slow tier and attention outputs returned, from the real
query tensor. The attention share
served by the fast tier is its rows' tokens read over all tokens read.

Deviations: the disk tier and FlexGen's weight and activation placement are not modelled. The
engine holds each layer's cache on one device and runs one attention, so until it calls
:meth:`FlexGenScheduler.attend_tiers` (the split attention, timed with CUDA events) the slow
tier is accounting only: tier timings are null and the tokens read are the causally visible
stored tokens (a read selector's choice or a sliding window is not seen).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from kvbench.cache import attention as att
from kvbench.cache.segments import GroupedSegment
from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError
from kvbench.roles import BindContext, Flags, Scheduler


def row_bytes(store: LayerStore) -> torch.Tensor:
    """Stored bytes of every head-row ``(B * H,)`` int64, from each segment's fields."""
    rows = torch.zeros(store.batch * store.kv_heads, dtype=torch.long, device=store.device)
    for seg in store.segments:
        rows = rows + seg.lens * seg.token_nbytes()
        if isinstance(seg, GroupedSegment) and seg.size:
            rows = rows + seg.glens * seg.group_nbytes()
    return rows


def visible_counts(pos: torch.Tensor, valid: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """Stored tokens visible to the real queries, summed over them, per head-row ``(B, H)``: the sum
    of a causal read mask, counted without building it. A token at ``p`` is read by every query at
    ``p`` or after (padding, ``qpos`` -1, by none).

    Args:
        pos, valid: ``(B, H, T)`` the stored tokens; qpos: ``(B, q)`` query positions.
    """
    b, h, t = pos.shape
    earlier = torch.searchsorted(qpos.sort(-1).values, pos.reshape(b, h * t))  # queries before each token
    return ((qpos.shape[1] - earlier).view(b, h, t) * valid).sum(-1)


@dataclass
class FlexGenScheduler(Scheduler):
    """Keeps every token; ``fast_percent`` percent of the head-rows reside in the fast tier.

    Args:
        fast_percent: share of the cache's head-rows (batch × KV heads) in the fast tier, 0..100.
    """

    name: str = "flexgen"
    fast_percent: float = 50.0
    flags = Flags(places_tiers=True, lossless=True)
    wants_queries = True

    def check_knobs(self) -> None:
        if not 0 <= self.fast_percent <= 100:
            raise ConfigError(f"scheduler.fast_percent={self.fast_percent}: must be in [0, 100]")
        self._seen: weakref.WeakKeyDictionary[LayerStore, torch.Tensor] = weakref.WeakKeyDictionary()
        self._step = {"fast": 0, "slow": 0, "moved": 0}
        self._steps: list[dict[str, int]] = []
        self._reads = [0, 0]  # tokens read from fast rows, from all rows
        self._hooked = False  # attend_tiers counted this layer's reads exactly
        self._slow_ms: list[float] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def on_bind(self, ctx: BindContext) -> None:
        self.slow_device = torch.device("cpu")
        self.pinned = torch.cuda.is_available()

    def fast_count(self, store: LayerStore) -> int:
        """Head-rows in the fast tier: the first ones of ``B * H``."""
        return math.floor(self.fast_percent * store.batch * store.kv_heads / 100 + 1e-9)

    def fast_rows(self, store: LayerStore) -> torch.Tensor:
        """``(B, H)`` bool: the head-rows in the fast tier."""
        fast = torch.arange(store.batch * store.kv_heads, device=store.device) < self.fast_count(store)
        return fast.view(store.batch, store.kv_heads)

    def evict(self, layer: int, store: LayerStore) -> None:
        """Nothing is evicted: measure the tiers' bytes and the new slow-row tokens written."""
        fast = self.fast_rows(store).flatten()
        per_row = row_bytes(store)
        shared = store.nbytes() - int(per_row.sum())  # side metadata: resides with the fast tier
        self._step["fast"] += int(per_row[fast].sum()) + shared
        self._step["slow"] += int(per_row[~fast].sum())
        seen_before = self._seen.get(store, torch.zeros_like(store.seen))
        before = seen_before.repeat_interleave(store.kv_heads)
        new = torch.zeros_like(per_row)
        for seg in store.segments:
            rows, pos = store.flat_rows(seg)
            new = new + torch.bincount(rows[pos >= before[rows]], minlength=new.numel())
        token = store.fp.token_nbytes()  # one token's K and V as produced
        self._step["moved"] += int(new[~fast].sum()) * token
        self._seen[store] = store.seen.clone()
        if layer == self.num_layers - 1:
            self._step["tokens"] = int((store.seen - seen_before).sum())
            self._steps.append(self._step)
            self._step = {"fast": 0, "slow": 0, "moved": 0}
            self._close_timings()

    def observe_queries(self, layer: int, store: LayerStore, query: torch.Tensor, qpos: torch.Tensor) -> None:
        """Queries sent to the slow tier and outputs returned; tokens read per tier."""
        b, hq, q, d = query.shape
        fast = self.fast_rows(store)
        real = qpos >= 0
        slow_queries = int(((~fast).sum(-1) * real.sum(-1)).sum()) * (hq // store.kv_heads)
        self._step["moved"] += slow_queries * (d + store.head_dim) * query.element_size()  # q out, o back
        if self._hooked:
            self._hooked = False
            return
        view = store.view()
        visible = view.valid[:, :, None, :] & (view.pos[:, :, None, :] <= qpos[:, None, :, None])
        self._count_reads((visible & real[:, None, :, None]).sum((2, 3)), fast)

    def _count_reads(self, per_row: torch.Tensor, fast: torch.Tensor) -> None:
        self._reads[0] += int(per_row[fast].sum())
        self._reads[1] += int(per_row.sum())

    def attend_tiers(
        self, layer: int, store: LayerStore, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        """Split attention (the engine hook): fast rows on the store's device, slow rows on the slow
        tier, outputs merged. Same arguments as :func:`kvbench.cache.attention.attend`.

        The store keeps one device, so the slow rows' keys and values are copied to the slow tier
        here, outside the timed part; the timed part is what FlexGen pays per step (queries over,
        attention on the slow tier, outputs back).

        Returns:
            ``(B, Hq, q, D)``.
        """
        view = store.view()
        b, h, t, d = view.k.shape
        g, q = query.shape[1] // h, query.shape[2]
        qpos = store.last_qpos
        if mask is None:
            per_row = visible_counts(view.pos, view.valid, qpos)
        else:
            per_row = (mask & (qpos >= 0)[:, None, :, None]).sum((2, 3))
        self._count_reads(per_row, self.fast_rows(store))
        self._hooked = True
        rows = {
            "q": query.reshape(b * h, g, q, -1),
            "k": view.k.reshape(b * h, 1, t, d).to(query.dtype),
            "v": view.v.reshape(b * h, 1, t, -1).to(query.dtype),
        }
        if mask is not None:  # None: plain causal attention (the engine's call), on SDPA's fused path
            rows["mask"] = mask.reshape(b * h, 1, q, t)
        if view.bias is not None:
            rows["bias"] = view.bias.reshape(b * h, 1, t)
        out = query.new_empty(b * h, g, q, view.v.shape[-1])
        n_fast = self.fast_count(store)  # the fast rows come first: each tier is a slice, not a copy
        if n_fast:
            out[:n_fast] = self._attend({k: v[:n_fast] for k, v in rows.items()}, scaling)
        if n_fast < b * h:
            out[n_fast:] = self._attend_slow({k: v[n_fast:] for k, v in rows.items()}, scaling)
        return out.view(b, h * g, q, -1)

    @staticmethod
    def _attend(rows: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        return att.attend(rows["q"], rows["k"], rows["v"], rows.get("mask"), scaling, rows.get("bias"))

    def _attend_slow(self, rows: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        device = rows["q"].device
        to_slow = {k: v.to(self.slow_device) for k, v in rows.items() if k != "q"}  # placement, untimed
        if self.pinned and device.type == "cuda":
            to_slow = {k: v.pin_memory() for k, v in to_slow.items()}
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self._attend({**to_slow, "q": rows["q"].to(self.slow_device)}, scaling).to(device)
            stop.record()
            self._events.append((start, stop))
            return out
        return self._attend({**to_slow, "q": rows["q"].to(self.slow_device)}, scaling).to(device)

    def _close_timings(self) -> None:
        if self._events:
            self._events[-1][1].synchronize()
            self._slow_ms.append(sum(a.elapsed_time(b) for a, b in self._events))
            self._events = []

    def metrics(self) -> dict[str, float | list[float] | None]:
        if not self._steps:
            return {}
        last, later = self._steps[-1], self._steps[1:]
        return {
            "fast_tier_bytes": float(last["fast"]),
            "slow_tier_bytes": float(last["slow"]),
            "bytes_moved_prefill": float(self._steps[0]["moved"]),
            "bytes_moved_per_step": sum(s["moved"] for s in later) / len(later) if later else None,
            "bytes_moved_per_token": (
                sum(s["moved"] for s in later) / sum(s["tokens"] for s in later) if later else None
            ),
            "fast_attention_share": self._reads[0] / self._reads[1] if self._reads[1] else None,
            "slow_tier_attention_ms": sum(self._slow_ms) / len(self._slow_ms) if self._slow_ms else None,
        }
