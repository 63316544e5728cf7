"""Shared pieces of token selection: per-layer capacity, eviction by score, and the scores of
the last observed queries (SnapKV's observation window).

Every selection is per head-row (one sequence, one KV head): in a padded batch each sequence
keeps its own budget of its own tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from kvbench import allocation
from kvbench.cache import attention as att
from kvbench.cache.side import TokenState
from kvbench.cache.surface import Columns, TechniqueStore
from kvbench.errors import ConfigError
from kvbench.roles import BindContext, Budget, Technique, keep_top


def leaving_window(
    store: TechniqueStore, budget: Budget, group_size: int, eligible: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B * H, W)`` over the full-precision rows: the oldest whole groups of ``group_size``
    unprotected tokens per head-row, the tokens a representation compressor moves out.

    ``eligible`` (aligned the same way) restricts the candidates further.
    """
    ok = _movable(store, budget, eligible)
    n = moving_per_row(store, budget, group_size) if eligible is None else None
    return _oldest(ok, (ok.sum(-1) // group_size) * group_size if n is None else n)


def leaving_columns(store: TechniqueStore, budget: Budget, group_size: int) -> Columns | None:
    """The columns of the full-precision rows that :func:`leaving_window` marks in every head-row,
    from host figures, where :func:`moving_per_row` knows their count: the rows are full and in
    position order, and only the sinks and the window are protected, so each row holds its sinks
    first and the oldest unprotected tokens right after them. None where unknown (then the mask)."""
    n = moving_per_row(store, budget, group_size)
    if n is None:
        return None
    start = min(budget.sinks, store.seen_host[0])
    return Columns(start, start + n)


def leaving(store: TechniqueStore, budget: Budget, group_size: int = 1) -> Columns | torch.Tensor | None:
    """What a compressor that moves the tokens past the full-precision window out in whole groups
    of ``group_size`` (1: one at a time, each decode step's token as it leaves the window) moves
    now, for :meth:`~kvbench.cache.surface.TechniqueStore.move_out`: the oldest unprotected tokens
    of each head-row, as :func:`leaving_columns` where the host knows them (no count, mask or plan
    on the device), else as :func:`leaving_window`'s mask (the move counts them; for groups,
    :func:`leaving_groups`, which reads once whether any head-row has one). None when the host
    knows that nothing leaves."""
    cols = leaving_columns(store, budget, group_size)
    if cols is None:
        return (
            leaving_window(store, budget, 1) if group_size == 1 else leaving_groups(store, budget, group_size)
        )
    return cols if cols.stop > cols.start else None


def leaving_groups(store: TechniqueStore, budget: Budget, group_size: int) -> torch.Tensor | None:
    """:func:`leaving_window`, or None when no head-row has a whole group to move out: one host
    read, which takes the place of the move's own count (:meth:`LayerStore.move_out`) where a
    group leaves once in ``group_size`` decode steps, and spares the other steps the move's work."""
    n = moving_per_row(store, budget, group_size)
    if n is not None:  # known on the host: every head-row moves n
        return _oldest(_movable(store, budget), n) if n else None
    bound = _movable_bound(store, budget)
    if bound is not None and bound < group_size:  # known on the host: no whole group yet
        return None
    ok = _movable(store, budget)
    whole = (ok.sum(-1) // group_size) * group_size
    return _oldest(ok, whole) if bool(whole.any()) else None


def moving_per_row(store: TechniqueStore, budget: Budget, group_size: int) -> int | None:
    """The tokens every head-row moves out in :func:`leaving_window` (whole groups of
    ``group_size``), from host figures: where no position is protected beyond the sinks and the
    window, the unprotected tokens of full rows in position order are exactly those of
    :func:`_movable_bound`. None where unknown (:meth:`LayerStore.move_out` then counts them)."""
    bound = _movable_bound(store, budget)
    if bound is None or store.protect_from_host is not None or len(set(store.seen_host)) != 1:
        return None
    return (bound // group_size) * group_size


def _movable_bound(store: TechniqueStore, budget: Budget) -> int | None:
    """The most unprotected tokens a head-row's full-precision rows hold, from host figures: their
    width less the sinks and the window of its sequence, which arrive there and never leave (every
    selection and move keeps them: they are protected at every step, as they are now). None where
    the rows differ in length, or are out of position order (a move puts them back in order
    first, and attention then reads them in that order)."""
    rows = store.fp.rows
    if not rows.uniform or not rows.ordered:
        return None
    most = 0
    for seen in store.seen_host:
        most = max(most, rows.width - budget.protected_host(seen))
    return most


def _movable(store: TechniqueStore, budget: Budget, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """``(B * H, W)``: the unprotected full-precision tokens (and ``eligible`` ones, if given)."""
    ok = ~budget.protected_fp(store) & store.fp_valid()
    return ok if eligible is None else ok & eligible


def _oldest(ok: torch.Tensor, n: torch.Tensor | int) -> torch.Tensor:
    """The first ``n`` ``(BH,)`` (or as many in every row) of the ``ok`` slots ``(BH, W)`` of each row."""
    return ok & (ok.long().cumsum(-1) <= (n[:, None] if isinstance(n, torch.Tensor) else n))


def within(store: TechniqueStore, capacity: Callable[[int], int]) -> bool:
    """True when every head-row provably holds at most ``capacity(seen)`` tokens of its sequence, from
    host figures alone: a selection would keep every token and can be skipped (half the decode
    steps at budget 0.5). False when unsure (rows of different lengths)."""
    n = store.uniform_tokens()
    return n is not None and all(n <= capacity(seen) for seen in store.seen_host)


# positions up to which every ``distinct_scores`` technique's scores are distinct (float32 positions,
# ``lru``'s key: exact below 2**24; ``lru_plus`` takes its ranks past its own key's span)
DISTINCT_SPAN = 2**24


def evict_by_score(
    store: TechniqueStore,
    budget: Budget,
    score: Callable[[], torch.Tensor],
    capacity: Callable[[int], int],
    distinct: bool = False,
    in_order: Callable[[torch.Tensor | None], torch.Tensor] | None = None,
) -> None:
    """Keep the ``capacity(seen)`` best-scored tokens per head-row of each sequence, sinks, the window
    and protected positions always kept.

    Args:
        score: returns ``(B, H, T)`` scores aligned with ``store.view()``; called only when some
            head-row is over its capacity.
        capacity: tokens a head-row of a sequence that has seen ``seen`` tokens keeps, on the host
            (e.g. :meth:`Budget.capacity_host`).
        distinct: no two valid unprotected tokens of a head-row have the same score (below
            :data:`DISTINCT_SPAN` positions), so no tie is broken by position: the tokens that leave
            are chosen without their position order, one leaving each head-row by an ``argmin``.
        in_order: ``in_order(order)`` returns the scores of ``score()`` in position order, given
            ``order`` (:meth:`LayerStore.by_position`, or None where the columns are in it), where
            it makes them with fewer operations than a gather of ``score()``.
    """
    if within(store, capacity):
        return
    view = store.view()
    kept = kept_host(store, budget, capacity)
    if kept is not None and store.can_drop(kept[0]):  # a few leave: into their slots go the last
        # tokens (O(evicted) writes)
        cols = None if distinct else leaving_by_position(store, budget, kept[0], score, in_order)
        if cols is None:
            scores = score().masked_fill(budget.protected_view(store), float("inf"))
            if distinct and scores.shape[-1] - kept[0] == 1 and store.seen_max <= DISTINCT_SPAN:
                # one leaves each head-row (a decode step's): its lowest score, the only one
                # (distinct), the one ``lowest`` takes, unsorted
                cols = scores.argmin(-1, keepdim=True)
            else:
                by_pos = None if distinct or store.in_position_order() else store.by_position()
                cols = lowest(scores, by_pos, kept[0])
        store.drop(cols)
        return
    scores = score().masked_fill(budget.protected_view(store), float("inf"))
    # ties keep the earlier position (as :func:`lowest`'s), also where the slots are out of
    # position order (after a step's drops, or a merge's units)
    by_pos = None if store.unprotected_in_position_order() else store.by_position()
    if kept is not None:  # exactly ``kept`` per head-row, known on the host: no count to take
        store.keep(keep_top(scores, None, kept[0], protected_fit=True, by_pos=by_pos), kept)
        return
    caps = [capacity(seen) for seen in store.seen_host]
    held = None if view.dense else store.row_tokens_host()
    if held is not None and all(n <= caps[i // store.kv_heads] for i, n in enumerate(held)):
        return  # every head-row within its capacity, known on the host: nothing to evict
    # one capacity for every sequence (a batch of one, or of one length): an int, no upload
    cap: int | torch.Tensor = caps[0] if len(set(caps)) == 1 else torch.tensor(caps, device=store.device)
    if not view.dense and held is None:
        over = view.valid.sum(-1) > (cap if isinstance(cap, int) else cap[:, None])
        if not bool(over.any()):
            return
    # no head-row holds more protected tokens than one capacity for all, known on the host: exactly
    # that many kept, the protected ones not counted
    fit = isinstance(cap, int) and protected_most(store, budget) <= cap
    store.keep(keep_top(scores, None if view.dense else view.valid, cap, protected_fit=fit, by_pos=by_pos))


class ScoredSelection(Technique):
    """A token selection that is its score, as kvpress's scorer presses are: a subclass writes
    :meth:`score` (with its knobs, its flags and whatever state its score keeps). This base keeps
    each head-row's best-scored tokens at the capacity after every chunk, the sinks, the window and
    protected positions always kept (:func:`evict_by_score`), as the hook of its role: ``compress``
    for a compressor, ``evict`` for a scheduler.

    ``capacity`` is the budget's; a subclass that mixes in :class:`Allocated` takes its split
    across layers instead (``capacity = Allocated.layer_capacity_host``). A subclass whose scores
    are distinct in every head-row sets ``distinct_scores`` (:func:`evict_by_score`'s ``distinct``).
    """

    distinct_scores = False

    def score(self, layer: int, store: TechniqueStore) -> torch.Tensor:
        """``(B, H, T)`` scores aligned with ``store.view()``, the highest kept; asked only where some
        head-row holds more tokens than its capacity."""
        raise NotImplementedError

    def capacity(self, layer: int, seen: int) -> int:
        """The tokens a head-row of ``layer`` keeps after ``seen`` tokens of its sequence, on the host."""
        return self.budget.capacity_host(seen)

    def score_in_order(self, layer: int, store: TechniqueStore, order: torch.Tensor | None) -> torch.Tensor:
        """:meth:`score` in position order (``order``: :meth:`LayerStore.by_position`, or None where
        the columns are in it); a subclass that makes them so with fewer operations than a gather
        of :meth:`score` redefines it (:func:`evict_by_score`'s ``in_order``)."""
        return in_position_order(self.score(layer, store), order)

    def select(self, layer: int, store: TechniqueStore) -> None:
        evict_by_score(
            store,
            self.budget,
            lambda: self.score(layer, store),
            partial(self.capacity, layer),
            self.distinct_scores,
            partial(self.score_in_order, layer, store),
        )

    def compress(self, layer: int, store: TechniqueStore) -> None:
        self.select(layer, store)

    def evict(self, layer: int, store: TechniqueStore) -> None:
        self.select(layer, store)


def leaving_by_position(
    store: TechniqueStore,
    budget: Budget,
    kept: int,
    score: Callable[[], torch.Tensor],
    in_order: Callable[[torch.Tensor | None], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """:func:`lowest` of ``score()`` with the protected tokens kept, ranked in position order, where
    the protected tokens are known there from host figures: in full rows of one segment (as
    :func:`kept_host` finds them) that protect only the sinks and the window, every head-row holds
    each of them (every selection keeps them), so in position order they are the first and the last
    columns. Only the columns between are ranked, with no mask (the same tokens leave, in the same
    order: ties keep the earlier position); None where the host does not know them."""
    if store.protect_from_host is not None:
        return None
    order = None if store.in_position_order() else store.by_position()
    ranked = in_order(order) if in_order is not None else in_position_order(score(), order)
    width, seen = ranked.shape[-1], store.seen_host[0]
    first = min(budget.sinks, seen)  # the sinks, then the unprotected, then the window
    last = width - (budget.protected_host(seen) - first)
    rank = ranked[..., first:last].argsort(dim=-1, descending=True, stable=True)
    rank = rank[..., kept - first - (width - last) :]  # past the unprotected tokens that stay
    return rank + first if order is None else torch.gather(order[..., first:last], -1, rank)


def in_position_order(scores: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """``scores`` ``(B, H, T)`` in position order, given ``order`` (:meth:`LayerStore.by_position`, or
    None where the columns are in it)."""
    return scores if order is None else torch.gather(scores, -1, order)


def lowest(scores: torch.Tensor, by_pos: torch.Tensor | None, kept: int) -> torch.Tensor:
    """``(B, H, T - kept)`` columns of all but the ``kept`` best ``scores`` ``(B, H, T)`` per head-row,
    ties keeping the earlier position (as :func:`keep_top` keeps the earlier slot of rows in position
    order), so a selection does not depend on where the cache put its tokens. ``by_pos``: the columns
    in position order (:meth:`LayerStore.by_position`), or None when positions increase along ``T``."""
    if by_pos is None:
        return scores.argsort(dim=-1, descending=True, stable=True)[..., kept:]
    rank = torch.gather(scores, -1, by_pos).argsort(dim=-1, descending=True, stable=True)
    return torch.gather(by_pos, -1, rank[..., kept:])


def kept_host(store: TechniqueStore, budget: Budget, capacity: Callable[[int], int]) -> list[int] | None:
    """The tokens every head-row keeps after :func:`keep_top` at ``capacity(seen)``, when host figures
    prove it (one full segment, sequences at one length, and fewer protected positions than the
    capacity: sinks, the window and those from ``protect_from`` on), so that :meth:`LayerStore.keep`
    compacts without reading a count from the device; else None."""
    if len(store.segments) != 1 or store.uniform_tokens() is None or len(set(store.seen_host)) != 1:
        return None
    cap = capacity(store.seen_host[0])
    return [cap] if protected_most(store, budget) <= cap else None


def protected_most(store: TechniqueStore, budget: Budget) -> int:
    """The most protected positions a head-row of ``store`` holds, from host figures: the sinks and
    the window, or every position from the first one protected on (``protect_from``) where that
    reaches further back."""
    seen = max(store.seen_host)
    recent = budget.window
    if store.protect_from_host is not None:
        recent = max(recent, seen - min(store.protect_from_host))
    return budget.sinks + recent


@dataclass
class Allocated(Technique):
    """Mixin: the budget split across layers by ``allocation`` (see :mod:`kvbench.allocation`).

    Its knobs are checked and its per-layer weights computed by the technique template
    (:meth:`check_knobs`, :meth:`on_bind`); a technique only inherits it.
    """

    allocation: str = "uniform"
    beta: float = 20.0  # pyramid: the top layer keeps 1/beta of the mean
    weights: list[float] = field(default_factory=list, init=False, repr=False)  # per layer, once bound

    def check_knobs(self) -> None:
        allocation.check(f"{self.role}.allocation", self.allocation)
        if self.beta <= 1:
            raise ConfigError(f"{self.role}.beta={self.beta}: must be > 1")

    def on_bind(self, ctx: BindContext) -> None:
        self.weights = allocation.layer_weights(self.allocation, ctx, self.beta, ctx.seed).tolist()

    def layer_capacity(self, layer: int, store: TechniqueStore) -> torch.Tensor:
        return self.budget.capacity(store.seen, self.weights[layer])

    def allocated_capacity(self, layer: int, store: TechniqueStore) -> torch.Tensor:
        """``(B,)`` the layer's capacity, or every seen token where the uniform capacity already keeps
        them all (PyramidKV keeps the whole prompt when it fits the budget, so a budget of 1 stays
        lossless under any allocation)."""
        cap = self.layer_capacity(layer, store)
        fits = self.budget.capacity(store.seen) >= store.seen
        return torch.where(fits, store.seen, cap)

    def layer_capacity_host(self, layer: int, seen: int) -> int:
        """:meth:`layer_capacity` of one sequence, on the host."""
        return self.budget.capacity_host(seen, self.weights[layer])

    def allocated_capacity_host(self, layer: int, seen: int) -> int:
        """:meth:`allocated_capacity` of one sequence, on the host."""
        fits = self.budget.capacity_host(seen) >= seen
        return seen if fits else self.layer_capacity_host(layer, seen)


def check_window(role: str, obs_window: int, pool: int) -> None:
    """Refuse an empty observation window or an even pooling kernel."""
    if obs_window < 1:
        raise ConfigError(f"{role}.obs_window={obs_window}: must be >= 1")
    if pool < 1 or pool % 2 == 0:
        raise ConfigError(f"{role}.pool={pool}: must be an odd integer >= 1 (1: no pooling)")


class ObservationWindow:
    """Mixin: attention received from the last ``obs_window`` queries, kept per token.

    A ring of ``obs_window`` slots per token (slot = query position mod window) holds the
    probability each recent query gave the token, summed over the KV head's query group, so the
    score always covers exactly the latest queries, across chunks and evictions.
    """

    obs_window: int
    pool: int

    @property
    def ring(self) -> TokenState:
        """The ring's state; techniques with the same window share one (e.g. snapkv and adakv)."""
        return TokenState(f"obs{self.obs_window}", (self.obs_window,))

    def observed_from(self, layer: int, q: int, padded: bool) -> int:
        return 0 if padded else max(0, q - self.obs_window)  # unpadded: the last queries are the newest

    def observe(self, layer: int, store: TechniqueStore, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        w = self.obs_window
        if qpos.shape[1] == 1 and not store.last_padded and len(set(store.seen_host)) == 1:
            # one unpadded step: each sequence's query is its newest token, whose slot the host knows
            summed_step = att.widen(probs.sum(2)[:, :, 0], store.columns())  # (B, H, T)
            store.put_state(self.ring, (Ellipsis, (store.seen_host[0] - 1) % w), summed_step)
            return
        recent = (qpos >= store.seen[:, None] - w) & (qpos >= 0)  # (B, q)
        # The recent queries of a sequence are distinct positions of the last w: distinct slots.
        seq, query = recent.nonzero(as_tuple=True)
        summed = att.widen(probs.sum(2), store.columns()).transpose(1, 2)  # (B, q, H, T)
        store.put_state(self.ring, (seq, slice(None), slice(None), qpos[seq, query] % w), summed[seq, query])

    def window_scores_in_order(self, store: TechniqueStore, order: torch.Tensor | None) -> torch.Tensor:
        """:meth:`window_scores` of full rows (every slot a token) in position order, given ``order``
        (:meth:`LayerStore.by_position`, or None where the columns are in it): pooled where they are
        so, not put back in the columns' order."""
        score = store.state(self.ring).sum(-1)
        return pool_sorted(score if order is None else torch.gather(score, -1, order), self.pool)

    def window_scores(self, store: TechniqueStore, padding: bool = True) -> torch.Tensor:
        """``(B, H, T)`` attention from the last queries, max-pooled over ``pool`` neighbours (SnapKV).

        ``padding``: slots that hold no token read 0; False where the caller masks them itself (they
        then hold anything)."""
        view = store.view()
        score = store.state(self.ring).sum(-1)
        if self.pool <= 1:
            return score
        if not store.in_position_order():
            return pool_scores(score, view.pos, view.valid, self.pool, store.by_position(), view.dense)
        if view.dense or not padding:  # in position order, every slot a token; or the caller masks
            # the slots without one: each scores 0 (no query attends it, and rows hold zeros past
            # their tokens), no more than any token (probabilities are never negative), so pooled as
            # it is it changes no token's maximum
            return pool_sorted(score, self.pool)
        # In position order, each row's tokens first: its padding pools as -inf, reads as 0
        valid = view.valid
        return torch.where(valid, pool_sorted(torch.where(valid, score, float("-inf")), self.pool), 0.0)


def pool_scores(
    score: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    kernel: int,
    order: torch.Tensor | None = None,
    dense: bool = False,
) -> torch.Tensor:
    """Max-pool scores over ``kernel`` neighbouring stored tokens in position order (odd kernel);
    ``order``: the columns in position order, padding last, when known (:meth:`LayerStore.by_position`);
    ``dense``: every slot is a token (``valid`` all True)."""
    if kernel <= 1:
        return score
    if order is None:
        order = torch.where(valid, pos, torch.full_like(pos, torch.iinfo(pos.dtype).max)).argsort(-1)
    s = torch.gather(score, -1, order)
    if not dense:
        s = torch.where(torch.gather(valid, -1, order), s, float("-inf"))
    out = torch.empty_like(score).scatter_(-1, order, pool_sorted(s, kernel))
    return out if dense else torch.where(valid, out, 0.0)


def pool_sorted(score: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool ``(B, H, T)`` scores already in position order, every slot a real token."""
    if kernel <= 1:
        return score
    b, h, t = score.shape
    return F.max_pool1d(score.reshape(b * h, 1, t), kernel, stride=1, padding=kernel // 2).view(b, h, t)
