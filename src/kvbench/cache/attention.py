"""Attention over a kvbench cache: masked SDPA, blockwise scores, and the KV-hit probe.

Shapes: queries ``(B, Hq, q, D)``; stored keys/values ``(B, H, T, D)`` with ``Hq = H * g``;
masks ``(B, H, q, T)`` per KV head (ragged heads make one shared mask impossible).
SDPA returns no attention weights, so scores that techniques need are computed here in
query blocks that keep memory bounded at long context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.cache import devices

# Upper bound on elements of one block of attention probabilities (fp32): 2**26 = 256 MiB.
_BLOCK_ELEMS = 1 << 26


def read_mask(
    kpos: torch.Tensor, valid: torch.Tensor, qpos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Every stored past token visible, causal over the new ones, sliding window honoured.

    Args:
        kpos: ``(B, H, T)`` original positions of the stored tokens.
        valid: ``(B, H, T)`` real tokens (padding is False).
        qpos: ``(B, q)`` query positions (one row per sequence).
        sliding_window: the model's window, or None.

    Returns:
        ``(B, H, q, T)`` bool.
    """
    kp = kpos[:, :, None, :]
    qp = qpos[:, None, :, None]
    mask = valid[:, :, None, :] & (kp <= qp)
    if sliding_window is not None:
        mask = mask & (kp > qp - sliding_window)
    return mask


@dataclass
class Positions:
    """Original positions in place of a mask built from them: of the stored slots ``key``
    ``(B, H, T)``, of the queries ``query`` ``(B, q)`` (-1: a padding query, which reads every slot;
    its output is discarded), and the model's sliding ``window`` (None: none)."""

    key: torch.Tensor
    query: torch.Tensor
    window: int | None = None

    def mask(self) -> torch.Tensor:
        """``(B, H, q, T)`` bool: what :func:`read_mask` gives every slot, padding queries all."""
        seen = read_mask(self.key, torch.ones_like(self.key, dtype=torch.bool), self.query, self.window)
        return seen | (self.query < 0)[:, None, :, None]


@dataclass
class Pages:
    """A read selector's choice as the pages it reads, in place of a mask over every slot: each
    query reads the slots ``[0, lo)`` and ``[hi, T)`` (sinks, the window, the newest tokens), and,
    of each page ``j`` named in ``index`` ``(B, H, q, K)`` (-1: none), the slots that lie in
    ``[lo, hi)``. Slot ``t`` holds position ``t``. A kernel reads the named pages only
    (:mod:`kvbench.kernels.attention`); :meth:`mask` is the same read as a mask.

    Page ``j`` holds the slots from ``start + ceil(j size / parts)`` to the next page's first:
    ``parts`` pages share each ``size`` slots. Quest's pages are ``size`` slots from slot 0
    (``parts`` 1); the position routers' ``E`` blocks split the ``n`` routed slots from ``lo``
    (``size`` n, ``parts`` E), a slot of rank ``r`` in block ``r E // n``.

    Pages that are sets of slots rather than runs (the centroid routers' experts) come as a list:
    ``order`` ``(B, H, hi - lo)`` holds the slots of ``[lo, hi)`` page by page, page ``j`` being
    ``order[..., bounds[..., j] : bounds[..., j + 1]]`` (``bounds`` ``(B, H, parts + 1)``).
    The chosen pages together hold at most ``hi - lo`` slots, so a kernel's grid covers that many."""

    index: torch.Tensor
    size: int
    lo: int
    hi: int
    start: int = 0
    parts: int = 1
    order: torch.Tensor | None = None
    bounds: torch.Tensor | None = None

    def mask(self, slots: int) -> torch.Tensor:
        """``(B, H, q, slots)`` bool: the slots read."""
        t = torch.arange(slots, device=self.index.device)
        always = (t < self.lo) | (t >= self.hi)
        if self.order is None:
            page = torch.where(always, -2, (t - self.start) * self.parts // self.size)  # -2: never an index
            chosen = (page[None, None, None, :, None] == self.index[..., None, :]).any(-1)
            return chosen | always
        assert self.bounds is not None
        entry = torch.arange(self.order.shape[-1], device=self.order.device)
        of_entry = (entry[None, None, :, None] >= self.bounds[:, :, None, 1:]).sum(-1)  # (B, H, n)
        page = torch.full((*self.order.shape[:2], slots), -2, dtype=torch.long, device=self.order.device)
        page.scatter_(-1, self.order.long(), of_entry)
        chosen = (page[:, :, None, :, None] == self.index[..., None, :]).any(-1)
        return chosen | always


def additive(mask: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A boolean ``(B, H, q, T)`` mask as additive logits, with a per-unit ``bias`` ``(B, H, T)``."""
    neg = torch.finfo(dtype).min if dtype != torch.float32 else float("-inf")
    base = (
        bias[:, :, None, :].to(dtype)
        if bias is not None
        else torch.zeros((), dtype=dtype, device=mask.device)
    )
    return torch.where(mask, base, torch.full((), neg, dtype=dtype, device=mask.device))


def group_index(index: torch.Tensor, groups: int, q: int) -> torch.Tensor:
    """``index`` ``(B, H, 1, T)`` seen by each of ``groups`` query heads and ``q`` queries: ``(B, H,
    groups, q, T)``, a view (:func:`gather_per_head`'s index; its callers keep it for the layers of
    a step)."""
    b, h, _, t = index.shape
    return index[:, :, None].expand(b, h, groups, q, t)


def gather_per_head(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows.gather(-1, ...)`` per query head: ``rows`` ``(B, H, q, W)`` per KV head, ``index``
    ``(B, H, g, q, T)`` (:func:`group_index`) gives ``(B, H · g, q, T)``, each KV head's row seen by
    its ``g`` query heads: what the gather per KV head repeated over the groups gives, in one
    operation (the rows seen ``g`` times are a view)."""
    b, h, g, q, t = index.shape
    s = rows.stride()
    seen = rows.as_strided((b, h, g, q, rows.shape[-1]), (s[0], s[1], 0, s[2], s[3]))
    return seen.gather(-1, index).view(b, h * g, q, t)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention with a boolean mask per KV head, or per query head (``(B, H_q, q,
    T)``, repeated no further); ``mask=None`` means causal.

    ``bias`` ``(B, H, T)`` adds a logit per stored unit (a merged token's log(count)).

    Returns:
        ``(B, Hq, q, D)``.
    """
    groups = query.shape[1] // key.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=query.shape[2] > 1, scale=scaling, enable_gqa=groups > 1
        )
    attn_mask = mask if bias is None else additive(mask, bias, query.dtype)
    if groups > 1 and attn_mask.shape[1] != query.shape[1]:
        attn_mask = attn_mask.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, scale=scaling, enable_gqa=groups > 1
    )


def attend_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask_fn,
    scaling: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attend` over blocks of queries, each with its own ``mask_fn(start, stop)``
    ``(B, H, stop - start, T)``: a long prefill's mask (and its repeat over the query groups) never
    exists whole, only a block's, of at most ``_BLOCK_ELEMS`` elements."""
    b, hq, q, _ = query.shape
    block = max(1, _BLOCK_ELEMS // max(1, b * hq * key.shape[2]))
    if block >= q:
        return attend(query, key, value, mask_fn(0, q), scaling, bias)
    out = query.new_empty(b, hq, q, value.shape[-1])
    for start in range(0, q, block):
        stop = min(q, start + block)
        out[:, :, start:stop] = attend(
            query[:, :, start:stop], key, value, mask_fn(start, stop), scaling, bias
        )
    return out


def _logits(query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """``(B, H, g, q, T)`` fp32 logits of grouped queries against per-KV-head keys (None: not yet
    scaled).

    The product is taken in the keys' dtype as they are stored where the queries share it: in a
    bfloat16 or float16 model the logits are the product's, rounded to that dtype from its float32
    sums (as the techniques' reference implementations and transformers' eager attention take
    them), then converted and scaled in float32. No float32 copy of the keys is made: a decode
    step would write one at every layer, as large as the keys it reads (issue 29). Queries and
    keys of different dtypes (keys rebuilt in float32) multiply in float32; in float32 nothing is
    converted."""
    b, hq, q, d = query.shape
    h = key.shape[1]
    rows = query.view(b, h, hq // h, q, d)  # the group's queries
    dtype = key.dtype
    if query.dtype != dtype:
        rows, key, dtype = rows.float(), key.float(), torch.float32
    logits = rows.reshape(b, h, hq // h * q, d) @ key.transpose(-1, -2)
    if dtype != torch.float32:
        logits = logits.float()
    if scaling is not None:  # in place: a second (B, H, g, q, T) buffer costs as much as the product
        logits.mul_(scaling)
    return logits.view(b, h, hq // h, q, key.shape[2])


def decode_probs(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """``(B, H, g, 1, T)`` fp32 probabilities of one decode step's grouped queries over every key
    ``(B, H, T, D)`` (no mask: every stored token is in the past of the step's query)."""
    return torch.softmax(_logits(query, key, scaling), dim=-1)


def probs_blocks(
    query: torch.Tensor, key: torch.Tensor, mask_fn, scaling: float, bias=None, causal_past=None
):
    """Yield ``(start, probs)`` for query blocks; ``probs`` ``(B, H, g, q_blk, w)`` fp32 over the
    first ``w <= T`` keys: every key after them is unread by the block's queries (probability 0).

    ``mask_fn(start, stop)`` returns the ``(B, H, stop - start, T)`` read mask of that block (None:
    every token), so a long prefill never materializes a full ``q x T`` mask. ``causal_past``
    (an int) says instead that the mask is plain causal over slots: query ``i`` reads the keys
    ``0 .. causal_past + i`` (a prefill whose stored slots are its positions in order, with
    ``causal_past`` keys before ``query``); no mask is built, only each sub-block's diagonal.
    A causal block longer than ``_SUB`` queries comes in sub-blocks, each only as wide as the keys
    its queries read, so neither the unread columns nor a copy of the block is ever written.
    """
    b, hq, q, _ = query.shape
    t = key.shape[2]
    block = max(1, _BLOCK_ELEMS // max(1, b * hq * t))
    for start in range(0, q, block):
        stop = min(q, start + block)
        part = query[:, :, start:stop]
        if causal_past is None:
            parts = _probs(part, key, mask_fn(start, stop), scaling, bias)
        else:
            parts = _causal_probs(part, key, causal_past + start, scaling, bias)
        for offset, probs in parts:
            yield start + offset, probs


def probs(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float, bias=None):
    """Every query's probabilities at once, ``(B, H, g, q, T)`` fp32 (``mask`` ``(B, H, q, T)`` or
    None): :func:`probs_blocks` assembled, for the few queries of a probe or a test."""
    b, hq, q, _ = query.shape
    h, t = key.shape[1], key.shape[2]
    out = torch.zeros(b, h, hq // h, q, t, dtype=torch.float32, device=query.device)
    for start, part in probs_blocks(
        query, key, lambda s, e: None if mask is None else mask[:, :, s:e], scaling, bias
    ):
        out[:, :, :, start : start + part.shape[3], : part.shape[4]] = part
    return out


def widen(x: torch.Tensor, t: int, fill: float = 0.0) -> torch.Tensor:
    """``x`` ``(..., w)`` over the first ``w`` keys, padded with ``fill`` to all ``t`` keys (a
    narrow block's reduction, widened to the store's layout)."""
    return x if x.shape[-1] == t else F.pad(x, (0, t - x.shape[-1]), value=fill)


def _probs(query: torch.Tensor, key: torch.Tensor, mask, scaling: float, bias):
    """Masked softmax of one block's logits: ``(offset, probs)`` pieces as :func:`probs_blocks`.

    A causal prefill reads ever more keys as its queries advance: queries go in sub-blocks of
    ``_SUB``, each against the keys up to the last one any of them reads (the rows' softmax over
    those keys is the one over every key, whose later logits are ``-inf``).
    """
    reach = _reach(mask, query.shape[2]) if mask is not None else None
    if reach is None:
        unread = None if mask is None else lambda x: x.masked_fill_(~mask[:, :, None], float("-inf"))
        return [(0, _softmax(query, key, scaling, bias, unread))]
    return _sub_blocks(
        query,
        key,
        reach,
        scaling,
        bias,
        lambda s, e, lim, x: x.masked_fill_(~mask[:, :, None, s:e, :lim], float("-inf")),
    )


def _causal_probs(query: torch.Tensor, key: torch.Tensor, past: int, scaling: float, bias):
    """:func:`_probs` of queries at slots ``past .. past + q - 1`` under the plain causal mask, with
    the same sub-blocks: a block of at most ``_SUB`` queries is one softmax over every key (the
    keys after its last query masked whole), a longer one goes in sub-blocks, each against the
    keys up to its last query; only the diagonal square of queries against their own slots is
    masked element by element."""
    q = query.shape[2]
    above = torch.ones(_SUB, _SUB, dtype=torch.bool, device=query.device).triu_(1)  # key after query

    def mask(s: int, e: int, lim: int, logits: torch.Tensor) -> torch.Tensor:
        n = e - s  # the sub-block's queries sit at slots past + s .. lim - 1
        logits[..., lim - n : lim].masked_fill_(above[:n, :n], float("-inf"))
        return logits[..., lim:].fill_(float("-inf"))  # keys after every query of the sub-block

    if q <= _SUB:  # as :func:`_reach`: one softmax over every key
        return [(0, _softmax(query, key, scaling, bias, lambda x: mask(0, q, past + q, x)))]
    reach = [((s, min(q, s + _SUB)), past + min(q, s + _SUB)) for s in range(0, q, _SUB)]
    return _sub_blocks(query, key, reach, scaling, bias, mask)


def _softmax(query: torch.Tensor, key: torch.Tensor, scaling: float, bias, unread) -> torch.Tensor:
    """One softmax of the block's logits over every key; ``unread(logits)`` (or None) sets the
    logits of unread keys to ``-inf`` in place."""
    logits = _logits(query, key, scaling)
    if bias is not None:
        logits.add_(bias[:, :, None, None, :].float())
    if unread is not None:
        unread(logits)
    return torch.softmax(logits, dim=-1)


def _sub_blocks(query, key, reach, scaling: float, bias, mask):
    """Yield ``(start, probs)`` per sub-block of queries ``((start, stop), lim)``: the softmax over
    the keys before ``lim``; ``mask(start, stop, lim, logits)`` sets the unread logits to ``-inf``
    in place."""
    for (start, stop), lim in reach:
        logits = _logits(query[:, :, start:stop], key[:, :, :lim], scaling)
        if bias is not None:
            logits.add_(bias[:, :, None, None, :lim].float())
        mask(start, stop, lim, logits)
        yield start, torch.softmax(logits, dim=-1)


_SUB = 256  # queries per causal sub-block in :func:`_probs`


def _reach(mask: torch.Tensor, q: int) -> list[tuple[tuple[int, int], int]] | None:
    """Sub-blocks of queries with the keys they reach, ``((start, stop), last read key + 1)``; None
    when no sub-block would skip a key, or some query reads no key at all (its row stays NaN)."""
    if q <= _SUB:
        return None
    cols = mask.any(1).any(0)  # (q, T): read by some head-row
    t = cols.shape[-1]
    last = t - cols.flip(-1).int().argmax(-1)  # one past the last read key of each query
    if not bool(cols.any(-1).all()):
        return None
    bounds = [(s, min(q, s + _SUB)) for s in range(0, q, _SUB)]
    reach = torch.stack([last[s:e].amax() for s, e in bounds]).tolist()
    if all(r == t for r in reach):
        return None
    return [(se, int(r)) for se, r in zip(bounds, reach)]


def kv_hit(
    p_stack: torch.Tensor,
    units: torch.Tensor,
    p_full: torch.Tensor,
    exclude: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_u min(P_full(u), P_stack(u)) over the stack's read units, and the same outside ``exclude``.

    Args:
        p_stack: ``(B, H, g, n, T)`` the distribution the stack used over its stored units.
        units: ``(B, H, S)`` the unit (column of ``p_stack``) holding each original position, -1 if
            none; a merged unit holds several positions and compares with their summed mass.
        p_full: ``(B, H, g, n, S)`` softmax over every exact key, ``S`` positions.
        exclude: ``(S,)`` True for sinks, window and the current chunk.

    Returns:
        ``hit`` and ``hit_excl`` per query head and query, ``(B, H, g, n)`` each. ``hit_excl`` is
        the share of the full-cache mass outside ``exclude`` that the stack recovers (NaN if none).
    """
    s = p_full.shape[-1]
    t = p_stack.shape[-1]
    # Positions not stored go to an extra bucket the stack gives no mass.
    idx = torch.where(units >= 0, units, torch.full_like(units, t))[:, :, None, None, :].expand_as(p_full)
    full_on_units = torch.zeros(*p_full.shape[:-1], t + 1, device=p_full.device).scatter_add_(-1, idx, p_full)
    hit = torch.minimum(full_on_units[..., :t], p_stack).sum(-1)
    # Outside the excluded positions: units whose positions are all outside ``exclude``.
    keep = ~exclude[:s]
    unit_excluded = torch.zeros(*units.shape[:2], t + 1, device=p_full.device)
    unit_excluded.scatter_add_(-1, idx[:, :, 0, 0], (~keep).float().expand(*units.shape[:2], s))
    outside = (unit_excluded[..., :t] == 0)[:, :, None, None, :]
    overlap = torch.where(outside, torch.minimum(full_on_units[..., :t], p_stack), 0.0).sum(-1)
    mass = p_full[..., keep].sum(-1)
    return hit, overlap / mass


_PARTS: dict[tuple[object, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _parts_clamps(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower and upper clamps ``(2, 1)`` that split a row of channels into its positive part
    (row 0: at least 0) and its negative part (row 1: at most 0) in one ``clamp``, kept per device
    and dtype (read-only)."""
    key = (devices.device_of(like), like.dtype)
    held = _PARTS.get(key)
    if held is None:
        inf = float("inf")
        with torch.inference_mode(False):  # a plain tensor, also when first asked inside a forward
            lo = torch.tensor([[0.0], [-inf]], dtype=like.dtype, device=like.device)
            hi = torch.tensor([[inf], [0.0]], dtype=like.dtype, device=like.device)
        held = _PARTS[key] = (lo, hi)
    return held


def paired_page_bounds(query: torch.Tensor, paired: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of ``q·k`` over each page, per query head.

    ``Σ_i max(q_i·min_i, q_i·max_i) = q⁺·max + q⁻·min`` (``q⁺``, ``q⁻`` the positive and negative
    parts): one product of ``[q⁺, q⁻]`` (one ``clamp`` against two rows of bounds) with each page's
    maximum and minimum keys side by side, instead of a ``(q, pages, D)`` product (version 2 of
    ``quest``; version 1 took two products and their sum, which round differently).

    Args:
        query: ``(B, Hq, q, D)``.
        paired: ``(B, H, P, 2 D)`` each page's per-channel key maximum, then minimum.

    Returns:
        ``(B, H, g, q, P)`` fp32, ``g = Hq / H`` query heads per KV head.
    """
    b, hq, q, d = query.shape
    h = paired.shape[1]
    grouped = query.float().reshape(b, h, hq // h * q, 1, d)  # the group's queries as rows
    lo, hi = _parts_clamps(grouped)
    parts = torch.clamp(grouped, lo, hi).view(b, h, hq // h * q, 2 * d)  # [q⁺, q⁻]
    bound = parts @ paired.float().transpose(-1, -2)
    return bound.view(b, h, hq // h, q, paired.shape[2])


def page_bounds(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """:func:`paired_page_bounds` of the per-channel minimum and maximum keys ``kmin``, ``kmax``
    ``(B, H, P, D)`` of each page, given apart."""
    return paired_page_bounds(query, torch.cat((kmax, kmin), -1))


def paired_group_bounds(query: torch.Tensor, paired: torch.Tensor) -> torch.Tensor:
    """:func:`paired_page_bounds`' maximum over each KV head's query group: ``(B, H, q, P)`` fp32."""
    return paired_page_bounds(query, paired).amax(2)


def group_bounds(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """:func:`page_bounds`' maximum over each KV head's query group: ``(B, H, q, P)`` fp32, an
    upper bound for every query head of the group (the torch reference of
    :func:`kvbench.kernels.scoring.group_bounds`)."""
    return page_bounds(query, kmin, kmax).amax(2)


def group_scores(query: torch.Tensor, centroid: torch.Tensor) -> torch.Tensor:
    """q · centroid per KV head, summed over the query heads of its group (the torch reference of
    :func:`kvbench.kernels.scoring.group_scores`).

    Args:
        query: ``(B, Hq, q, D)``; centroid: ``(B, H, E, D)``.

    Returns:
        ``(B, H, q, E)`` fp32.
    """
    b, h, _, d = centroid.shape
    summed = query.float().view(b, h, -1, query.shape[2], d).sum(2)  # Σ_g q_g · c = (Σ_g q_g) · c
    return summed @ centroid.float().transpose(-1, -2)
