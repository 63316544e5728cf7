"""Quest: query-aware page selection over a cache that keeps every token (arXiv:2406.10774).

Each KV head-row's stored tokens, in position order, form pages of ``page_size`` tokens. Every
full page carries the per-channel minimum and maximum of its keys (as attention reads them:
dequantized when a compressor packed them), kept flat in the layer's side data
(:class:`PageBounds`) so ``store.nbytes()`` counts them. For a query ``q`` the page bound ``Σ_i
max(q_i·min_i, q_i·max_i)`` is never below ``q·k`` for any key of the page. Each query reads the
top pages by bound so that the tokens read per head-row come to ``ceil(budget × stored tokens)``,
rounded to whole pages.

Deviations from the paper, kvbench's choices:

- GQA: Quest is defined per attention head (MHA). Here one KV head-row is read once for its
  whole query group, so a page's bound is the **maximum over the group's query heads** of their
  bounds; it stays an upper bound for every query head of the group.
- The budget is a fraction of the stored tokens of each head-row (``budget_tokens`` gives the
  paper's absolute token budget); sinks, the window, protected positions, the current chunk and
  the partial last page are always read and count inside it. The remaining tokens go page by
  page in bound order; a page is taken when at least half of it fits (rounding to whole pages).
- Queries of every chunk after the first compression point are selected (the paper selects at
  decode only; a decode step is one such chunk); earlier queries of a chunk read densely.
- Page metadata is derived from the stored keys after every forward, in :meth:`evict`: over a
  cache in position order only the pages filled since the last forward are reduced, and every
  page again after a change to stored tokens (an eviction, a move into a representation); the
  paper updates the last page in place. The pages and bounds are the same.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.cache import attention as att
from kvbench.cache import ragged
from kvbench.cache.reads import SETTLE_EVERY, ReadCount, count_reads, resolve_all
from kvbench.cache.side import SideData
from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.roles import Flags, Scheduler


@dataclass
class PageBounds(SideData):
    """Per-channel minimum and maximum keys ``(M, D)`` of every full page, head-major."""

    kmin: torch.Tensor
    kmax: torch.Tensor


@dataclass
class _Pages:
    """What :meth:`QuestScheduler.pages` derives from positions: full pages per head-row ``n_full``
    ``(B, H)`` (``total`` of them, ``width`` at most), the always-read and pageable tokens ``(B, H,
    T)``, each page's unread tokens ``cost`` ``(B, H, P)``, the budget left for pages ``extra``
    ``(B, H)``, and the page of each token as a gather index ``(B, H, 1, T)``."""

    key: tuple[Any, ...] | None
    n_full: torch.Tensor
    total: int
    width: int
    always: torch.Tensor
    pageable: torch.Tensor
    cost: torch.Tensor
    extra: torch.Tensor
    index: torch.Tensor


@dataclass
class QuestScheduler(Scheduler):
    """Keeps every token; each query reads the top pages of its KV head by Quest's bound.

    Args:
        page_size: tokens per page.
        dense_layers: the first layers read every token (the paper leaves two dense).
    """

    name: str = "quest"
    page_size: int = 16
    dense_layers: int = 2
    flags = Flags(selects_reads=True)

    def check_knobs(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"scheduler.page_size={self.page_size}: must be >= 1")
        if self.dense_layers < 0:
            raise ConfigError(f"scheduler.dense_layers={self.dense_layers}: must be >= 0")
        self._step = [0.0, 0.0]  # bytes read per query in this step: K/V, page metadata
        self._steps: list[tuple[float, float]] = []
        self._tokens = [0.0, 0.0, 0.0, 0.0]  # read, visible: dense layers, then selected layers
        self._meta_bytes: dict[int, int] = {}  # page metadata stored per layer, after the last forward
        self._last: tuple | None = None
        self._pending: list[tuple[int, ReadCount, torch.Tensor | None]] = []  # reads not yet settled
        self._shared: _Pages | None = None  # the pages of the current step, shared by its layers
        # Per store: (its ``edits``, full pages, their minimum and maximum keys ``(B * H, P, D)``)
        self._kept_bounds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def evict(self, layer: int, store: LayerStore) -> None:
        """Nothing is evicted: the min/max keys of every full page of every head-row."""
        if layer < self.dense_layers:
            return
        view = store.view()
        b, h, t, d = view.k.shape
        p = self.page_size
        if store.in_position_order() and view.dense:  # every slot a token, in position order
            self._grow_pages(layer, store)
            return
        last = torch.full_like(view.pos, torch.iinfo(view.pos.dtype).max)
        order = torch.where(view.valid, view.pos, last).argsort(-1)
        keys = torch.gather(view.k, 2, order[..., None].expand(b, h, t, d))
        npages = -(-t // p)
        keys = torch.nn.functional.pad(keys, (0, 0, 0, npages * p - t)).view(b, h, npages, p, d)
        full = torch.arange(npages, device=keys.device) < (view.valid.sum(-1) // p)[..., None]  # (B, H, P)
        kmin, kmax = keys.amin(3)[full].contiguous(), keys.amax(3)[full].contiguous()
        self._set_bounds(layer, store, kmin, kmax)
        self._kept_bounds.pop(store, None)

    def _set_bounds(self, layer: int, store: LayerStore, kmin: torch.Tensor, kmax: torch.Tensor) -> None:
        store.set_side(PageBounds(kmin, kmax))
        self._meta_bytes[layer] = (kmin.numel() + kmax.numel()) * kmin.element_size()

    def _grow_pages(self, layer: int, store: LayerStore) -> None:
        """:meth:`evict` when every slot is a token in position order: the pages are the view's
        consecutive ``page_size`` slots. Pages bounded at the last call are kept while no stored
        token changed since (``store.edits``); only pages filled since are reduced (a minimum
        and maximum are exact, so the bounds are those a full pass gives)."""
        view = store.view()
        b, h, t, d = view.k.shape
        p = self.page_size
        n_full = t // p
        prev = self._kept_bounds.get(store)
        if prev is not None and prev[0] == store.edits and prev[1] <= n_full:
            done, kmin, kmax = prev[1:]
        else:
            done, kmin, kmax = 0, view.k.new_empty(b * h, 0, d), view.k.new_empty(b * h, 0, d)
        if n_full > done:
            keys = view.k[:, :, done * p : n_full * p].reshape(b * h, n_full - done, p, d)
            kmin = torch.cat([kmin, keys.amin(2)], dim=1)
            kmax = torch.cat([kmax, keys.amax(2)], dim=1)
        self._kept_bounds[store] = (store.edits, n_full, kmin, kmax)
        self._set_bounds(layer, store, kmin.view(-1, d), kmax.view(-1, d))

    def read_mask(
        self, layer: int, store: LayerStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        view = store.view()
        b, h, t, d = view.k.shape
        q = query.shape[2]
        if layer < self.dense_layers:
            mask = view.valid[:, :, None, :].expand(b, h, q, t)
            self._account(layer, store, query, qpos, mask, None)
            return mask
        key = store.position_key(qpos)
        if key is not None:  # the layers of a step share the pages: they derive from positions alone
            key = (*key, self.budget, self.page_size)
            if self._shared is None or self._shared.key != key:
                self._shared = self.pages(store, qpos, key)
            lay = self._shared
        else:
            lay = self.pages(store, qpos, None)
        bounds = store.side(PageBounds)
        if bounds is None or lay.total != bounds.kmin.shape[0]:
            raise RuntimeError("quest: page metadata is stale (evict() must run after every forward)")
        width = lay.width
        if width == 0:  # no full page yet: only the always-read tokens exist
            mask = lay.always[:, :, None, :].expand(b, h, q, t)
            self._account(layer, store, query, qpos, mask, lay.n_full * 0)
            return mask
        if key is not None:  # every head-row holds the same full pages
            kmin, kmax = bounds.kmin.view(b, h, width, d), bounds.kmax.view(b, h, width, d)
        else:
            kmin = ragged.to_padded(bounds.kmin, lay.n_full.flatten())[0].view(b, h, width, d)
            kmax = ragged.to_padded(bounds.kmax, lay.n_full.flatten())[0].view(b, h, width, d)
        # (B, H, q, P): the bound's maximum over the query group, by the cell's path
        bound = (dispatch.kernels("scoring") or att).group_bounds(query, kmin, kmax)
        take = self.take_pages(bound, lay.cost, lay.extra)
        tok = torch.gather(take, -1, lay.index.expand(b, h, q, t))
        mask = (tok & lay.pageable[:, :, None, :]) | lay.always[:, :, None, :]
        self._account(layer, store, query, qpos, mask, lay.n_full * 2 * d * bounds.kmin.element_size())
        return mask

    def pages(self, store: LayerStore, qpos: torch.Tensor, key: tuple[Any, ...] | None) -> _Pages:
        """The pages of the tokens stored before the chunk of the queries at ``qpos``, and what every
        query reads whatever its bounds (sinks, window, protected positions, the chunk, the partial
        last page)."""
        view = store.view()
        start = store.chunk_start(qpos)[:, None, None]
        prior = view.valid & (view.pos < start)
        page, in_page, n_full = self.layout(view.pos, prior, store.in_position_order())
        protected = self.budget.protected(view.pos, start, store.view_protect_from())
        always = view.valid & (protected | ~in_page)  # with the chunk and the partial last page
        pageable = in_page & ~always
        width = int(n_full.max()) if n_full.numel() else 0
        b, h, _ = view.pos.shape
        page_idx = torch.where(pageable, page, torch.full_like(page, width))
        cost = torch.zeros(b, h, width + 1, dtype=torch.long, device=view.pos.device)
        cost = cost.scatter_add_(-1, page_idx, pageable.long())[..., :width]  # unread tokens per page
        extra = self.budget.capacity(view.valid.sum(-1)) - always.sum(-1)  # (B, H)
        index = page_idx.clamp(max=max(width - 1, 0))[:, :, None, :]
        return _Pages(key, n_full, int(n_full.sum()), width, always, pageable, cost, extra, index)

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
            ranks = torch.arange(pos.shape[-1], device=pos.device).expand_as(order)
            rank = torch.empty_like(order).scatter_(-1, order, ranks)
        n_full = prior.sum(-1) // self.page_size
        page = rank // self.page_size
        return page, prior & (page < n_full[..., None]), n_full

    @staticmethod
    def take_pages(bound: torch.Tensor, cost: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """Pages read: the best bounds first, while at least half of the next page fits in ``extra``.

        Args:
            bound: ``(B, H, q, P)``; cost: ``(B, H, P)`` tokens a page adds (0: not selectable);
            extra: ``(B, H)`` tokens left in the budget after the always-read ones.

        Returns:
            ``(B, H, q, P)`` bool.
        """
        score = bound.masked_fill(cost[:, :, None, :] == 0, float("-inf"))
        order = score.argsort(dim=-1, descending=True, stable=True)
        c = torch.gather(cost[:, :, None, :].expand_as(order), -1, order)
        before = c.cumsum(-1) - c
        fits = (2 * before + c < 2 * extra[:, :, None, None]) & (c > 0)
        return torch.zeros_like(fits).scatter_(-1, order, fits)

    def _account(self, layer, store, query, qpos, mask, meta: torch.Tensor | None) -> None:
        """Bytes and tokens read by the real queries of this call (repeat calls are not counted),
        kept as tensors until :meth:`metrics` (no device synchronisation per call)."""
        key = (id(store), layer, query.data_ptr(), tuple(query.shape), sum(store.seen_host))
        if key == self._last:  # the KV-hit probe asks again for the same queries
            return
        self._last = key
        real = (qpos >= 0).sum(-1)  # (B,)
        if meta is not None:  # page metadata bytes read per real query
            meta = (meta.sum(-1).double() * real).sum() / real.sum().clamp(min=1)
        self._pending.append((layer, count_reads(store, mask, qpos), meta))
        if len(self._pending) >= SETTLE_EVERY:
            self._settle()

    def _settle(self) -> None:
        """Fold the pending read records into the per-step bytes and the token counts, in call
        order (one read of them all per device)."""
        pending, self._pending = self._pending, []
        metas = [meta for _, _, meta in pending if meta is not None]
        counts, values = resolve_all([count for _, count, _ in pending], metas)
        meta_values = iter(values)
        for (layer, _, meta), (nbytes, n_read, n_visible) in zip(pending, counts):
            self._step[0] += nbytes
            if meta is not None:
                self._step[1] += next(meta_values)
            sparse = 2 * (meta is not None)
            self._tokens[sparse] += n_read
            self._tokens[sparse + 1] += n_visible
            if layer == self.num_layers - 1:  # the engine asks layer by layer: the step is complete
                self._steps.append((self._step[0] + self._step[1], self._step[1]))
                self._step = [0.0, 0.0]

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
