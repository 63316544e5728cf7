"""Quest: query-aware page selection over a cache that keeps every token (arXiv:2406.10774).

Each KV head-row's stored tokens, in position order, form pages of ``page_size`` tokens. Every
full page carries the per-channel minimum and maximum of its keys (as attention reads them:
dequantized when a compressor packed them), kept flat in the layer's side data
(:class:`PageBounds`) so ``store.nbytes()`` counts them. For a query ``q`` the page bound ``Σ_i
max(q_i·min_i, q_i·max_i)`` is never below ``q·k`` for any key of the page. Each query reads the
top pages by bound: as many whole pages as the budget left after the tokens always read holds
(:func:`pages_read`).

Deviations from the paper, kvbench's choices:

- GQA: Quest is defined per attention head (MHA). Here one KV head-row is read once for its
  whole query group, so a page's bound is the **maximum over the group's query heads** of their
  bounds; it stays an upper bound for every query head of the group.
- The budget is a fraction of the stored tokens of each head-row (``budget_tokens`` gives the
  paper's absolute token budget); sinks, the window, protected positions, the current chunk, the
  partial last page, and every page holding one of them, are always read and count inside it.
  The tokens left buy whole pages, a page where at least half of one fits, and each query reads
  that many pages, the best by bound (ties: the earlier page), as the reference reads a number of
  pages. (Versions 1-2 left a page cut by the sinks or the window selectable, its other tokens
  costing their share of the budget: which pages fitted then depended on which were chosen, a
  running sum at every layer.)
- Queries of every chunk after the first compression point are selected (the paper selects at
  decode only; a decode step is one such chunk); earlier queries of a chunk read densely.
- Page metadata is derived from the stored keys after every forward, in :meth:`evict`: over a
  cache in position order only the pages filled since the last forward are reduced, and every
  page again after a change to stored tokens (an eviction, a move into a representation); the
  paper updates the last page in place. The pages and bounds are the same.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from kvbench.cache import attention as att
from kvbench.cache import devices, ragged
from kvbench.cache.reads import ReadCount, ReadMeter, count_reads, one_step
from kvbench.cache.side import SideData
from kvbench.cache.surface import TechniqueStore, chunk_start, protected_from
from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.roles import Flags, Scheduler


@dataclass
class PageBounds(SideData):
    """Per-channel maximum and minimum keys of every full page, head-major, side by side:
    ``paired`` ``(M, 2, D)`` (one tensor, so a read takes both in one product:
    :func:`kvbench.cache.attention.paired_page_bounds`), in the keys' dtype, counted in the layer's
    bytes; ``wide`` the same in float32, as the torch path's product takes them, made once a page
    (``paired`` itself in a float32 model; held, so the resident bytes count it, not the stored)."""

    paired: torch.Tensor
    wide: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.paired]

    @property
    def kmax(self) -> torch.Tensor:
        """``(M, D)`` each page's per-channel maximum key (a view)."""
        return self.paired[:, 0]

    @property
    def kmin(self) -> torch.Tensor:
        """``(M, D)`` each page's per-channel minimum key (a view)."""
        return self.paired[:, 1]


@dataclass
class _Read:
    """One call's reads (:class:`ReadMeter`): its layer, its tokens and bytes read, and the page
    bounds' bytes read per real query (None in a dense layer)."""

    layer: int
    count: ReadCount
    meta: torch.Tensor | float | None

    def tensors(self) -> list[torch.Tensor | float]:
        return [*self.count.tensors(), *([] if self.meta is None else [self.meta])]


@overload
def pages_read(extra: int, page_size: int) -> int: ...
@overload
def pages_read(extra: torch.Tensor, page_size: int) -> torch.Tensor: ...
def pages_read(extra: int | torch.Tensor, page_size: int) -> int | torch.Tensor:
    """The pages a query reads with ``extra`` tokens of its budget left after those it always
    reads (a host figure, or one per head-row): page ``i`` (from 0) is read while at least half of
    it fits, ``i · page_size + page_size / 2 < extra``, that is ``ceil((2 extra - page_size) / (2
    page_size))`` pages, none where ``extra`` is too small."""
    if isinstance(extra, int):
        return max(0, (2 * extra + page_size - 1) // (2 * page_size))
    return torch.div(2 * extra + page_size - 1, 2 * page_size, rounding_mode="floor").clamp(min=0)


@dataclass
class _Pages:
    """What :meth:`QuestScheduler.pages` derives from positions, for the layers of a step.

    Attributes:
        n_full: ``(B, H)`` full pages per head-row, ``total`` of them, ``width`` at most (None
            where every head-row has ``width``: :meth:`QuestScheduler._uniform_pages`).
        blocked: ``(B, H, 1, P)`` the pages that are not selectable (one token of theirs at least
            is always read); None where ``span`` is set.
        count: the pages each query reads (:func:`pages_read`): an int where every head-row has
            the same, else ``(B, H, 1, 1)``, never more than its selectable pages.
        index: ``(B, H, 1, T)`` each token's column in a row of :meth:`take`'s pages read: its
            page's (from ``j0`` where ``span`` is set), ``C`` (never read) for an empty slot,
            ``C + 1`` (always read) for the others, ``C`` the columns of pages.
        base: ``(B, H, 1, C + 2)`` bool, only column ``C + 1`` set.
        span: the selectable pages ``[j0, j1)``, where every head-row has the same (none outside
            them is, so nothing is blocked inside; ``C = j1 - j0``); None: ``blocked`` says which
            are not (``C = width``).
        seen: ``index`` seen by each query head of a group (:meth:`take`), kept for the step's
            layers.
    """

    key: tuple[Any, ...] | None
    n_full: torch.Tensor | None
    total: int
    width: int
    blocked: torch.Tensor | None
    count: torch.Tensor | int
    index: torch.Tensor
    base: torch.Tensor
    # Where every head-row holds the same positions (:meth:`QuestScheduler._uniform_pages`): every
    # slot before ``lo`` or from ``hi`` on is read whatever the bounds (-1: not known on the host)
    lo: int = -1
    hi: int = -1
    span: tuple[int, int] | None = None
    seen: torch.Tensor | None = None  # ``index`` seen per query head (:meth:`take`)

    def choose(self, bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | bool]:
        """The pages read by ``bound`` ``(B, H, q, P)``: the selectable pages best first, ties in
        page order (``order``: from ``j0`` where ``span`` is set, the blocked pages last where it
        is not), and whether each is read (a prefix of ``count`` pages). Where ``count`` is a host
        figure, ``order`` holds the pages read alone, and the second is True."""
        if self.span is not None:
            score = bound[..., self.span[0] : self.span[1]]
        else:
            assert self.blocked is not None
            score = bound.masked_fill(self.blocked, float("-inf"))  # bounds are finite: blocked last
        order = score.argsort(dim=-1, descending=True, stable=True)
        if isinstance(self.count, int):
            return order[..., : self.count], True
        return order, (devices.arange(order.shape[-1], order) < self.count).expand_as(order)

    def take(self, bound: torch.Tensor, groups: int = 1) -> torch.Tensor:
        """The tokens read ``(B, H, q, T)`` where ``bound`` ``(B, H, q, P)`` bounds each page's
        scores (:meth:`choose`), with the tokens always read; with ``groups`` query heads a KV
        head, per query head ``(B, H · groups, q, T)``: one gather from the pages read seen
        ``groups`` times, not the mask made and then repeated."""
        order, fits = self.choose(bound)  # ``order`` indexes the pages' columns of ``base``
        b, h, q, _ = bound.shape
        base = self.base.expand(b, h, q, self.base.shape[-1])
        pages = base.scatter(-1, order, fits)  # one out-of-place scatter (no copy, then scatter)
        if groups == 1:
            return torch.gather(pages, -1, self.index.expand(b, h, q, self.index.shape[-1]))
        seen = self.seen
        if seen is None or seen.shape[2:4] != (groups, q):  # kept for the layers of the step
            seen = self.seen = att.group_index(self.index, groups, q)
        return att.gather_per_head(pages, seen)


# the page of each slot ``t``, ``t // page_size``, per (page size, dtype, device): read-only
_PAGE_OF: dict[tuple[int, torch.dtype, object], torch.Tensor] = {}
# per device: the last ``width`` asked for and its :attr:`_Pages.base` (read-only)
_BASE: dict[object, tuple[int, torch.Tensor]] = {}


def page_of(slots: int, page_size: int, like: torch.Tensor) -> torch.Tensor:
    """``arange(slots) // page_size`` ``(slots,)`` in ``like``'s dtype and device: a prefix of one
    made once and grown by doubling (read-only)."""
    key = (page_size, like.dtype, devices.device_of(like))
    held = _PAGE_OF.get(key)
    if held is None or held.shape[0] < slots:
        n = max(slots, 2 * (0 if held is None else held.shape[0]), 1024)
        held = _PAGE_OF[key] = torch.arange(n, dtype=like.dtype, device=like.device) // page_size
    return held[:slots]


def path_bounds(bounds: PageBounds, batch: int, columns: int) -> tuple[Any, torch.Tensor]:
    """The cell's path for the pages' bounds (:func:`kvbench.kernels.dispatch.kernels`' for scoring,
    or None: torch) and the bounds ``(M, 2, D)`` it reads: as stored for the kernel, float32 for
    torch (:attr:`PageBounds.wide`)."""
    kernels = dispatch.kernels("scoring", batch, columns)
    return kernels, bounds.wide if kernels is None else bounds.paired


def paired_bounds(query: torch.Tensor, paired: torch.Tensor, kernels: Any) -> torch.Tensor:
    """``(B, H, q, P)``: Quest's bound of each page, its maximum over the query group, by the cell's
    path (``kernels``: the Triton kernels, :func:`kvbench.kernels.dispatch.kernels`' for scoring, or
    None: :func:`kvbench.cache.attention.paired_group_bounds`), from the pages' keys ``paired``
    ``(B, H, P, 2 D)`` (maximum, then minimum; float32 on the torch path, as :attr:`PageBounds.wide`)."""
    if kernels is None:
        return att.paired_group_bounds(query, paired)
    d = paired.shape[-1] // 2
    return kernels.group_bounds(query, paired[..., d:], paired[..., :d])  # kmin, kmax: views


def page_base(width: int, like: torch.Tensor) -> torch.Tensor:
    """:attr:`_Pages.base` ``(1, 1, 1, width + 2)`` of ``width`` pages, made once while ``width`` is
    the last asked for on ``like``'s device (the layers of a step, and the steps until a page fills)."""
    key = devices.device_of(like)
    held = _BASE.get(key)
    if held is None or held[0] != width:
        base = torch.zeros(1, 1, 1, width + 2, dtype=torch.bool, device=like.device)
        base[..., width + 1] = True
        held = _BASE[key] = (width, base)
    return held[1]


@dataclass
class QuestScheduler(Scheduler):
    """Keeps every token; each query reads the top pages of its KV head by Quest's bound.

    Args:
        page_size: tokens per page.
        dense_layers: the first layers read every token (the paper leaves two dense).
    """

    name: str = "quest"
    # 2: a page's bound in one product of the query's positive and negative parts with its maximum
    # and minimum keys side by side (issue 29, CHANGELOG.md)
    # 3: a query reads as many pages as the budget left holds, the best by bound, each taking a
    # whole page's place as in the reference (no running sum of each page's unread tokens)
    version = 3
    page_size: int = 16
    dense_layers: int = 2
    flags = Flags(selects_reads=True)
    meter: ReadMeter = field(default_factory=ReadMeter, init=False, repr=False)  # reads until settled
    # bytes read per query in this step (K/V, page metadata), and per step
    _step: list[float] = field(default_factory=lambda: [0.0, 0.0], init=False, repr=False)
    _steps: list[tuple[float, float]] = field(default_factory=list, init=False, repr=False)
    # tokens read and visible: in the dense layers, then in the selected layers
    _tokens: list[float] = field(default_factory=lambda: [0.0] * 4, init=False, repr=False)
    _meta_bytes: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # per layer, stored
    _shared: _Pages | None = field(default=None, init=False, repr=False)  # the step's pages, for its layers
    # per store: (its ``edits``, full pages, their maximum and minimum keys ``(B * H, P, 2, D)``)
    _kept_bounds: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )

    def check_knobs(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"scheduler.page_size={self.page_size}: must be >= 1")
        if self.dense_layers < 0:
            raise ConfigError(f"scheduler.dense_layers={self.dense_layers}: must be >= 0")

    def evict(self, layer: int, store: TechniqueStore) -> None:
        """Nothing is evicted: the min/max keys of every full page of every head-row."""
        if layer < self.dense_layers:
            return
        # every slot a token, in position order: the full-precision rows alone, every head-row full
        if store.in_position_order() and store.fp.rows.uniform:
            self._grow_pages(layer, store)
            return
        view = store.view()
        b, h, t, d = view.k.shape
        p = self.page_size
        last = torch.full_like(view.pos, torch.iinfo(view.pos.dtype).max)
        order = torch.where(view.valid, view.pos, last).argsort(-1)
        keys = torch.gather(view.k, 2, order[..., None].expand(b, h, t, d))
        npages = -(-t // p)
        keys = torch.nn.functional.pad(keys, (0, 0, 0, npages * p - t)).view(b, h, npages, p, d)
        full = devices.arange(npages, keys) < (view.valid.sum(-1) // p)[..., None]  # (B, H, P)
        low, high = torch.aminmax(keys, dim=3)
        paired = torch.stack((high, low), 3)[full]
        self._set_bounds(layer, store, paired, paired.float())
        self._kept_bounds.pop(store, None)

    def _set_bounds(
        self, layer: int, store: TechniqueStore, paired: torch.Tensor, wide: torch.Tensor
    ) -> None:
        store.set_side(PageBounds(paired, wide))
        self._meta_bytes[layer] = paired.numel() * paired.element_size()

    def _grow_pages(self, layer: int, store: TechniqueStore) -> None:
        """:meth:`evict` when every slot is a token in position order: the pages are the view's
        consecutive ``page_size`` slots. Pages bounded at the last call are kept while no stored
        token changed since (``store.edits``); only pages filled since are reduced (a minimum
        and maximum are exact, so the bounds are those a full pass gives)."""
        stored = store.keys()
        b, h, t, d = stored.shape
        p = self.page_size
        n_full = t // p
        prev = self._kept_bounds.get(store)
        if prev is not None and prev[0] == store.edits and prev[1] <= n_full:
            done, paired, wide = prev[1:]
        else:
            done, paired = 0, stored.new_empty(b * h, 0, 2, d)
            wide = paired.float()
        if n_full > done:
            keys = stored[:, :, done * p : n_full * p].reshape(b * h, n_full - done, p, d)
            low, high = torch.aminmax(keys, dim=2)
            new = torch.stack((high, low), 2)
            paired = torch.cat([paired, new], dim=1)
            wide = paired if paired.dtype == torch.float32 else torch.cat([wide, new.float()], dim=1)
        self._kept_bounds[store] = (store.edits, n_full, paired, wide)
        self._set_bounds(layer, store, paired.view(-1, 2, d), wide.view(-1, 2, d))

    def read_mask(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        return self._read(layer, store, query, qpos, 1)

    def read_head_mask(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`read_mask` per query head ``(B, H_q, q, T)`` where pages are chosen (per KV head
        where every query reads the same tokens: the read then repeats it), for a torch read that
        would repeat the mask over each KV head's query group."""
        return self._read(layer, store, query, qpos, query.shape[1] // store.kv_heads)

    def _read(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor, groups: int
    ) -> torch.Tensor:
        """:meth:`read_mask`, with the pages' mask per query head for ``groups`` query heads a KV
        head (:meth:`_Pages.take`); the reads are counted from its rows of one query head a group,
        or on the host where every head-row reads the same number of whole pages."""
        b, h, t, d = store.batch, store.kv_heads, store.columns(), store.head_dim  # the view's shape
        q = query.shape[2]
        if layer < self.dense_layers:
            self._account(layer, store, query, qpos, None, None)
            return store.view().valid[:, :, None, :].expand(b, h, q, t)
        key = store.position_key(qpos)
        lay = self.pages(store, qpos, None) if key is None else self._step_pages(store, qpos, key)
        bounds = store.side(PageBounds)
        if bounds is None or lay.total != bounds.paired.shape[0]:
            raise RuntimeError("quest: page metadata is stale (evict() must run after every forward)")
        width = lay.width
        if width == 0:  # no full page yet: every stored token is always read
            mask = store.view().valid[:, :, None, :].expand(b, h, q, t)
            self._account(layer, store, query, qpos, mask, 0.0)
            return mask
        kernels, kept = path_bounds(bounds, b, t)
        if key is not None:  # every head-row holds the same full pages
            paired = kept.view(b, h, width, 2 * d)
        else:
            assert lay.n_full is not None  # pages not derived from positions alone
            flat = kept.view(-1, 2 * d)
            paired = ragged.to_padded(flat, lay.n_full.flatten())[0].view(b, h, width, 2 * d)
        mask = lay.take(paired_bounds(query, paired, kernels), groups)
        per_page = 2 * d * bounds.paired.element_size()
        if key is not None:  # every query real: the bytes of the bounds per query, from the host
            meta: torch.Tensor | float = float(lay.total * per_page * q) / float(b * q)
        else:
            assert lay.n_full is not None
            meta = lay.n_full * per_page
        if isinstance(lay.count, int) and len(store.segments) == 1 and one_step(store, qpos):
            # whole pages over full rows, every query real: the tokens read are host figures
            self._account(layer, store, query, qpos, None, meta, self._host_read(lay, b * h * q, t))
        else:
            self._account(layer, store, query, qpos, mask if groups == 1 else mask[:, ::groups], meta)
        return mask

    def read_pages(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> att.Pages | None:
        """:meth:`read_mask` as the pages each query reads (:class:`att.Pages`), for a kernel whose
        grid covers those pages only: where every head-row holds the same positions and some full
        page exists; None elsewhere (the engine then asks :meth:`read_mask`). The same tokens are
        read, and counted, as the mask reads."""
        key = store.position_key(qpos)
        if layer < self.dense_layers or key is None or not one_step(store, qpos):
            return None
        lay = self._step_pages(store, qpos, key)  # read_mask reuses it where this gives None
        bounds = store.side(PageBounds)
        # ``hi`` is known where the pages are every head-row's alike (:meth:`_uniform_pages`)
        if lay.width == 0 or lay.hi < 0 or bounds is None or lay.total != bounds.paired.shape[0]:
            return None
        b, h, t, d = store.batch, store.kv_heads, store.columns(), store.head_dim
        q = query.shape[2]
        kernels, kept = path_bounds(bounds, b, t)
        bound = paired_bounds(query, kept.view(b, h, lay.width, 2 * d), kernels)
        order, _ = lay.choose(bound)  # the pages read alone: ``count`` is a host figure here
        assert lay.span is not None and isinstance(lay.count, int)  # set where ``hi`` is
        j0 = lay.span[0]
        index = order + j0 if j0 else order
        per_page = 2 * d * bounds.paired.element_size()
        meta = float(lay.total * per_page * q) / float(b * q)
        self._account(layer, store, query, qpos, None, meta, self._host_read(lay, b * h * q, t))
        return att.Pages(index, self.page_size, lay.lo, lay.hi)

    def _host_read(self, lay: _Pages, rows: int, slots: int) -> float:
        """Tokens read by ``rows`` query rows over ``slots`` slots where ``lay``'s pages are host
        figures (``count`` an int, ``lo`` and ``hi`` known): the slots read whatever the bounds, and
        ``count`` whole pages."""
        assert isinstance(lay.count, int)
        return float(rows * (lay.lo + slots - lay.hi + lay.count * self.page_size))

    def _step_pages(self, store: TechniqueStore, qpos: torch.Tensor, key: tuple[Any, ...]) -> _Pages:
        """:meth:`pages` where they derive from positions alone (``key``: :meth:`LayerStore.position_key`):
        made at a step's first layer and shared by the others."""
        key = (*key, self.budget, self.page_size)
        if self._shared is None or self._shared.key != key:
            self._shared = self.pages(store, qpos, key)
        return self._shared

    def pages(self, store: TechniqueStore, qpos: torch.Tensor, key: tuple[Any, ...] | None) -> _Pages:
        """The pages of the tokens stored before the chunk of the queries at ``qpos``, and what every
        query reads whatever its bounds (sinks, window, protected positions, the chunk, the partial
        last page)."""
        pf = store.protect_from_host
        if key is not None and (pf is None or len(set(pf)) == 1):
            return self._uniform_pages(store, qpos, key)
        view = store.view()
        start = chunk_start(store, qpos)[:, None, None]
        prior = view.valid & (view.pos < start)
        page, in_page, n_full = self.layout(view.pos, prior, store.in_position_order())
        protected = self.budget.protected(view.pos, start, protected_from(store))
        pageable = in_page & ~protected  # in a full page, not read whatever the bounds
        width = int(n_full.max()) if n_full.numel() else 0
        b, h, _ = view.pos.shape
        page_idx = torch.where(pageable, page, torch.full_like(page, width))
        fill = torch.zeros(b, h, width + 1, dtype=torch.long, device=view.pos.device)
        fill = fill.scatter_add_(-1, page_idx, pageable.long())  # pageable tokens per page
        whole = fill == self.page_size  # selectable: no token of the page is always read
        chosen = torch.gather(whole, -1, page_idx)  # (B, H, T) the tokens read only when chosen
        always = view.valid & ~chosen  # with the chunk, the partial last page and their pages
        extra = self.budget.capacity(view.valid.sum(-1)) - always.sum(-1)  # (B, H)
        index = torch.where(always, width + 1, page_idx)[:, :, None, :]
        base = torch.zeros(b, h, 1, width + 2, dtype=torch.bool, device=view.pos.device)
        base[..., width + 1] = True
        selectable = whole[..., :width]
        count = pages_read(extra, self.page_size)
        count = torch.minimum(count, selectable.sum(-1))[:, :, None, None]  # (B, H, 1, 1)
        blocked = ~selectable[:, :, None, :]
        return _Pages(key, n_full, int(n_full.sum()), width, blocked, count, index, base)

    def _uniform_pages(self, store: TechniqueStore, qpos: torch.Tensor, key: tuple[Any, ...]) -> _Pages:
        """:meth:`pages` where every head-row holds the same positions, slot ``t`` position ``t``
        (:meth:`LayerStore.position_key`), and one ``protect_from``: the counts are host figures
        (no read from the device) and the masks are one row's, broadcast.

        The pages are the slots before the chunk, ``page_size`` at a time; a token is always read
        when it is a sink or lies at or after ``hi`` (the window before the chunk, the chunk, the
        partial last page and the protected positions), or shares a page with such a token."""
        b, h, t = store.batch, store.kv_heads, store.columns()
        p = self.page_size
        start = t - qpos.shape[1]  # the chunk's first position: every slot before it is a token
        width = start // p
        pf = store.protect_from_host
        hi = min(start - self.budget.window, width * p, *(pf[:1] if pf else ()))
        hi = max(hi, 0)
        # the pages of [j0 p, j1 p) hold none of the sinks (those before ``sinks``) nor of the
        # always-read slots from ``hi`` on: the selectable pages; every other slot is always read
        j0, j1 = -(-self.budget.sinks // p), hi // p
        if j0 >= j1:
            j0 = j1 = 0
        lo, hi = j0 * p, j1 * p
        # one row for all (slot t holds position t): each selectable slot's column, its page's
        # from j0; the others always read (column j1 - j0 + 1); positions' dtype, those of qpos
        index = torch.full((1, 1, 1, t), j1 - j0 + 1, dtype=qpos.dtype, device=qpos.device)
        if j0 < j1:
            torch.sub(page_of(hi, p, qpos)[lo:], j0, out=index[0, 0, 0, lo:hi])
        extra = self.budget.capacity_host(t) - (t - (hi - lo))
        return _Pages(
            key, None, b * h * width, width, None, min(pages_read(extra, p), j1 - j0),
            index.expand(b, h, 1, t), page_base(j1 - j0, qpos), lo=lo, hi=hi, span=(j0, j1),
        )  # fmt: skip

    def layout(
        self, pos: torch.Tensor, prior: torch.Tensor, ordered: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """Pages of the tokens stored before the chunk (``prior`` ``(B, H, T)``), in position order.

        ``ordered``: positions increase along ``T`` (:meth:`LayerStore.in_position_order`), so a
        prior token's rank is a running count instead of a sort.

        Returns:
            ``page`` ``(B, H, T)`` page of each prior token (any value for the others); ``in_page``
            ``(B, H, T)`` True for the tokens of full pages; ``n_full`` ``(B, H)`` full pages per
            head-row.
        """
        if ordered:
            rank = prior.long().cumsum(-1) - 1
        else:
            key = torch.where(prior, pos, torch.full_like(pos, torch.iinfo(pos.dtype).max))
            order = key.argsort(-1)
            ranks = devices.arange(pos.shape[-1], pos).expand_as(order)
            rank = torch.empty_like(order).scatter_(-1, order, ranks)
        n_full = prior.sum(-1) // self.page_size
        page = rank // self.page_size
        return page, prior & (page < n_full[..., None]), n_full

    def _account(
        self,
        layer: int,
        store: TechniqueStore,
        query: torch.Tensor,
        qpos: torch.Tensor,
        mask: torch.Tensor | None,
        meta: torch.Tensor | float | None,
        n_read: torch.Tensor | float | None = None,
    ) -> None:
        """Bytes and tokens read by the real queries of this call (repeat calls are not counted),
        kept as tensors until :meth:`metrics` (no device synchronisation per call).

        ``mask`` None reads every visible token, or ``n_read`` of them (:meth:`read_pages`);
        ``meta`` is the page bounds' bytes of each head-row ``(B, H)``, or already their mean per
        real query (a host figure)."""
        call = (id(store), layer, query.data_ptr(), tuple(query.shape), sum(store.seen_host))
        if not self.meter.first(call):
            return  # the KV-hit probe asks again for the same queries
        if isinstance(meta, torch.Tensor):  # page metadata bytes read per real query
            real = (qpos >= 0).sum(-1)  # (B,)
            meta = (meta.sum(-1).double() * real).sum() / real.sum().clamp(min=1)
        if self.meter.add(_Read(layer, count_reads(store, mask, qpos, n_read), meta)):
            self._settle()

    def _settle(self) -> None:
        """Fold the pending read records into the per-step bytes and the token counts, in call
        order (one read of them all per device)."""
        for record, values in self.meter.settle():
            layer, meta = record.layer, record.meta
            nbytes, n_read, n_visible = record.count.resolve(values[: len(values) - (meta is not None)])
            self._step[0] += nbytes
            if meta is not None:
                self._step[1] += values[-1]
            sparse = 2 * (meta is not None)
            self._tokens[sparse] += n_read
            self._tokens[sparse + 1] += n_visible
            if layer == self.num_layers - 1:  # the engine asks layer by layer: the step is complete
                self._steps.append((self._step[0] + self._step[1], self._step[1]))
                self._step = [0.0, 0.0]

    def settle(self) -> None:
        if self.meter.due():
            self._settle()

    def metrics(self) -> dict[str, float | list[float] | None]:
        self._settle()
        if not self._steps:
            return {}
        read, stored = self._tokens[0] + self._tokens[2], self._tokens[1] + self._tokens[3]
        n = len(self._steps)
        return {
            "bytes_read_per_step": sum(s[0] for s in self._steps) / n,
            "metadata_bytes_read_per_step": sum(s[1] for s in self._steps) / n,
            "read_fraction": read / stored if stored else None,
            "sparse_read_fraction": self._tokens[2] / self._tokens[3] if self._tokens[3] else None,
            "metadata_bytes": float(sum(self._meta_bytes.values())),
        }
