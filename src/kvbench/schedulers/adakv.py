"""Ada-KV: the budget of a layer split adaptively across its KV heads (arXiv:2407.11550).

Ada-SnapKV: tokens are scored by SnapKV's pooled observation-window attention; rather than every
head keeping its own top ``capacity`` tokens, the layer's whole budget of ``capacity * H`` tokens
per sequence goes to the best scores over all of its heads, so heads whose attention is spread
keep more tokens than heads whose attention is concentrated. The scores are softmax probabilities
(summed over the query heads of each KV head), so they compare across heads. Heads keep ragged
lengths in storage: the saving is real.

Each head first keeps its sinks, window and protected positions, then its safeguard of
``floor(alpha * (capacity - protected))`` top tokens, then the rest of the layer's budget goes to
the best remaining scores over all heads of the sequence.

Differences from the paper and its code:

- The paper compresses the prompt once; here the allocation is re-run after every forward chunk
  (kvbench's protocol), over every token still stored, so the budget holds as the sequence grows.
- The safeguard is a share of the head's selectable budget, capacity minus its protected tokens,
  as in the authors' code (``base_capacity - window_size``); the stack's sinks and window count
  inside kvbench's budget.
- The authors' code rounds ``(1 - alpha) * share + floor`` per head, so its total can miss the
  budget by a few tokens; here the safeguard is taken first and the global top fills the exact
  remainder (as NVIDIA kvpress's ``AdaKVPress`` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbench.cache import devices
from kvbench.cache.surface import TechniqueStore
from kvbench.errors import ConfigError
from kvbench.roles import Flags, Scheduler, keep_top
from kvbench.select import ObservationWindow, within


@dataclass
class AdaKVScheduler(ObservationWindow, Scheduler):
    """Ada-SnapKV eviction with per-head budgets from a layer-wide top-k plus a per-head safeguard.

    Args:
        alpha: safeguard share of each head's selectable budget, in [0, 1] (1: uniform SnapKV).
        obs_window: the last queries whose attention scores the stored tokens.
        pool: max-pooling kernel over neighbouring stored tokens (odd; 1 disables pooling).
    """

    name: str = "adakv"
    # 2: the decode step of issue 29; 3: its output read from its probabilities (CHANGELOG.md);
    # 4: its logits in the keys' dtype (bfloat16/float16 only)
    version = 4
    alpha: float = 0.2
    obs_window: int = 16
    pool: int = 7
    flags = Flags(needs_attention_scores=True, evicts_tokens=True)

    def check_knobs(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"scheduler.alpha={self.alpha}: must be in [0, 1]")
        if self.obs_window < 1:
            raise ConfigError(f"scheduler.obs_window={self.obs_window}: must be >= 1")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ConfigError(f"scheduler.pool={self.pool}: must be an odd integer >= 1 (1: no pooling)")

    def evict(self, layer: int, store: TechniqueStore) -> None:
        if within(store, self.budget.capacity_host):  # every head-row within the mean: nothing over
            return
        cap = self.budget.capacity_of(store)  # per head on average: (B,), or one for all
        held, heads = store.row_tokens_host(), store.kv_heads
        if held is not None:  # the tokens of each sequence, known on the host
            over = any(
                sum(held[b * heads : (b + 1) * heads]) > self.budget.capacity_host(seen) * heads
                for b, seen in enumerate(store.seen_host)
            )
        else:
            total = store.view().valid.sum((1, 2))  # (B,)
            over = bool((total > cap * heads).any())
        if over:
            store.keep(self.select(store, self.window_scores(store, padding=False), cap, held))

    def select(
        self,
        store: TechniqueStore,
        score: torch.Tensor,
        cap: torch.Tensor | int,
        held: list[int] | None = None,
    ) -> torch.Tensor:
        """Tokens kept: ``(B, H, T)`` bool, aligned with ``store.view()`` (any value where it holds no
        token: :meth:`~kvbench.cache.surface.TechniqueStore.keep` reads only where it does).

        Args:
            score: ``(B, H, T)`` finite token scores, comparable across heads (any value where
                ``store.view()`` holds no token: read only where it does).
            cap: ``(B,)`` mean tokens per head-row, or one for every sequence; a sequence keeps at
                most ``cap * H`` tokens.
            held: the tokens of each head-row, where the host knows them
                (:meth:`~kvbench.cache.surface.TechniqueStore.row_tokens_host`).
        """
        view = store.view()
        prot = self.budget.protected_view(store)  # (slots past a row's tokens may read as protected)
        b, h, t = score.shape
        shares = self._host_shares(store, held)
        total: int | torch.Tensor
        if shares is None:  # counted on the device
            cand = view.valid > prot  # the valid tokens not protected
            per_seq = cap[:, None] if isinstance(cap, torch.Tensor) else cap
            free = (per_seq - (prot & view.valid).sum(-1)).clamp(min=0)  # (B, H) selectable slots
            # window scores are finite: no token is protected by a score of +inf
            safe = keep_top(score, cand, safeguards(free, self.alpha, max(store.seen_host)), finite=True)
            ranked = score.masked_fill(safe, float("inf"))
            among, total = cand.reshape(b, 1, h * t), free.sum(-1)
        else:  # the protected tokens ranked first (+inf) in both tops, and counted in them; each
            # safeguard within its head-row's candidates: no top needs a mask after
            per_row, total = shares
            masked = torch.where(view.valid, score.masked_fill(prot, float("inf")), float("-inf"))
            ranked = masked.masked_fill(keep_top(masked, None, per_row, finite=True), float("inf"))
            among = None  # the valid tokens are the scores above -inf
        # The layer-wide top of the rest fills each sequence's selectable slots: the safeguards
        # ranked first (+inf, and no more of them than those slots), then the rest by score in the
        # order a top of the rest alone takes (the same scores, ties by the same slot order); a slot
        # it takes past the candidates (where a sequence keeps every one) is protected or holds no token
        chosen = keep_top(ranked.reshape(b, 1, h * t), among, total, finite=True).view(b, h, t)
        return prot | chosen if shares is None else chosen

    def _host_shares(
        self, store: TechniqueStore, held: list[int] | None
    ) -> tuple[int | torch.Tensor, int | torch.Tensor] | None:
        """Each head-row's safeguard and each sequence's selectable slots over its heads, each with
        the protected tokens it holds, from host figures, where the store is one segment of
        full-precision rows whose every head-row holds each protected position of its sequence (the
        sinks and the window: every selection keeps them, so they are all still stored); else None
        (counted on the device).

        A safeguard is taken at most from the head-row's candidates, so its top holds no slot
        without a token (the same tokens as a top over the candidates alone)."""
        if held is None or len(store.segments) != 1 or store.protect_from_host is not None:
            return None
        heads, budget = store.kv_heads, self.budget
        safe: list[int] = []
        total: list[int] = []
        for b, seen in enumerate(store.seen_host):
            protected = budget.protected_host(seen)  # every head-row holds each of them
            free = max(budget.capacity_host(seen) - protected, 0)
            most = math.floor(free * self.alpha + 1e-9)  # as :func:`safeguards`
            safe.extend(protected + min(most, n - protected) for n in held[b * heads : (b + 1) * heads])
            total.append((protected + free) * heads)
        device = store.device
        per_row = safe[0] if len(set(safe)) == 1 else torch.tensor(safe, device=device).view(-1, heads)
        per_seq = total[0] if len(set(total)) == 1 else torch.tensor(total, device=device)
        return per_row, per_seq


# per (alpha, device): ``floor(f * alpha + 1e-9)`` for ``f = 0, 1, ...`` (read-only, grown by doubling)
_SAFEGUARDS: dict[tuple[float, object], torch.Tensor] = {}


def safeguards(free: torch.Tensor, alpha: float, most: int) -> torch.Tensor:
    """``floor(free * alpha + 1e-9)`` of whole numbers ``0 <= free <= most`` (long): one lookup in a
    table made once on the host by the same float64 arithmetic (a product, a sum, a floor of the
    same numbers: the same results), instead of five operations on the device."""
    key = (alpha, devices.device_of(free))
    table = _SAFEGUARDS.get(key)
    if table is None or table.shape[0] <= most:
        n = max(2 * (most + 1), 1024)
        values = [math.floor(f * alpha + 1e-9) for f in range(n)]
        with torch.inference_mode(False):  # a plain tensor, also when first asked inside a forward
            table = _SAFEGUARDS[key] = torch.tensor(values, dtype=torch.long, device=free.device)
    return table[free]
