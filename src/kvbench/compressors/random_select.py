"""Random selection at the budget: the sanity floor of every token-selection method (docs/methods.md).

Each stored token has a random priority, a function of ``seed``, the layer, the KV head and its
original position (drawn with a seeded ``torch.Generator`` in blocks of positions, so runs are
deterministic and a padded batch keeps what one-by-one runs keep). At each compression point every
head-row keeps sinks, the window and protected positions, then the highest-priority tokens up to
the capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.cache.surface import TechniqueStore
from kvbench.roles import BindContext, Compressor, Flags
from kvbench.select import ScoredSelection

BLOCK = 4096  # positions per generator draw


@dataclass
class RandomCompressor(ScoredSelection, Compressor):
    """Keeps a random subset of each head-row's unprotected tokens, the same size as other selections.

    Args:
        seed: seeds the priorities (run several seeds for a floor with an interval).
    """

    name: str = "random"
    # 2: the decode step of issue 29; 3: a selection kept where the slots are out of position order
    # breaks ties by position, as its evictions do (CHANGELOG.md)
    version = 3
    seed: int = 0
    flags = Flags(evicts_tokens=True)
    _tables: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)  # per layer

    def on_bind(self, ctx: BindContext) -> None:
        self._tables = {}

    def priorities(self, layer: int, heads: int, width: int, device: torch.device) -> torch.Tensor:
        """``(heads, width)`` random priorities of positions ``0 .. width-1`` in ``layer``."""
        table = self._tables.get(layer, torch.empty(heads, 0, device=device))
        while table.shape[1] < width:
            block = table.shape[1] // BLOCK
            gen = torch.Generator().manual_seed(hash((self.seed, layer, block)) & 0x7FFF_FFFF_FFFF_FFFF)
            table = torch.cat([table, torch.rand(heads, BLOCK, generator=gen).to(device)], dim=1)
        self._tables[layer] = table
        return table[:, :width]

    def score(self, layer: int, store: TechniqueStore) -> torch.Tensor:
        """``(B, H, T)`` the random priority of each stored token's position."""
        prio = self.priorities(layer, store.kv_heads, store.seen_max, store.device)
        return torch.gather(prio.expand(store.batch, -1, -1), -1, store.view().pos.clamp(min=0))
