"""Masked decode attention over a ragged cache (flash-decoding) as a Triton kernel, beside its torch
reference (:func:`kvbench.cache.attention.attend`, same signature).

One decode step, or a short chunk of queries, against a layer whose KV heads hold different
tokens: what a query reads comes from the stored slots' original positions against the query's
(causal, the sliding window; computed in the kernel, no mask is built), the head-rows' lengths,
and where a read selector or padding decides, a per-KV-head boolean mask; an optional logit bias
per stored unit (merged tokens' log(count)). A program takes the query heads of one KV head
(grouped-query attention: the group's queries share every key read) for one query position and
one split of the stored slots; each split keeps a running maximum, sum and output, and
:func:`attend` merges the splits by their log-sum-exp. The mask is read per KV head: it is never
repeated over the query group, and SDPA's fallback to its math kernel for a mask with grouped
queries is gone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvbench.cache import attention as att
from kvbench.cache import ragged
from kvbench.kernels import dispatch


def attend_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    bias: torch.Tensor | None = None,
    lens: torch.Tensor | None = None,
    positions: att.Positions | None = None,
    pages: att.Pages | None = None,
) -> torch.Tensor:
    """The torch path (:func:`kvbench.cache.attention.attend`, SDPA) of :func:`attend`: ``lens``,
    ``positions`` and ``pages`` become masks."""
    if pages is not None:
        mask = pages.mask(key.shape[2]) if mask is None else mask & pages.mask(key.shape[2])
    if lens is not None:
        held = torch.arange(key.shape[2], device=key.device) < lens[..., None, None]
        mask = held if mask is None else mask & held
    if positions is not None:
        mask = positions.mask() if mask is None else mask & positions.mask()
    if mask is None:
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=query.device).expand(
            key.shape[0], key.shape[1], query.shape[2], key.shape[2]
        )
    return att.attend(query, key, value, mask, scaling, bias)


BLOCK_T = 64  # stored slots a program reads at a time
MIN_SPLIT = 256  # stored slots a split covers at least (fewer: the merge reads more than it saves)
MAX_SPLITS = 64
# Programs a decode step keeps in flight: about two per streaming multiprocessor of an H100 or
# H200 (132); where there is no CUDA device (the interpreter), the same figure.
PROGRAMS = 264


@triton.jit(
    do_not_specialize=[
        "T",
        "slots_per_split",
        "window",
        "LO",
        "HI",
        "N_DENSE",
        "START",
        "SPAN",
        "K",
        "N_ORDER",
    ]
)
def _decode_kernel(
    q, k, v, mask, bias, lens, kpos, qpos, pages, m_out, l_out, acc_out,
    H, G, Q, T, D, slots_per_split, scaling, window,
    sq_b, sq_h, sq_q, skv_b, skv_h, sm_b, sm_h, sm_q, sb_b, sb_h, skp_b, skp_h, sqp_b,
    LO, HI, N_DENSE, PAGE, START, SPAN, PARTS, K, order, bounds, N_ORDER,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LENS: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_PAGES: tl.constexpr, HAS_ORDER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, FP32: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # (b, KV head, query position)
    split = tl.program_id(1)
    qi = row % Q
    h = (row // Q) % H
    b = row // (Q * H)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G  # BLOCK_G: the query group rounded up (at least 16, for tl.dot)
    d_ok = d < D
    qs = tl.load(
        q + b * sq_b + (h * G + g[:, None]) * sq_h + qi * sq_q + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP32:  # the interpreter multiplies 16-bit floats as integers: it reads them in float32
        qs = qs.to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    start = split * slots_per_split
    stop = tl.minimum(start + slots_per_split, T)
    if HAS_LENS:  # the head-row's tokens are its first lens slots: read no further
        stop = tl.minimum(stop, tl.load(lens + b * H + h).to(tl.int32))
    if HAS_POS:  # read the positions in (oldest, newest]: causal, within the window (0: none)
        qp = tl.load(qpos + b * sqp_b + qi).to(tl.int64)
        newest = tl.where(qp < 0, 1 << 62, qp)  # a padding query (-1) reads every slot
        oldest = tl.where((qp < 0) | (window == 0), -1, qp - window)
    kv = b * skv_b + h * skv_h  # keys and values share their layout: (T, D) rows, D contiguous
    if HAS_ORDER:  # pages listed in ``order``: the chosen ones' entries one after another
        kk = tl.arange(0, BLOCK_K)
        chosen = tl.load(pages + row * K + kk, mask=kk < K, other=-1)
        first = tl.load(bounds + (b * H + h) * (PARTS + 1) + chosen, mask=chosen >= 0, other=0)
        size = tl.load(bounds + (b * H + h) * (PARTS + 1) + chosen + 1, mask=chosen >= 0, other=0) - first
        ends = tl.sum(tl.where(kk[None, :] <= kk[:, None], size[None, :], 0), axis=1)  # running sizes
        shift = first - (ends - size)  # entry of a chosen page's slot w (w counted over chosen pages)
        stop = tl.minimum(stop, (N_DENSE + tl.sum(size)).to(tl.int32))  # no split past the chosen
    for t0 in range(start, stop, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < stop
        if HAS_ORDER:  # T counts the slots read: [0, LO), [HI, HI + N_DENSE - LO), then the chosen
            w = t - N_DENSE
            inside = (w[:, None] >= (ends - size)[None, :]) & (w[:, None] < ends[None, :])
            entry = w + tl.sum(tl.where(inside, shift[None, :], 0), axis=1)
            listed = tl.sum(inside.to(tl.int32), axis=1) > 0
            slot = tl.load(order + (b * H + h) * N_ORDER + entry, mask=t_ok & (w >= 0) & listed, other=0)
            dense = tl.where(t < LO, t, HI + t - LO)
            t_ok = t_ok & ((w < 0) | listed)
            t = tl.where(w < 0, dense, slot.to(tl.int32))
        elif HAS_PAGES:  # T counts the slots read: [0, LO), [HI, HI + N_DENSE - LO), then K pages
            w = t - N_DENSE  # the slot's place among the chosen pages' (negative: a dense slot)
            page = tl.load(pages + (row * K) + w // PAGE, mask=t_ok & (w >= 0), other=-1)
            # page j: the slots START + ceil(j SPAN / PARTS) up to the next page's first (at most PAGE)
            paged = START + (page * SPAN + PARTS - 1) // PARTS + w % PAGE
            after = START + ((page + 1) * SPAN + PARTS - 1) // PARTS
            dense = tl.where(t < LO, t, HI + t - LO)
            t_ok = t_ok & ((w < 0) | ((page >= 0) & (paged < after) & (paged >= LO) & (paged < HI)))
            t = tl.where(w < 0, dense, paged)
        if HAS_MASK:
            read = t_ok & (tl.load(mask + b * sm_b + h * sm_h + qi * sm_q + t, mask=t_ok, other=0) != 0)
        else:
            read = t_ok
        if HAS_POS:
            kp = tl.load(kpos + b * skp_b + h * skp_h + t, mask=t_ok, other=0).to(tl.int64)
            read = read & (kp <= newest) & (kp > oldest)
        # Block-sparse: keys and values are loaded for the slots read only (a read selector's
        # unread pages or experts cost no memory traffic), and a block with none read is skipped
        if tl.max(read.to(tl.int32), axis=0) > 0:
            tile = read[:, None] & d_ok[None, :]
            kt = tl.load(k + kv + t[:, None] * D + d[None, :], mask=tile, other=0.0)
            vt = tl.load(v + kv + t[:, None] * D + d[None, :], mask=tile, other=0.0)
            if FP32:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            s = (
                tl.dot(qs, tl.trans(kt), out_dtype=tl.float32, input_precision="ieee") * scaling
            )  # (BLOCK_G, BLOCK_T)
            if HAS_BIAS:
                s += tl.load(bias + b * sb_b + h * sb_h + t, mask=read, other=0.0).to(tl.float32)[None, :]
            s = tl.where(read[None, :], s, float("-inf"))  # unread or past the split: no weight
            m_i, l_i, acc = online_softmax(m_i, l_i, acc, s, vt)
    store_partials(m_out, l_out, acc_out, row, split, m_i, l_i, acc, BLOCK_G, BLOCK_D)


@triton.jit
def online_softmax(m_i, l_i, acc, s, v):
    """One block of scores ``s`` (BLOCK_G, BLOCK_T) and values ``v`` (BLOCK_T, BLOCK_D) into the
    running maximum, sum and output."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row that has read nothing yet keeps a -inf maximum: shift by 0 so exp gives 0, not NaN
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - shift[:, None])
    alpha = tl.exp(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def attend_block(m_i, l_i, acc, qs, k, v, read, scaling):
    """One block of keys ``k`` (BLOCK_T, BLOCK_D) and values ``v`` scored against the query group
    ``qs`` (BLOCK_G, BLOCK_D) and taken into the running state (:func:`online_softmax`); slots not
    ``read`` (BLOCK_T,) have no weight."""
    s = tl.dot(qs, tl.trans(k), out_dtype=tl.float32, input_precision="ieee") * scaling
    s = tl.where(read[None, :], s, float("-inf"))
    return online_softmax(m_i, l_i, acc, s, v)


@triton.jit
def store_partials(
    m_out, l_out, acc_out, row, split, m_i, l_i, acc, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr
):
    """A split's state at ``(split, row)`` of :class:`Partials`' ``(S, rows, BLOCK_G[, BLOCK_D])``
    (the grid's first axis is the rows)."""
    at = (split * tl.num_programs(0) + row) * BLOCK_G + tl.arange(0, BLOCK_G)
    tl.store(m_out + at, m_i)
    tl.store(l_out + at, l_i)
    tl.store(acc_out + at[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], acc)


@triton.jit
def _merge_kernel(
    m, l_in, acc, out, S, H, G, Q, D, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
    """One row's output from its ``S`` splits, by their log-sum-exp, in the output's dtype and
    layout ``(B, H * G, Q, D)``: the largest maximum first, then the weighted sums."""
    row = tl.program_id(0)  # (b, KV head, query position)
    rows = tl.num_programs(0)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    top = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    for s in range(0, S):
        top = tl.maximum(top, tl.load(m + (s * rows + row) * BLOCK_G + g))
    top = tl.where(top == float("-inf"), 0.0, top)  # a row that read nothing: zeros, as SDPA gives
    total = tl.zeros((BLOCK_G,), dtype=tl.float32)
    o = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for s in range(0, S):
        at = (s * rows + row) * BLOCK_G + g
        w = tl.exp(tl.load(m + at) - top)
        total += w * tl.load(l_in + at)
        o += w[:, None] * tl.load(acc + at[:, None] * BLOCK_D + d[None, :])
    o = o / tl.where(total == 0.0, 1.0, total)[:, None]
    qi = row % Q
    bh = row // Q  # b * H + h: its query heads are bh * G .. bh * G + G - 1
    at = ((bh * G + g[:, None]) * Q + qi) * D + d[None, :]
    tl.store(out + at, o.to(out.dtype.element_ty), mask=(g[:, None] < G) & (d[None, :] < D))


@dataclass
class Partials:
    """Per-split softmax state of a decode step: running maximum ``m`` and sum ``l``
    ``(S, B * H * Q, BLOCK_G)`` and output ``acc`` ``(S, B * H * Q, BLOCK_G, BLOCK_D)``, float32,
    for ``S`` splits of the stored slots (rows: a KV head's query group, padded to ``BLOCK_G``).
    Taken from the device's :class:`Workspace`; valid until merged."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741
    acc: torch.Tensor


class Workspace:
    """Float32 room for the split states of a device's decode steps (of one ``BLOCK_D``), kept
    between calls: a step's segments take their :class:`Partials` one after another (adjacent, so
    one merge reads them all, with no copy), and the merge gives the room back. No allocation and
    no fill per call: every program of a kernel writes its split's state."""

    def __init__(self, device: torch.device, block_d: int):
        self.device, self.block_d = device, block_d
        self.m = self.l = self.acc = torch.empty(0, dtype=torch.float32, device=device)
        self.used = 0  # elements of ``m`` (and ``l``) taken; ``acc`` takes BLOCK_D times as many

    def take(self, splits: int, rows: int, block_g: int) -> Partials:
        n, block_d = splits * rows * block_g, self.block_d
        if self.used + n > self.m.numel():  # more room; what was taken keeps the old tensors
            size = max(2 * n, self.m.numel(), 1 << 14)  # the same room again, or twice the need
            self.m, self.l = (torch.empty(size, dtype=torch.float32, device=self.device) for _ in "ml")
            self.acc = torch.empty(size * block_d, dtype=torch.float32, device=self.device)
            self.used = 0
        lo, hi = self.used, self.used + n
        self.used = hi
        return Partials(
            self.m[lo:hi].view(splits, rows, block_g),
            self.l[lo:hi].view(splits, rows, block_g),
            self.acc[lo * block_d : hi * block_d].view(splits, rows, block_g, block_d),
        )

    def _at(self, parts: Partials) -> int | None:
        """Where ``parts`` start in this room (in elements of ``m``), or None if not taken here."""
        if parts.m.untyped_storage().data_ptr() != self.m.untyped_storage().data_ptr():
            return None
        return (parts.m.data_ptr() - self.m.data_ptr()) // 4

    def adjacent(self, parts: list[Partials]) -> Partials | None:
        """``parts`` as one :class:`Partials`, where they were taken one after another from this
        room for the same rows; None otherwise."""
        lo, shape = self._at(parts[0]), parts[0].m.shape[1:]
        at = lo
        for p in parts:
            if at is None or self._at(p) != at or p.m.shape[1:] != shape:
                return None
            at += p.m.numel()
        assert lo is not None and at is not None
        s = sum(p.m.shape[0] for p in parts)
        return Partials(
            self.m[lo:at].view(s, *shape),
            self.l[lo:at].view(s, *shape),
            self.acc[lo * self.block_d : at * self.block_d].view(s, *shape, self.block_d),
        )

    def give_back(self, parts: Partials) -> None:
        """The room of ``parts`` (merged), where they were the last taken."""
        lo = self._at(parts)
        if lo is not None and lo + parts.m.numel() == self.used:
            self.used = lo


_WORKSPACES: dict[tuple[torch.device, int], Workspace] = {}


def workspace(device: torch.device, block_d: int) -> Workspace:
    room = _WORKSPACES.get((device, block_d))
    if room is None:
        room = _WORKSPACES[device, block_d] = Workspace(device, block_d)
    return room


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in Python (``triton.cdiv`` costs microseconds a call on the host)."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The least power of two at least ``n`` (``triton.next_power_of_2``, in Python)."""
    return 1 << max(n - 1, 0).bit_length()


def blocks(query: torch.Tensor, kv_heads: int) -> tuple[int, int]:
    """``BLOCK_G`` (the query group, at least 16 rows for ``tl.dot``) and ``BLOCK_D``."""
    return max(16, pow2(query.shape[1] // kv_heads)), max(16, pow2(query.shape[-1]))


def empty_partials(
    query: torch.Tensor, kv_heads: int, splits: int, sizes: tuple[int, int] | None = None
) -> Partials:
    """Room for the state of ``splits`` splits of every row of ``query``'s step, uninitialised (the
    kernel writes it all; see :func:`no_reads` where none runs); ``sizes``: :func:`blocks`, if made."""
    b, _, nq, _ = query.shape
    block_g, block_d = sizes or blocks(query, kv_heads)
    return workspace(query.device, block_d).take(splits, b * kv_heads * nq, block_g)


def no_reads(parts: Partials) -> Partials:
    """``parts`` as the state of splits that read nothing (where no kernel ran)."""
    parts.m.fill_(float("-inf"))
    parts.l.zero_()
    parts.acc.zero_()
    return parts


def row_starts(lens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Each head-row's first flat entry: from the count every head-row holds where it is known on
    the host (``(count, lens)``, no launch), else ``(-1, starts)`` summed on the device."""
    count = ragged.told(lens)
    if count is not None:
        return count, lens
    return -1, torch.cumsum(lens, 0) - lens


def head_row_layout(
    lens: torch.Tensor, fields: list[torch.Tensor], per_row: bool
) -> tuple[list[torch.Tensor], int, int, torch.Tensor]:
    """Where a kernel finds each head-row's tokens in a segment's per-token ``fields``: ``(fields,
    row_len, row_stride, starts)``.

    Flat head-major fields ``(N, ...)`` (contiguous copies where they are not): ``row_len`` and
    ``starts`` as :func:`row_starts` gives them, ``row_stride`` equal to ``row_len``. Per head-row
    rectangles ``(BH, n, ...)`` (``per_row``: a packed segment's buffers,
    :func:`kvbench.cache.segments.packed_rows`): ``row_len`` ``n`` and ``row_stride`` the slots
    between two head-rows' first tokens, the same for every field (else contiguous copies, ``n``
    apart)."""
    if not per_row:
        row_len, starts = row_starts(lens)
        return [x.contiguous() for x in fields], row_len, row_len, starts
    n = fields[0].shape[1]
    apart = {x.stride(0) // max(1, math.prod(x.shape[2:])) for x in fields}
    if len(apart) != 1 or not all(x[:1].is_contiguous() for x in fields):
        return [x.contiguous() for x in fields], n, n, lens
    return fields, n, apart.pop(), lens


def split_slots(slots: int, rows: int) -> tuple[int, int]:
    """Splits of ``slots`` stored slots, for ``rows`` rows of queries, and slots a split (a multiple
    of ``BLOCK_T``): enough splits to keep :data:`PROGRAMS` programs in flight, each at least
    :data:`MIN_SPLIT` slots, at most :data:`MAX_SPLITS`."""
    want = cdiv(PROGRAMS, max(rows, 1))
    splits = max(1, min(want, cdiv(slots, MIN_SPLIT), MAX_SPLITS))
    per_split = cdiv(cdiv(slots, splits), BLOCK_T) * BLOCK_T
    return max(1, cdiv(slots, per_split)), per_split


def partials(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    bias: torch.Tensor | None = None,
    lens: torch.Tensor | None = None,
    positions: att.Positions | None = None,
    pages: att.Pages | None = None,
) -> Partials:
    """The softmax state of :func:`attend` per split, before the splits are merged (:func:`merge`
    joins them with other segments' of the same step)."""
    launch = prepare(query, key, value, mask, scaling, bias, lens, positions, pages)
    if launch.args:
        _decode_kernel[launch.grid](*launch.args, **launch.constants)
    return launch.out


@dataclass
class Launch:
    """One call of the decode kernel, its arguments made (:func:`prepare`): the grid, the
    arguments and compile-time constants, and the partials it writes (``args`` empty: nothing to
    read, ``out`` already says so)."""

    grid: tuple[int, int]
    args: tuple
    constants: dict[str, Any]
    out: Partials


def prepare(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    bias: torch.Tensor | None = None,
    lens: torch.Tensor | None = None,
    positions: att.Positions | None = None,
    pages: att.Pages | None = None,
) -> Launch:
    """The :class:`Launch` of :func:`partials` (its arguments' layout, the split count, the room
    in the workspace), apart from the launch itself, which ``scripts/bench_kernels.py`` times alone."""
    b, hq, nq, d = query.shape
    h, t = key.shape[1], key.shape[2]
    query = query if query.stride(-1) == 1 else query.contiguous()
    key, value = _rows(key, d), _rows(value, d)
    if key.stride()[:2] != value.stride()[:2]:
        key, value = key.contiguous(), value.contiguous()
    if mask is not None:
        mask = mask.view(torch.uint8) if mask.stride(-1) == 1 else mask.contiguous().view(torch.uint8)
    read = t  # the slots the grid covers: every slot, or the dense ranges and the chosen pages
    index, lo, hi, n_dense, page, k_pages = None, 0, 0, 0, 1, 0
    start, span, parts = 0, 1, 1
    order = bounds = None
    if pages is not None:
        lo, hi, start, span, parts = pages.lo, pages.hi, pages.start, pages.size, pages.parts
        page = -(-span // parts)  # the longest page
        n_dense, k_pages = lo + max(t - hi, 0), pages.index.shape[-1]
        index = pages.index.contiguous()  # (B, H, q, K): a row's K pages in a row
        read = n_dense + k_pages * page
        if pages.order is not None and pages.bounds is not None:  # listed pages: at most hi - lo slots
            order, bounds = pages.order.contiguous(), pages.bounds.contiguous()
            read = n_dense + order.shape[-1]
    splits, per_split = split_slots(read, b * h * nq)
    block_g, block_d = blocks(query, h)
    out = empty_partials(query, h, splits, (block_g, block_d))
    mask_strides = (mask.stride(0), mask.stride(1), mask.stride(2)) if mask is not None else (0, 0, 0)
    bias_strides = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    held = None if lens is None else lens.contiguous()
    kpos = qpos = None
    if positions is not None:
        kpos = positions.key if positions.key.stride(-1) == 1 else positions.key.contiguous()
        qpos = positions.query if positions.query.stride(-1) == 1 else positions.query.contiguous()
    pos_strides = (
        (kpos.stride(0), kpos.stride(1), qpos.stride(0))
        if kpos is not None and qpos is not None
        else (0, 0, 0)
    )
    window = positions.window if positions is not None and positions.window is not None else 0
    m = out.m
    if not (m.shape[1] and t and read):
        return Launch((0, 0), (), {}, no_reads(out))
    args = (
        query, key, value, m if mask is None else mask, m if bias is None else bias,
        m if held is None else held, m if kpos is None else kpos, m if qpos is None else qpos,
        m if index is None else index, m, out.l, out.acc,
        h, hq // h, nq, read, d, per_split, scaling, window,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1),
        *mask_strides, *bias_strides, *pos_strides, lo, hi, n_dense, page, start, span, parts, k_pages,
        m if order is None else order, m if bounds is None else bounds,
        0 if order is None else order.shape[-1],
    )  # fmt: skip
    constants = dict(
        HAS_MASK=mask is not None, HAS_BIAS=bias is not None, HAS_LENS=held is not None,
        HAS_POS=positions is not None, HAS_PAGES=pages is not None, HAS_ORDER=order is not None,
        BLOCK_K=2 if order is None else max(2, pow2(k_pages)),
        BLOCK_G=block_g, BLOCK_T=BLOCK_T, BLOCK_D=block_d, FP32=dispatch.interpreted(),
    )  # fmt: skip
    return Launch((m.shape[1], splits), args, constants, out)


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` ``(B, H, T, D)`` with each head-row's slots as consecutive rows of ``D`` (the layout
    the kernel reads; a view of the cache's rows is)."""
    return x if x.stride(-1) == 1 and (x.shape[2] < 2 or x.stride(2) == d) else x.contiguous()


def merge(parts: list[Partials], query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The attention output ``(B, Hq, Q, D)`` (the query's dtype) from the splits of one or more
    :class:`Partials` of the same step, merged by their log-sum-exp in one launch:
    ``sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s``. A query that read nothing gets zeros, as
    SDPA gives. Parts taken one after another from the workspace are read where they are."""
    b, hq, nq, d = query.shape
    room = workspace(query.device, parts[0].acc.shape[-1])
    whole = parts[0] if len(parts) == 1 else room.adjacent(parts)
    if whole is None:  # taken apart (not in one step's turn): joined by a copy
        whole = Partials(*(torch.cat([getattr(p, f) for p in parts]) for f in ("m", "l", "acc")))
    splits, rows, block_g, block_d = whole.acc.shape
    out = torch.empty(b, hq, nq, d, dtype=query.dtype, device=query.device)
    if rows:
        _merge_kernel[(rows,)](
            whole.m, whole.l, whole.acc, out, splits, kv_heads, hq // kv_heads, nq, d,
            BLOCK_G=block_g, BLOCK_D=block_d,
        )  # fmt: skip
    room.give_back(whole)
    return out


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    bias: torch.Tensor | None = None,
    lens: torch.Tensor | None = None,
    positions: att.Positions | None = None,
    pages: att.Pages | None = None,
) -> torch.Tensor:
    """:func:`attend_reference` for a decode step or a short chunk: query ``(B, Hq, Q, D)``, keys
    and values ``(B, H, T, D)``, ``mask`` ``(B, H, Q, T)`` bool (per KV head; None: every slot;
    a stride of 0 over ``Q`` reads one row for all queries), ``bias`` ``(B, H, T)``, ``lens``
    ``(B, H)``: each head-row holds its first ``lens`` slots (the kernel reads no further, so a
    ragged layer costs its stored tokens, not its longest head's), ``positions``: causal over the
    original positions and the sliding window, computed in the kernel instead of read from a mask;
    ``pages`` (without ``mask``, ``lens`` or ``positions``): a read selector's pages, the grid
    covering those pages and the always-read slots only, so a step costs the pages it reads.
    Returns ``(B, Hq, Q, D)`` in the query's dtype."""
    assert pages is None or (mask is None and lens is None and positions is None)
    parts = partials(query, key, value, mask, scaling, bias, lens, positions, pages)
    return merge([parts], query, key.shape[1])
