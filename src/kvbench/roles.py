"""The three technique roles and what every technique shares.

A technique is a dataclass whose fields are its knobs (from its YAML), plus class-level
capability flags. Legality of a stack is derived from the flags, never from names.
The cache engine calls the hooks below; techniques touch only kvbench's own storage
(:class:`kvbench.cache.store.LayerStore`), never transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError


@dataclass(frozen=True)
class Flags:
    """Capability flags of METHODS.md."""

    needs_attention_scores: bool = False
    evicts_tokens: bool = False
    changes_representation: bool = False
    selects_reads: bool = False
    places_tiers: bool = False
    lossless: bool = False


@dataclass(frozen=True)
class Budget:
    """The stack-wide budget: fraction (or absolute count) of seen tokens kept, sinks and window.

    Sinks (first tokens) and the window (most recent tokens, full precision) count inside the budget.
    """

    budget: float = 1.0
    budget_tokens: int | None = None
    sinks: int = 4
    window: int = 32

    def __post_init__(self) -> None:
        if not 0.0 < self.budget <= 1.0:
            raise ConfigError(f"budget={self.budget}: must be in (0, 1] (fraction of seen tokens kept)")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise ConfigError(f"budget_tokens={self.budget_tokens}: must be a positive integer or null")
        if self.sinks < 0 or self.window < 1:
            raise ConfigError(f"sinks={self.sinks}, window={self.window}: need sinks >= 0 and window >= 1")

    def capacity(self, seen: int) -> int:
        """Tokens a head may keep after ``seen`` tokens (never fewer than sinks + window)."""
        cap = self.budget_tokens if self.budget_tokens is not None else math.ceil(self.budget * seen)
        return max(cap, self.sinks + self.window)

    def protected(self, pos: torch.Tensor, seen: int, protect_from: int | None = None) -> torch.Tensor:
        """True where a position is a sink, inside the recent window, or at/after ``protect_from``."""
        prot = (pos < self.sinks) | (pos >= seen - self.window)
        return prot if protect_from is None else prot | (pos >= protect_from)


class Technique:
    """Base of every router, compressor and scheduler."""

    role: ClassVar[str] = ""
    flags: ClassVar[Flags] = Flags()
    name: str = ""

    def bind(self, budget: Budget, num_layers: int) -> None:
        """Receive the stack-wide budget once, before the first forward."""
        self.budget_cfg = budget
        self.num_layers = num_layers

    def observe(self, layer: int, store: LayerStore, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        """Attention probabilities of a block of queries, summed over each KV head's query group.

        Args:
            layer: layer index.
            store: the layer's storage; ``probs`` is aligned with ``store.view()``.
            probs: ``(B, H_kv, q, T)``.
            qpos: ``(q,)`` positions of the queries.
        """

    def metrics(self) -> dict[str, float | list[float] | None]:
        """Technique-specific measured figures for the result record."""
        return {}


class Scheduler(Technique):
    """Decides which tokens stay in the cache as the sequence grows."""

    role = "scheduler"

    def evict(self, layer: int, store: LayerStore) -> None:
        """Called after every forward chunk, after the compressor."""
        raise NotImplementedError


class Compressor(Technique):
    """Decides how retained tokens are stored (or which are kept, once)."""

    role = "compressor"

    def compress(self, layer: int, store: LayerStore) -> None:
        """Called after every forward chunk, before the scheduler."""
        raise NotImplementedError


class Router(Technique):
    """Decides which shard of the stored cache each query reads."""

    role = "router"

    def read_mask(
        self, layer: int, store: LayerStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        """Which stored tokens each query may read.

        Args:
            query: ``(B, H_q, q, D)`` rotated queries.
            qpos: ``(q,)`` query positions.

        Returns:
            ``(B, H_kv, q, T)`` bool, aligned with ``store.view()``.
        """
        raise NotImplementedError

    def write(self, layer: int, store: LayerStore) -> None:
        """Called after every forward chunk, last: update shard assignment of stored tokens."""


def keep_top(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the ``k`` highest valid scores per head-row.

    Args:
        scores: ``(B, H, T)``; protected tokens should carry ``+inf``.
        valid: ``(B, H, T)``.
        k: tokens to keep per head-row.

    Returns:
        ``(B, H, T)`` bool.
    """
    protected = torch.isinf(scores) & (scores > 0) & valid
    k = min(max(k, int(protected.sum(-1).max())), scores.shape[-1])  # never drop a protected token
    masked = scores.masked_fill(~valid, float("-inf"))
    idx = masked.topk(k, dim=-1).indices
    keep = torch.zeros_like(valid).scatter(-1, idx, True)
    return keep & valid
