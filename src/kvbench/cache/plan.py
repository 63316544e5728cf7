"""The read plan of one forward: what its layers share about how they read their caches, decided
once, at its first layer (:meth:`kvbench.cache.engine.KVCache.plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbench.cache.engine import KVCache


@dataclass(frozen=True)
class ReadPlan:
    """How every layer of one forward reads its cache: decided once, at the forward's first layer,
    from what its layers share (the query count, the sliding window, padding, the probe, the
    stack's hooks and whether its query observers still watch), not re-derived by each call. A
    layer then adds only its own store's state: whether its rows are dense, a bias, what its view
    holds (:meth:`KVCache.attend`).

    A decode step takes one of four paths: ``bare`` (no technique acts inside attention: dense
    full-precision rows are read as they are, plain SDPA), ``observed`` (the only technique inside
    attention observes the probabilities: they are computed once and the output read from them,
    over full rows and, on the torch path, over ragged full-precision rows), ``routed`` (the only
    technique inside attention is the read selector: dense full-precision rows are read through
    its mask, or its pages on the Triton path, with no view made by the engine), else the masked
    read, which also serves every prefill.
    """

    q_len: int
    window: int | None  # the layers' sliding window (None: none)
    padded: bool  # some query of the chunk is padding
    selector: Any  # the read selector once the cache is routed (after the first compression point)
    placer: Any  # the technique that attends per cache tier
    observers: tuple  # the techniques that read attention probabilities
    query_observers: tuple  # the techniques that read the queries
    first: tuple[int, ...]  # per layer: the first query whose probabilities an observer reads
    bare: bool
    observed: bool
    routed: bool  # a decode step whose only technique inside attention is the read selector
    reads_all: bool  # every query reads every stored token (a step, no selector, no padding)
    # the selector's ``read_pages`` where a step may read its pages on the Triton path (one
    # unpadded query, no window, no tiers, no KV-hit probe), else None
    pages: Any
    # the selector's ``read_head_mask`` where it gives its mask per query head (a routed step's
    # torch read then repeats no mask over the query groups), else None
    head_mask: Any

    @classmethod
    def make(cls, cache: KVCache, q_len: int, window: int | None) -> ReadPlan:
        """The plan of ``cache``'s next forward: made once per situation (the query count, the
        window, padding, the probe, the first compression point passed, which query observers
        still watch), for the cache's stack, which does not change; a decode loop's steps share
        one."""
        real = cache.real
        padded = real is not None and not bool(real.all())
        # one decode step of real queries, unwindowed and not probed
        step = q_len == 1 and window is None and real is None and cache.probe is None
        # the techniques that still read the queries (a choice made for good reads none)
        watching = tuple(t.watches_queries(cache.stores) for t in cache.stack.query_observers)
        key = (q_len, window, padded, step, cache.routed, cache.probe is None, watching)
        made = cache.made_plans
        plan = made.get(key)
        if plan is None:
            if len(made) >= 64:  # prefills of many chunk lengths: start over rather than grow
                made.clear()
            plan = made[key] = cls._make(cache, q_len, window, padded, step, watching)
        return plan

    @classmethod
    def _make(
        cls,
        cache: KVCache,
        q_len: int,
        window: int | None,
        padded: bool,
        step: bool,
        watching: tuple[bool, ...],
    ) -> ReadPlan:
        stack = cache.stack
        observers = tuple(stack.observers)
        query_observers = tuple(t for t, watches in zip(stack.query_observers, watching) if watches)
        selector, placer = stack.read_selector, stack.placer
        routed = selector if cache.routed else None
        first = tuple(
            min((t.observed_from(layer, q_len, padded) for t in observers), default=q_len)
            for layer in range(len(cache.stores))
        )
        return cls(
            q_len=q_len,
            window=window,
            padded=padded,
            selector=routed,
            placer=placer,
            observers=observers,
            query_observers=query_observers,
            first=first,
            bare=step and not (observers or query_observers or selector or placer),
            observed=step and bool(observers) and not (query_observers or placer or routed),
            routed=step and routed is not None and not (observers or query_observers or placer),
            reads_all=q_len == 1 and window is None and routed is None and not padded,
            pages=getattr(routed, "read_pages", None)
            if q_len == 1 and window is None and not padded and placer is None and cache.probe is None
            else None,
            head_mask=getattr(routed, "read_head_mask", None),
        )
