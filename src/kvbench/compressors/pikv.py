"""PiKV's hybrid compressor (kvbench's own, docs/methods.md): attention-ranked retention, then mixed
precision KIVI for the retained tokens.

Every token accumulates the attention it receives (summed over queries and the KV head's query
group, as H2O). At each compression point:

1. each head-row keeps sinks, the window, protected positions and the most important tokens up to
   the layer's capacity (``allocation`` splits the stack budget across layers); the rest are
   evicted, wherever they are stored;
2. the retained tokens leaving the full-precision window move out of it as in KIVI: the oldest
   whole groups of ``group_size`` unprotected tokens per head-row (the rest wait for the next
   compression point). Of the moving tokens, the most important are stored at 8 bits (keys and
   values), in whole groups, as many as bring the head-row's stored 8-bit share of its quantized
   tokens closest to ``guard``; the others at ``key_bits``/``value_bits``. Both use KIVI's layout
   (keys per channel over a group, values per token).

A token's precision is decided once, when it leaves the window; later evictions remove tokens of
either precision by importance, and the next moves correct the share. The guard share is counted
over the stored quantized tokens, so it needs no state beyond the cache (a padded batch equals
one-by-one runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from kvbench.cache import attention as att
from kvbench.cache import quant
from kvbench.cache.rows import compact
from kvbench.cache.side import TokenState
from kvbench.cache.surface import TechniqueStore
from kvbench.compressors.quantized import QuantSegment, quantizer
from kvbench.errors import ConfigError
from kvbench.roles import BindContext, Compressor, Flags, keep_top
from kvbench.select import Allocated, evict_by_score, leaving_groups

GUARD_BITS = 8
AUX = TokenState("pikv")  # attention received, accumulated


@dataclass
class PiKVCompressor(Allocated, Compressor):
    """Evicts by accumulated attention, then stores the retained tokens at two precisions.

    Args:
        key_bits: bits of the keys of the unguarded tokens (2, 3, 4 or 8).
        value_bits: bits of their values.
        guard: target share (0..1) of the quantized tokens stored at 8 bits.
        group_size: tokens per quantization group (and per move).
        allocation: how the budget is split across layers.
    """

    name: str = "pikv"
    # 2: the decode step of issue 29; 3: a selection kept where the slots are out of position order
    # breaks ties by position, as its evictions do (CHANGELOG.md)
    # 4: its logits in the keys' dtype (bfloat16/float16 only, CHANGELOG.md)
    version = 4
    key_bits: int = 2
    value_bits: int = 2
    guard: float = 0.5
    group_size: int = 32
    flags = Flags(needs_attention_scores=True, evicts_tokens=True, changes_representation=True)
    _moved: list[int] = field(default_factory=lambda: [0, 0], init=False)  # tokens at 8 bits, low bits

    def check_knobs(self) -> None:
        for key in ("key_bits", "value_bits"):
            if getattr(self, key) not in quant.SUPPORTED_BITS:
                allowed = ", ".join(map(str, quant.SUPPORTED_BITS))
                raise ConfigError(f"compressor.{key}={getattr(self, key)}: allowed {allowed}")
        if not 0.0 <= self.guard <= 1.0:
            raise ConfigError(f"compressor.guard={self.guard}: must be in [0, 1] (share kept at 8 bits)")
        if self.group_size < 1:
            raise ConfigError(f"compressor.group_size={self.group_size}: must be >= 1")

    def on_bind(self, ctx: BindContext) -> None:
        self._moved = [0, 0]

    def observe(self, layer: int, store: TechniqueStore, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        store.add_state(AUX, att.widen(probs.sum((2, 3)), store.columns()))

    def compress(self, layer: int, store: TechniqueStore) -> None:
        capacity = partial(self.allocated_capacity_host, layer)
        evict_by_score(store, self.budget, lambda: store.state(AUX), capacity)
        leaving = leaving_groups(store, self.budget, self.group_size)
        if leaving is None:
            return
        high = self.guarded(store, leaving)
        low = leaving & ~high
        self._moved[0] += int(high.sum())
        self._moved[1] += int(low.sum())
        stays = store.fp_valid() & ~high
        store.move_out(high, quantizer(GUARD_BITS, GUARD_BITS, self.group_size))
        store.move_out(compact(low, stays), quantizer(self.key_bits, self.value_bits, self.group_size))

    def guarded(self, store: TechniqueStore, leaving: torch.Tensor) -> torch.Tensor:
        """Mask over the full-precision rows: the most important of the ``leaving`` tokens, in whole
        groups, as many as bring each head-row's stored 8-bit share closest to ``guard``."""
        fp, g = store.fp, self.group_size
        stored = {(s.key_bits, s.value_bits): s.lens for s in store.segments if isinstance(s, QuantSegment)}
        zero = torch.zeros_like(fp.lens)
        q8 = stored.get((GUARD_BITS, GUARD_BITS), zero)
        low_bits = (self.key_bits, self.value_bits)
        qlow = zero if low_bits == (GUARD_BITS, GUARD_BITS) else stored.get(low_bits, zero)
        moving = leaving.sum(-1)  # (BH,) whole groups
        want = self.guard * (q8 + qlow + moving).double() - q8.double()
        k = (torch.floor(want / g + 0.5).long() * g).clamp(min=0)
        k = torch.minimum(k, moving)
        imp = store.fp_view(AUX.name)
        return keep_top(imp[None], leaving[None], k[None])[0]

    def metrics(self) -> dict[str, float | list[float] | None]:
        moved = sum(self._moved)
        return {"guard_share": self._moved[0] / moved if moved else None}
