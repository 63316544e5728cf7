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
from dataclasses import dataclass, field

import torch

from kvbench.cache import attention as att
from kvbench.cache.reads import one_step, read_all
from kvbench.cache.segments import GroupedSegment
from kvbench.cache.surface import TechniqueStore, every_position, every_query_real
from kvbench.cache.view import PaddedView
from kvbench.errors import ConfigError
from kvbench.roles import BindContext, Flags, Scheduler


def row_bytes(store: TechniqueStore) -> torch.Tensor:
    """Stored bytes of every head-row ``(B * H,)`` int64, from each segment's fields."""
    rows: torch.Tensor | None = None  # the first segment's bytes start the sum (no zeros to add to)
    for seg in store.segments:
        part = seg.lens * seg.token_nbytes()
        rows = part if rows is None else rows + part
        if isinstance(seg, GroupedSegment) and seg.size:
            rows = rows + seg.glens * seg.group_nbytes()
    if rows is None:
        return torch.zeros(store.batch * store.kv_heads, dtype=torch.long, device=store.device)
    return rows.to(torch.long)


def visible_counts(pos: torch.Tensor, valid: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """Stored tokens visible to the real queries, summed over them, per head-row ``(B, H)``: the sum
    of a causal read mask, counted without building it. A token at ``p`` is read by every query at
    ``p`` or after (padding, ``qpos`` -1, by none).

    Args:
        pos, valid: ``(B, H, T)`` the stored tokens; qpos: ``(B, q)`` query positions.
    """
    b, h, t = pos.shape
    ordered = qpos if qpos.shape[1] == 1 else qpos.sort(-1).values  # one query is in order
    earlier = torch.searchsorted(ordered, pos.reshape(b, h * t))  # queries before each token
    return ((qpos.shape[1] - earlier).view(b, h, t) * valid).sum(-1)


# per layer and step: bytes in the fast and slow tiers, bytes moved between them, tokens read from
# the fast rows and from all rows, tokens fed (the last layer's)
FIGURES = ("fast", "slow", "moved", "fast_reads", "reads", "tokens")


class SlowTier:
    """The slow rows' keys and values on the slow tier (host memory, pinned with CUDA), kept with the
    layer's store between steps (:attr:`LayerStore.copies`, resident bytes).

    While the store's tokens stay where they are (no eviction or move: ``edits`` unchanged, every
    slot a real token), a step only appends columns, and only those are copied; anything else
    copies the slow rows whole, once.
    """

    def __init__(self, device: torch.device, pinned: bool):
        self.device, self.pinned = device, pinned
        self.k: torch.Tensor | None = None  # (rows, 1, capacity, D) on the slow tier
        self.v: torch.Tensor | None = None
        self.width = 0  # columns copied
        self.key: tuple[int, int] | None = None  # (store edits, rows) of the copied columns
        self.copied = 0  # columns copied in all (a test's count of the traffic)

    def update(
        self, store: TechniqueStore, view: PaddedView, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slow tier's copy of ``k``, ``v`` ``(rows, 1, T, D)`` (slices of the view on the store's
        device), its first ``T`` columns."""
        t = k.shape[2]
        key = (store.edits, k.shape[0])
        start = self.width if key == self.key and view.dense and t >= self.width else 0
        tk, tv = self.k, self.v
        if tk is None or tv is None or t > tk.shape[2] or start == 0:
            cap = t + max(64, t // 4)
            new_k, new_v = self._empty(k, cap), self._empty(v, cap)
            if start and tk is not None and tv is not None:
                new_k[:, :, :start], new_v[:, :, :start] = tk[:, :, :start], tv[:, :, :start]
            tk, tv = self.k, self.v = new_k, new_v
        tk[:, :, start:t].copy_(k[:, :, start:])  # awaited: attention on the slow tier reads it next
        tv[:, :, start:t].copy_(v[:, :, start:])
        self.copied += t - start
        self.width, self.key = (t, key) if view.dense else (0, None)
        return tk[:, :, :t], tv[:, :, :t]

    def _empty(self, like: torch.Tensor, cap: int) -> torch.Tensor:
        shape = (*like.shape[:2], cap, *like.shape[3:])
        out = torch.empty(shape, dtype=like.dtype, device=self.device)
        return out.pin_memory() if self.pinned else out


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
    slow_device: torch.device = field(default=torch.device("cpu"), init=False)  # the slow tier's
    pinned: bool = field(default=False, init=False)  # slow rows in pinned memory (with CUDA)
    # per store: its sequences' tokens seen at the last step (``seen_host``)
    _seen: weakref.WeakKeyDictionary[TechniqueStore, list[int]] = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )
    # per layer in the current step: its FIGURES, those made on the device in a tensor on the
    # layer's device, read by :meth:`metrics` (no read per step), and those known on the host
    _layer: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _host: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False)
    # per step, per layer: (its device figures or None, its host figures)
    _steps: list[list[tuple[torch.Tensor | None, list[int]]]] = field(
        default_factory=list, init=False, repr=False
    )
    _hooked: bool = field(default=False, init=False, repr=False)  # attend_tiers counted this layer's reads
    _slow_ms: list[float] = field(default_factory=list, init=False, repr=False)
    _events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(
        default_factory=list, init=False, repr=False
    )

    def check_knobs(self) -> None:
        if not 0 <= self.fast_percent <= 100:
            raise ConfigError(f"scheduler.fast_percent={self.fast_percent}: must be in [0, 100]")

    def on_bind(self, ctx: BindContext) -> None:
        self.slow_device = torch.device("cpu")
        self.pinned = torch.cuda.is_available()

    def fast_count(self, store: TechniqueStore) -> int:
        """Head-rows in the fast tier: the first ones of ``B * H``."""
        return math.floor(self.fast_percent * store.batch * store.kv_heads / 100 + 1e-9)

    def fast_rows(self, store: TechniqueStore) -> torch.Tensor:
        """``(B, H)`` bool: the head-rows in the fast tier."""
        fast = torch.arange(store.batch * store.kv_heads, device=store.device) < self.fast_count(store)
        return fast.view(store.batch, store.kv_heads)

    def _add(self, layer: int, store: TechniqueStore, **figures: torch.Tensor | int) -> None:
        """Add ``figures`` (named as :data:`FIGURES`) to the layer's step: a tensor in place on its
        device (one ``add_`` on each figure's element, not a read, add and write back), a whole
        number known on the host on the host (no launch)."""
        for name, value in figures.items():
            i = FIGURES.index(name)
            if isinstance(value, torch.Tensor):
                step = self._layer.get(layer)
                if step is None:
                    step = self._layer[layer] = torch.zeros(
                        len(FIGURES), dtype=torch.long, device=store.device
                    )
                step[i].add_(value)
            else:
                self._host.setdefault(layer, [0] * len(FIGURES))[i] += int(value)

    def evict(self, layer: int, store: TechniqueStore) -> None:
        """Nothing is evicted: measure the tiers' bytes and the new slow-row tokens written.

        Where every slot holds its own position (:func:`every_position`: one segment, every row
        the same ``width`` tokens, positions ``0 .. width - 1``), the figures are host figures: a
        row's bytes are its tokens' and its new tokens those from the sequence's count before."""
        n_fast = self.fast_count(store)  # the fast rows come first
        before = self._seen.get(store) or [0] * store.batch  # the first step: every token is new
        token = store.fp.token_nbytes()  # one token's K and V as produced
        if every_position(store):
            width = store.columns()
            rows, per_row = store.batch * store.kv_heads, width * token
            new = [width - min(n, width) for n in before for _ in range(store.kv_heads)]  # per row
            fast, every, moved = n_fast * per_row, rows * per_row, sum(new[n_fast:]) * token
            self._add(layer, store, fast=store.nbytes() - every + fast, slow=every - fast, moved=moved)
        else:
            per_row_bytes = row_bytes(store)
            fast_t, every_t = per_row_bytes[:n_fast].sum(), per_row_bytes.sum()
            shared = store.nbytes() - every_t  # side metadata: resides with the fast tier
            seen = torch.tensor(before, dtype=torch.long, device=store.device)
            at = seen.repeat_interleave(store.kv_heads)
            new_t: torch.Tensor | None = None
            for seg in store.segments:  # tokens stored at a position not seen before this step
                part = ((seg.rows.get("pos") >= at[:, None]) & seg.rows.valid()).sum(-1)
                new_t = part if new_t is None else new_t + part
            if new_t is None:
                new_t = torch.zeros_like(per_row_bytes)
            moved_t = new_t[n_fast:].sum() * token
            self._add(layer, store, fast=fast_t + shared, slow=every_t - fast_t, moved=moved_t)
        if layer == self.num_layers - 1:  # the step's tokens, counted once
            self._add(layer, store, tokens=sum(store.seen_host) - sum(before))
            layers = sorted({*self._layer, *self._host})
            self._steps.append([(self._layer.get(i), self._host.get(i, [0] * len(FIGURES))) for i in layers])
            self._layer, self._host = {}, {}
            self._close_timings()
        self._seen[store] = list(store.seen_host)

    def observe_queries(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> None:
        """Queries sent to the slow tier and outputs returned; tokens read per tier."""
        b, hq, q, d = query.shape
        real: torch.Tensor | None = None
        if every_query_real(store, qpos):  # every query real: on the host
            slow_queries: torch.Tensor | int = (
                (b * store.kv_heads - self.fast_count(store)) * q * (hq // store.kv_heads)
            )
        else:
            real = qpos >= 0
            slow_queries = ((~self.fast_rows(store)).sum(-1) * real.sum(-1)).sum() * (hq // store.kv_heads)
        moved = slow_queries * (d + store.head_dim) * query.element_size()  # q out, o back
        self._add(layer, store, moved=moved)
        if self._hooked:
            self._hooked = False
            return
        real = qpos >= 0 if real is None else real
        view = store.view()
        visible = view.valid[:, :, None, :] & (view.pos[:, :, None, :] <= qpos[:, None, :, None])
        self._count_reads(layer, store, (visible & real[:, None, :, None]).sum((2, 3)))

    def _count_reads(self, layer: int, store: TechniqueStore, per_row: torch.Tensor) -> None:
        flat = per_row.flatten()
        self._add(layer, store, fast_reads=flat[: self.fast_count(store)].sum(), reads=flat.sum())

    def attend_tiers(
        self,
        layer: int,
        store: TechniqueStore,
        query: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """Split attention (the engine hook): fast rows on the store's device, slow rows on the slow
        tier, outputs merged. Same arguments as :func:`kvbench.cache.attention.attend`.

        The store keeps one device, so the slow rows' keys and values also live on the slow tier
        (:class:`SlowTier`, kept with the store and extended by the tokens appended since the last
        step), placed there outside the timed part; the timed part is what FlexGen pays per step
        (queries over, attention on the slow tier, outputs back).

        Returns:
            ``(B, Hq, q, D)``.
        """
        view = store.view()
        b, h, t, d = view.k.shape
        g, q = query.shape[1] // h, query.shape[2]
        qpos = store.last_qpos
        if mask is None and one_step(store, qpos):  # every row's query sees its every token
            n_fast = self.fast_count(store)
            self._add(layer, store, fast_reads=n_fast * t, reads=b * h * t)
        else:
            if mask is None:
                per_row = visible_counts(view.pos, view.valid, qpos)
            else:
                per_row = (mask & (qpos >= 0)[:, None, :, None]).sum((2, 3))
            self._count_reads(layer, store, per_row)
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
        n_fast = self.fast_count(store)  # the fast rows come first: each tier is a slice, not a copy
        parts = []
        if n_fast:
            parts.append(self._attend({k: v[:n_fast] for k, v in rows.items()}, scaling))
        if n_fast < b * h:
            slow = {k: v[n_fast:] for k, v in rows.items()}
            if self.separate_tier(store):  # the tier's own copy, extended by the new tokens
                tier = store.copies.setdefault("flexgen", SlowTier(self.slow_device, self.pinned))
                slow["k"], slow["v"] = tier.update(store, view, slow["k"], slow["v"])
            parts.append(self._attend_slow(slow, scaling))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)  # the tiers' outputs in row order
        return out.reshape(b, h * g, q, -1)

    def separate_tier(self, store: TechniqueStore) -> bool:
        """The slow tier is other memory than the store's (a GPU's store, the host's tier)."""
        return self.slow_device != store.device

    @staticmethod
    def _attend(rows: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        return att.attend(rows["q"], rows["k"], rows["v"], rows.get("mask"), scaling, rows.get("bias"))

    def _attend_slow(self, rows: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        device = rows["q"].device
        # the mask and the bias (a few bytes per token) are placed per step, untimed
        to_slow = {k: v.to(self.slow_device) for k, v in rows.items() if k != "q"}
        if self.pinned and device.type == "cuda":
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
        made = [x for layers in self._steps for v, _ in layers if v is not None for x in v.unbind()]
        values = iter(read_all(made))
        steps = []  # per step: its layers' figures summed (whole numbers: exact as float64)
        for layers in self._steps:
            rows = [[int(next(values)) + n if v is not None else n for n in host] for v, host in layers]
            steps.append([int(sum(col)) for col in zip(*rows)])
        tokens = [s[5] for s in steps]
        fast_reads, all_reads = sum(s[3] for s in steps), sum(s[4] for s in steps)
        last, later = steps[-1], steps[1:]
        moved_later, later_tokens = sum(s[2] for s in later), sum(tokens[1:])
        return {
            "fast_tier_bytes": float(last[0]),
            "slow_tier_bytes": float(last[1]),
            "bytes_moved_prefill": float(steps[0][2]),
            "bytes_moved_per_step": moved_later / len(later) if later else None,
            "bytes_moved_per_token": moved_later / later_tokens if later_tokens else None,
            "fast_attention_share": fast_reads / all_reads if all_reads else None,
            "slow_tier_attention_ms": sum(self._slow_ms) / len(self._slow_ms) if self._slow_ms else None,
        }
