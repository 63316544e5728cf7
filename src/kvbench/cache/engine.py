"""kvbench's cache as transformers sees it: a ``Cache`` subclass and an attention function.

Everything in kvbench that touches transformers internals lives in :mod:`kvbench.cache` (this
module; :mod:`~kvbench.cache.rotary`, which reads the model's ``rotary_emb``;
:mod:`~kvbench.cache.capture`, the calibration attention) or in :mod:`kvbench.models` (loading,
and the model geometry read from its attention modules). Techniques see only the store.

transformers calls ``cache.update(k, v, layer_idx)`` with rotated keys, then the registered
attention function. ``update`` stores the new tokens in kvbench's own per-layer storage and
marks the cache active; the attention function (``attn_implementation="kvbench"``) reads the
whole stored cache (dequantizing as needed), builds the mask from original positions (every
stored past token visible, causal over new tokens, sliding window honoured, per KV head),
applies the router's read selection, feeds attention scores to the techniques that need them,
and optionally probes KV hit against a shadow of exact keys.

``get_seq_length`` returns the true number of tokens seen, never the stored length, so eviction
never shifts rotary positions.
"""

from __future__ import annotations

import contextvars
from collections.abc import Collection
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.cache import attention as att
from kvbench.cache import held, partials
from kvbench.cache.plan import ReadPlan
from kvbench.cache.segments import FPSegment
from kvbench.cache.store import LayerStore
from kvbench.cache.timing import AttnTimer
from kvbench.kernels import dispatch

ATTN_NAME = "kvbench"
HOST = torch.device("cpu")  # where the KV-hit probe keeps its shadow keys and compares
_ACTIVE: contextvars.ContextVar[KVCache | None] = contextvars.ContextVar("kvbench_cache", default=None)


@dataclass
class HitProbe:
    """Accumulates KV hit over sampled query positions of the probed ``layers`` (None: every
    layer), against shadow keys kept out of byte counts."""

    queries_per_chunk: int = 4
    layers: frozenset[int] | None = None
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0])
    counts: list[int] = field(default_factory=lambda: [0, 0])

    def shadowed(self) -> bool | frozenset[int]:
        """The layers whose exact keys a cache keeps for this probe (True: every layer)."""
        return True if self.layers is None else self.layers

    def add(self, hit: torch.Tensor, hit_excl: torch.Tensor) -> None:
        self.sums[0] += float(hit.sum())
        self.counts[0] += hit.numel()
        finite = hit_excl[torch.isfinite(hit_excl)]
        self.sums[1] += float(finite.sum())
        self.counts[1] += finite.numel()

    def result(self) -> tuple[float | None, float | None]:
        return tuple(s / c if c else None for s, c in zip(self.sums, self.counts))  # type: ignore[return-value]


class _Layer(CacheLayerMixin):
    """transformers-facing shim over a :class:`LayerStore`."""

    def __init__(self, store: LayerStore):
        super().__init__()
        self.store = store

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):  # pragma: no cover - KVCache.update is used
        raise RuntimeError("kvbench: layers are updated through KVCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.stored_tokens() + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.seen_max

    def get_max_length(self) -> int:
        return -1


class KVCache(Cache):
    """A transformers cache whose storage, masks and accounting are kvbench's.

    Args:
        stack: the :class:`kvbench.stack.Stack` applied to this cache.
        num_layers, kv_heads, head_dim: model geometry.
        batch: sequences in the batch.
        dtype, device: of the stored full-precision tensors (per layer device for ``device_map``).
        shadow: keep exact keys of every token, for the KV-hit probe, in the layers given (True:
            every layer). They are kept on the host (a model on GPUs copies each chunk's keys
            there, queued behind its forward), out of the GPUs' memory, and probed there.
    """

    def __init__(
        self,
        stack,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        devices: list[torch.device],
        shadow: bool | Collection[int] = False,
    ):
        self.stores = [LayerStore(batch, kv_heads, head_dim, dtype, devices[i]) for i in range(num_layers)]
        super().__init__(layers=[_Layer(s) for s in self.stores])
        self.stack = stack
        self.idle = not stack.pipeline  # no technique acts after a forward (the full cache)
        probed = set(range(num_layers)) if shadow is True else set(shadow or ())
        # per layer: the exact keys seen (on the host), None for a layer not probed
        self.shadow: list[list[torch.Tensor] | None] | None = (
            [[] if i in probed else None for i in range(num_layers)] if probed else None
        )
        self.probe: HitProbe | None = None
        self.routed = False  # read selectors act for queries after the first compression point
        self.real: torch.Tensor | None = None  # (B, q) non-padding tokens of the coming forward
        self._plans: dict[tuple[int, int | None], ReadPlan] = {}  # this forward's (see ``plan``)
        self.made_plans: dict[tuple[Any, ...], ReadPlan] = {}  # every situation's (ReadPlan.make)
        self.timer: AttnTimer | None = None  # set for a sampled decode step only (kvbench.cache.timing)

    # --- transformers interface -------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:  # a new forward: its reads are planned afresh
            self._plans.clear()
        self.stores[layer_idx].append(key_states, value_states, self.real)
        kept = None if self.shadow is None else self.shadow[layer_idx]
        if kept is not None:
            kept.append(_to_host(key_states))
        _ACTIVE.set(self)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.stores[layer_idx].seen_max

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "kvbench: crop is refused on a compressed cache (evicted tokens cannot return)"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("kvbench: beam search / reorder_cache is refused on a compressed cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("kvbench: batch expansion is refused on a compressed cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("kvbench: batch selection is refused on a compressed cache")

    # --- kvbench ------------------------------------------------------------------------------
    def after_forward(self) -> None:
        """Apply the stack after a forward chunk: compressor, then scheduler, then router writes.

        Under inference mode, as the forward itself: the store's tensors are inference tensors,
        updated in place. A stack with no technique (the full cache) only drops the views its
        readers made, outside any timed sample (a sampled step times each layer's hooks as ever).
        """
        timer = self.timer
        if self.idle and timer is None:
            for store in self.stores:
                store.release()
        else:
            with torch.inference_mode():
                for i, store in enumerate(self.stores):
                    mark = None if timer is None else timer.start(store.device)
                    self.stack.apply(i, store)
                    store.release()
                    if timer is not None:
                        timer.stop(store.device, mark)
        self.routed = True
        _ACTIVE.set(None)  # the next forward's update sets it again; a finished cache is not kept

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.stores)

    def resident_bytes(self) -> int:
        """Bytes of every tensor the cache holds (:func:`kvbench.cache.held.resident_by_device`):
        the stores at their capacity with their views, state, side data and copies, and the KV-hit
        shadow. Per device, they and the stored bytes are noted in :data:`held.PEAKS`."""
        resident = held.resident_by_device([self.stores, self.shadow])
        stored: dict[str, int] = {}
        for s in self.stores:
            stored[str(s.device)] = stored.get(str(s.device), 0) + s.nbytes()
        held.note_peaks(resident, stored)
        return sum(resident.values())

    def per_layer_bytes(self) -> list[int]:
        return [s.nbytes() for s in self.stores]

    def reference_bytes(self) -> int:
        """The same tokens as 16-bit K and V: the denominator-free reference of compression."""
        s = self.stores[0]
        return len(self.stores) * s.kv_heads * s.head_dim * sum(s.seen_host) * 2 * 2

    def plan(self, q_len: int, sliding_window: int | None) -> ReadPlan:
        """The read plan of this forward's layers with ``q_len`` queries and ``sliding_window``,
        made at the first layer that asks (:class:`ReadPlan`) and dropped when the next forward
        starts (:meth:`update` of layer 0)."""
        key = (q_len, sliding_window)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = ReadPlan.make(self, q_len, sliding_window)
        return plan

    def attend(
        self, layer: int, query: torch.Tensor, scaling: float, sliding_window: int | None
    ) -> torch.Tensor:
        store = self.stores[layer]
        plan = self.plan(query.shape[2], sliding_window)
        if plan.bare:
            kv = store.dense_kv()
            if kv is not None:  # one decode step over full-precision rows that every head fills
                return att.attend(query, *kv, None, scaling)
            out = _attend_ragged(store, query, scaling)
            if out is not None:
                return out
            out = _attend_parts(store, query, scaling)  # the others, where each segment can: no view
            if out is not None:
                return out
            kv = _decoded_whole(store)
            if kv is not None:  # every head-row full in one block: decoded and read, no view made
                if kv[0].dtype != query.dtype:
                    kv = kv[0].to(query.dtype), kv[1].to(query.dtype)
                return att.attend(query, *kv, None, scaling)
            return self._attend_masked(layer, store, query, scaling, plan, parts_asked=True)
        if plan.routed:
            kv = store.dense_kv()
            if kv is not None:
                return self._routed_step(layer, store, query, scaling, kv, plan)
        if plan.observed:
            kv = store.dense_kv()
            if plan.first[layer] >= 1:  # no observer reads this layer's step (FastV's other layers)
                if kv is not None:  # read as a bare step reads it
                    return att.attend(query, *kv, None, scaling)
            elif kv is not None:
                return self._observed_step(layer, store, query, scaling, kv, plan.observers)
            else:
                out = _observed_ragged(layer, store, query, scaling, plan.observers)
                if out is not None:
                    return out
        return self._attend_masked(layer, store, query, scaling, plan)

    def _attend_masked(
        self,
        layer: int,
        store: LayerStore,
        query: torch.Tensor,
        scaling: float,
        plan: ReadPlan,
        parts_asked: bool = False,
    ) -> torch.Tensor:
        """Every other read: masks from positions, padding, the read selector's routing, the tiers'
        attention, the observers' probabilities and the KV-hit probe, as ``plan`` says
        (``parts_asked``: the segments were asked for their parts of this step, and one had none)."""
        q_len, sliding_window, padded, selector = plan.q_len, plan.window, plan.padded, plan.selector
        if _pageable(plan, layer):
            kernel = dispatch.kernels("attention", store.batch, store.columns())
            paged = self._paged_step(layer, store, query, scaling, plan, kernel)
            if paged is not None:
                return paged
        qpos = store.last_qpos  # (B, q), -1 for padding
        view = store.view()
        # Plain causal attention needs no mask: a prefill with no past, or one decode step over
        # an unwindowed cache where every stored token is real (all are in the past).
        plain = (
            sliding_window is None
            and not padded
            and view.bias is None
            and view.dense
            and (view.pos.shape[2] == q_len or q_len == 1)
        )
        qreal = qpos >= 0 if padded else None

        def mask_fn(start: int, stop: int) -> torch.Tensor:
            one_step = q_len == 1 and sliding_window is None  # every stored token is in its past
            if one_step and view.dense and selector is not None:  # every slot a token: what it selects
                mask = selector.read_mask(layer, store, query, qpos)
            else:
                if one_step:
                    mask = view.valid[:, :, None, :]
                else:
                    mask = att.read_mask(view.pos, view.valid, qpos[:, start:stop], sliding_window)
                if selector is not None:
                    chosen = selector.read_mask(layer, store, query[:, :, start:stop], qpos[:, start:stop])
                    mask = mask & chosen
            if qreal is not None:  # padding queries read every stored token (their output is discarded)
                mask = torch.where(qreal[:, None, start:stop, None], mask, view.valid[:, :, None, :])
            return mask

        plain_read = plain and selector is None
        placer = plan.placer
        # A mask from positions alone (a sliding window, padding, ragged heads) is built per block of
        # queries, never whole for a long prefill; a read selector routes the chunk's queries at
        # once, and the tiers' attention takes one mask.
        per_block = not plain_read and selector is None and placer is None
        mask = None if plain_read or per_block else mask_fn(0, q_len)

        def score_mask(start: int, stop: int) -> torch.Tensor | None:
            """The read mask of queries ``start:stop`` for their scores; None (every stored token)
            for one plain decode step."""
            if mask is not None:
                return mask[:, :, start:stop]
            return None if plain_read and q_len == 1 else mask_fn(start, stop)

        if placer is not None:  # per-tier attention: fast rows on the device, slow rows on the slow tier
            out = placer.attend_tiers(layer, store, query, mask, scaling)
        else:
            pos = att.Positions(view.pos, qpos, sliding_window) if per_block else None
            out = _attend_decoded(
                store, query, mask, mask_fn if pos else None, scaling, plan.reads_all and not parts_asked, pos
            )
        for tech in plan.query_observers:
            tech.observe_queries(layer, store, query, qpos)
        # Scores only for the queries some observer reads (e.g. SnapKV's window: the last 16).
        first = plan.first[layer]
        if first < q_len:
            # plain causal prefill: the stored slots are this chunk's positions in order
            causal = view.pos.shape[2] - q_len + first if plain_read and q_len > 1 else None
            blocks = att.probs_blocks(
                query[:, :, first:],
                view.k,
                lambda a, b: score_mask(first + a, first + b),
                scaling,
                view.bias,
                causal_past=causal,
            )
            for offset, probs in blocks:
                start = first + offset
                stop = start + probs.shape[3]
                if qreal is not None:
                    probs = probs * qreal[:, None, None, start:stop, None]
                for tech in plan.observers:
                    tech.observe(layer, store, probs, qpos[:, start:stop])
        if self.probe is not None and self.shadow is not None and self.shadow[layer] is not None:
            self._probe_hit(layer, store, query, qpos, mask_fn, scaling, sliding_window)
        store.release()
        return out

    def _paged_step(
        self,
        layer: int,
        store: LayerStore,
        query: torch.Tensor,
        scaling: float,
        plan: ReadPlan,
        kernel: ModuleType | None,
    ) -> torch.Tensor | None:
        """One unpadded decode step over full-precision rows that every head fills, on the Triton
        path (``kernel``: the attention kernel, None on the torch path), whose read selector names
        the pages it reads (:attr:`ReadPlan.pages`, :class:`att.Pages`): the kernel's grid covers
        those pages and the always-read slots only, and no mask is built. Asked only where
        :func:`_pageable`; None where the step needs its mask (the torch path, rows that are not
        dense, a selector that names no pages for the step)."""
        if kernel is None:
            return None
        kv = store.dense_kv()
        if kv is None:  # (dense rows are the full-precision rows alone: no bias, no view to make)
            return None
        pages = plan.pages(layer, store, query, store.last_qpos)
        if pages is None:
            return None
        out = kernel.attend(query, *kv, None, scaling, pages=pages)
        for tech in plan.query_observers:
            tech.observe_queries(layer, store, query, store.last_qpos)
        store.release()
        return out

    def _routed_step(
        self,
        layer: int,
        store: LayerStore,
        query: torch.Tensor,
        scaling: float,
        kv: tuple[torch.Tensor, torch.Tensor],
        plan: ReadPlan,
    ) -> torch.Tensor:
        """One unpadded decode step over full-precision rows that every head fills (``kv``), whose
        only technique inside attention is the read selector (:attr:`ReadPlan.routed`): its pages
        on the Triton path where it names them (:meth:`_paged_step`), else its mask over the rows as
        they are. The same reads as the masked read's: every slot is a token, so the mask is the
        selector's alone, and no bias exists."""
        kernel = dispatch.kernels("attention", store.batch, store.columns())
        if kernel is not None and _pageable(plan, layer):  # pages on the Triton path only
            paged = self._paged_step(layer, store, query, scaling, plan, kernel)
            if paged is not None:
                return paged
        if kernel is None and plan.head_mask is not None:  # per query head: no repeat in the read
            mask = plan.head_mask(layer, store, query, store.last_qpos)
        else:
            mask = plan.selector.read_mask(layer, store, query, store.last_qpos)
        keys, values = kv
        if keys.dtype != query.dtype:
            keys, values = keys.to(query.dtype), values.to(query.dtype)
        if kernel is not None:
            out = kernel.attend(query, keys, values, mask, scaling, None)
        else:
            out = att.attend(query, keys, values, mask, scaling, None)
        store.release()
        return out

    def _observed_step(
        self,
        layer: int,
        store: LayerStore,
        query: torch.Tensor,
        scaling: float,
        kv: tuple[torch.Tensor, torch.Tensor],
        observers: tuple,
    ) -> torch.Tensor:
        """One unpadded decode step over full-precision rows that every head fills (``kv``), whose
        only technique inside attention observes the probabilities (:attr:`ReadPlan.observed`):
        they are computed once, and the output is read from them (probabilities times values, as
        an eager reference implementation does), not computed a second time by SDPA."""
        keys, values = kv  # (B, H, T, D)
        probs = att.decode_probs(query, keys, scaling)  # (B, H, g, 1, T) fp32
        out = _probs_output(probs, values, query)
        qpos = store.last_qpos
        for tech in observers:
            tech.observe(layer, store, probs, qpos)
        store.release()
        return out

    def _probe_hit(self, layer, store, query, qpos, mask_fn, scaling, sliding_window) -> None:
        """KV hit at a few evenly spaced queries of the chunk, against every exact key seen.

        Per row of the batch (units, masks and shadow keys are per row; sums and counts add up, so
        B windows at once give what they give one at a time). The rows must be at the same
        positions, as in the perplexity protocol's unpadded batches: the chunk start and the
        excluded positions are row 0's. Merged units are compared with the summed full-cache
        probability of the positions they absorbed.
        """
        kept = None if self.shadow is None else self.shadow[layer]
        assert self.probe is not None and kept is not None
        n = min(self.probe.queries_per_chunk, query.shape[2])
        pick = torch.linspace(0, query.shape[2] - 1, n, device=query.device).round().long()
        # in float32 on both sides, whatever the model's dtype: a measure, not the technique's read
        q, qp = query[:, :, pick].float(), qpos[:, pick]
        view = store.view()
        mask = mask_fn(0, query.shape[2])[:, :, pick]
        p_stack = att.probs(q, view.k.float(), mask, scaling, view.bias).to(HOST)
        if query.device.type == "cuda":  # the shadow's copies to the host were queued, not awaited
            torch.cuda.synchronize(query.device)
        shadow = torch.cat(kept, dim=2) if len(kept) > 1 else kept[0]
        self.shadow[layer] = [shadow]  # type: ignore[index]
        s = shadow.shape[2]
        qp = qp.to(HOST)
        spos = torch.arange(s).expand(*shadow.shape[:2], s)
        ones = torch.ones_like(spos, dtype=torch.bool)
        p_full = att.probs(q.to(HOST), shadow.float(), att.read_mask(spos, ones, qp, sliding_window), scaling)
        chunk_start = int(qp[0, 0])
        exclude = self.stack.budget.protected(torch.arange(s), chunk_start)
        exclude |= torch.arange(s) >= chunk_start
        hit, hit_excl = att.kv_hit(p_stack, store.units(s).to(HOST), p_full, exclude)
        self.probe.add(hit, hit_excl)


# A masked step of at most this many queries runs the Triton path's decode kernel (SDPA otherwise)
KERNEL_QUERIES = 16
# Upper bound on the elements of the keys decoded for one block of head-rows (2**24: 32 MiB in bf16).
DECODE_ELEMS = 1 << 24


def head_blocks(batch: int, heads: int, per_head: int) -> list[tuple[int, int, int, int]]:
    """Blocks ``(b0, b1, h0, h1)`` of sequences and KV heads whose keys, ``per_head`` elements per
    head-row, stay within :data:`DECODE_ELEMS`: whole sequences together, else heads of one
    sequence (at least one head a block). Each block's head-rows are consecutive."""
    per_seq = heads * per_head
    if batch * per_seq <= DECODE_ELEMS:
        return [(0, batch, 0, heads)]
    if per_seq <= DECODE_ELEMS:
        step = DECODE_ELEMS // per_seq
        return [(b, min(batch, b + step), 0, heads) for b in range(0, batch, step)]
    step = max(1, DECODE_ELEMS // max(1, per_head))
    return [(b, b + 1, h, min(heads, h + step)) for b in range(batch) for h in range(0, heads, step)]


def _pageable(plan: ReadPlan, layer: int) -> bool:
    """Whether ``layer``'s step may read its selector's pages (:meth:`KVCache._paged_step`): the
    plan names them (:attr:`ReadPlan.pages`) and no observer reads this step's probabilities."""
    return plan.pages is not None and plan.first[layer] >= 1


def _attend_ragged(store: LayerStore, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """A bare step over one segment of full-precision rows of different lengths (DuoAttention's
    streaming heads hold fewer tokens than its retrieval heads), on the torch path: SDPA over the
    rows as they are, their valid slots its mask (made once per lengths, :meth:`Rows.valid`), where
    the segment's partial and its merge (:mod:`.partials`) take a dozen operations. None elsewhere
    (the Triton path's kernel reads each row to its length without a mask)."""
    segs = store.segments
    if len(segs) != 1 or not isinstance(segs[0], FPSegment):
        return None
    rows = segs[0].rows
    if dispatch.kernels("attention", store.batch, rows.width) is not None:
        return None
    b, h = store.batch, store.kv_heads
    valid = rows.valid().view(b, h, 1, rows.width)
    return att.attend(query, *rows.kv_heads(b), valid, scaling)


def _attend_parts(store: LayerStore, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """A step reading every token of a layer that is not one dense segment, attended segment by
    segment (:mod:`.partials`), from the segments alone (no view is made or updated): on the torch
    path, only within :data:`DECODE_ELEMS` and without a bias; on the Triton path merged units too,
    read in place with their bias. None where a segment cannot (the step is then decoded)."""
    columns = store.columns()
    kernel = dispatch.kernels("attention", store.batch, columns)
    if kernel is None:
        segs = store.segments
        # no segment is asked where one gives no torch state (KIVI's codes, pruned keys, merged
        # units: their fused decodes run only beside the attention kernel, dispatch.step; latents
        # and factors below PARTIAL_MIN_SLOTS a head-row)
        if not all(seg.torch_partials() for seg in segs):
            return None
        whole = store.batch * store.kv_heads * columns * store.head_dim <= DECODE_ELEMS
        # a bias (merged units' log(count)): only the kernels' states carry it
        if not whole or any("bias" in seg.rows for seg in segs):
            return None
    with dispatch.step(kernel):  # under auto, every segment's states of the kind merged here
        parts = partials.gather(store.segments, query, scaling, store.batch)
    return None if parts is None else (kernel or partials).merge(parts, query, store.kv_heads)


def _decoded_whole(store: LayerStore) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A bare step's keys and values ``(B, H, T, D)`` over several segments, decoded now
    (:meth:`LayerStore.decoded`) without the view that :meth:`KVCache._attend_masked` would make:
    where every segment's head-rows are full and none carries a bias (the step reads every slot,
    no mask) and the layer decodes in one block (:func:`head_blocks`). What
    :func:`_attend_decoded` reads on that path, the same keys and values; the joined positions a
    view keeps are brought up to date when a view is next made (:meth:`Rows.changes`). Else None.
    Where the store holds a whole decoder (:meth:`LayerStore.whole_decoder`: its compressed
    segments full and without a bias, known since its last edit), only the full-precision rows and
    the size are checked."""
    b, h = store.batch, store.kv_heads
    decode = store.whole_decoder()
    if decode is not None:
        if not store.fp.rows.uniform:
            return None
        width = store.columns()
    else:
        segs = store.segments
        if any(not seg.rows.uniform or "bias" in seg.rows for seg in segs):
            return None
        width = sum(seg.rows.width for seg in segs)
        decode = store.decoded
    if b * h * width * store.head_dim > DECODE_ELEMS:  # more than one block (:func:`head_blocks`)
        return None
    k, v = decode()
    return k.view(b, h, width, k.shape[-1]), v.view(b, h, width, v.shape[-1])


def _probs_output(probs: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """A decode step's output ``(B, Hq, 1, D)`` from its probabilities ``(B, H, g, 1, T)`` and the
    values ``(B, H, T, D)``: probabilities times values, in the values' dtype."""
    b, hq, _, d = query.shape
    rows = probs.to(values.dtype).view(b, values.shape[1], -1, values.shape[2])  # (B, H, g, T)
    return (rows @ values).reshape(b, hq, 1, d)


def _observed_ragged(
    layer: int, store: LayerStore, query: torch.Tensor, scaling: float, observers: tuple
) -> torch.Tensor | None:
    """One unpadded decode step over full-precision rows alone whose head-rows hold different
    numbers of tokens, on the torch path, whose only technique inside attention observes the
    probabilities: the rows' logits are made once (:func:`partials.partial`), their softmax is the
    observers' probabilities (zero at the slots past a row's end), and the output is read from
    those probabilities, probabilities times values, as :meth:`KVCache._observed_step` reads it
    over full rows and as an eager reference implementation does. None elsewhere (compressed
    segments, the Triton path, beyond :data:`DECODE_ELEMS`)."""
    if len(store.segments) != 1 or dispatch.kernels("attention", store.batch, store.columns()) is not None:
        return None
    if store.batch * store.kv_heads * store.columns() * store.head_dim > DECODE_ELEMS:
        return None
    store.view()  # made, as the masked read makes it: what the store holds is what it held
    part = store.segments[0].attend_partials(query, scaling, store.batch)
    probs = part.scaled_probs()  # (B, H, g, 1, T) fp32
    out = _probs_output(probs, part.value, query)  # the values are zeros past a row's end
    qpos = store.last_qpos
    for tech in observers:
        tech.observe(layer, store, probs, qpos)
    store.release()
    return out


def _attend_decoded(
    store: LayerStore, query, mask, mask_fn, scaling: float, reads_all: bool = False, positions=None
) -> torch.Tensor:
    """Attention over the store's keys and values (``mask`` or, per block of queries, ``mask_fn``:
    see :func:`att.attend`, :func:`att.attend_blocks`). A store holding representations is read in
    blocks of head-rows (:func:`head_blocks`), each decoded (:meth:`LayerStore.decoded`), attended
    and dropped: the layer's keys and values never exist decoded whole, unless a technique reads
    them (``view().k``). A step reading every token (``reads_all``) of a layer that is not one
    dense segment is attended segment by segment where every segment can (:mod:`.partials`; on the
    torch path, only within :data:`DECODE_ELEMS` and without a bias; on the Triton path merged units
    too, read in place with their bias). On the Triton path, other masked steps of at most
    :data:`KERNEL_QUERIES` queries run the decode kernel, which takes ``positions``
    (:class:`att.Positions`) and the valid slots where ``mask_fn`` would build a mask from them."""
    view = store.view()
    one_dense = len(store.segments) == 1 and view.dense
    kernel = dispatch.kernels("attention", store.batch, view.pos.shape[2])
    if reads_all and not one_dense:
        out = _attend_parts(store, query, scaling)
        if out is not None:
            return out

    def attend(q, k, v, mask, mask_fn, bias, part=(slice(None), slice(None))):
        k, v = k.to(q.dtype), v.to(q.dtype)
        masked = mask is not None or mask_fn is not None
        if kernel is not None and masked and q.shape[2] <= KERNEL_QUERIES:
            if mask is not None:
                return kernel.attend(q, k, v, mask, scaling, bias)
            valid = view.valid[part][:, :, None, :].expand(-1, -1, q.shape[2], -1)  # one row for all queries
            pos = att.Positions(view.pos[part], positions.query[part[0]], positions.window)
            return kernel.attend(q, k, v, valid, scaling, bias, positions=pos)
        if mask_fn is not None:
            return att.attend_blocks(q, k, v, mask_fn, scaling, bias)
        return att.attend(q, k, v, mask, scaling, bias)

    b, h = store.batch, store.kv_heads
    t = view.pos.shape[2]
    blocks = head_blocks(b, h, t * store.head_dim)
    if len(store.segments) == 1 or view.kv is not None or len(blocks) == 1:
        return attend(query, view.k, view.v, mask, mask_fn, view.bias)
    g = query.shape[1] // h
    out = query.new_empty(*query.shape[:3], store.head_dim)
    for b0, b1, h0, h1 in blocks:
        part = (slice(b0, b1), slice(h0, h1))
        k, v = store.decoded(b0 * h + h0, (b1 - 1) * h + h1)
        shape = (b1 - b0, h1 - h0, t, store.head_dim)
        out[b0:b1, h0 * g : h1 * g] = attend(
            query[b0:b1, h0 * g : h1 * g],
            k.view(shape),
            v.view(shape),
            None if mask is None else mask[part],
            None if mask_fn is None else lambda s, e, part=part: mask_fn(s, e)[part],
            None if view.bias is None else view.bias[part],
            part,
        )
    return out


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the host; from a GPU, a copy queued behind the forward (awaited before it is read)."""
    return x if x.device.type == "cpu" else x.to(HOST, non_blocking=True)


def kvbench_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """Attention function registered as ``attn_implementation="kvbench"``: reads the active
    :class:`KVCache` (``key``/``value`` are only the new tokens, already stored); returns ``(B, q,
    Hq, D)`` and no weights."""
    cache = _ACTIVE.get()
    if cache is None:
        raise RuntimeError("kvbench attention needs a kvbench KVCache as the model's cache")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    timer = cache.timer
    mark = None if timer is None else timer.start(query.device)
    out = cache.attend(module.layer_idx, query, scaling, sliding_window)
    if timer is not None:
        timer.stop(query.device, mark)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register kvbench's attention function with transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvbench_attention)
