"""What a technique sees of a layer's cache, as types (issue 31).

Technique hooks take a :class:`TechniqueStore`, not a :class:`kvbench.cache.store.LayerStore`:
mypy then fails technique code that reaches a member outside it, or assigns to one (every read is
a read-only property or a method). It has two parts:

- :class:`StoreView`: what the cache holds, read only. The tokens (keys, values, positions and
  their layout, the representations), the sequences' lengths and protected positions, and
  per-token state and side data.
- The operations of :class:`TechniqueStore` on top: keep or drop tokens, move them into a
  representation or replace them, write per-token state and side data, keep a copy elsewhere.

:class:`~kvbench.cache.store.LayerStore` satisfies both structurally (mypy checks it wherever the
engine hands a store to a hook). ``tests/test_technique_state.py`` checks the text as well: code
under ``compressors/``, ``routers/``, ``schedulers/`` and ``select.py`` names no ``LayerStore``,
every ``store.<member>`` it writes is one of these, and each of these is still used (the surface
only shrinks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from kvbench.cache.rows import Columns
from kvbench.cache.segments import FPSegment, Segment
from kvbench.cache.side import SideData, TokenState
from kvbench.cache.view import PaddedView

S = TypeVar("S", bound=SideData)

# what a representation builds from the tokens moved out of the full-precision rows: k (n, D), v (n, D),
# pos (n,), lens (BH,) -> its segment (:meth:`LayerStore.move_out`)
Build = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Segment]


class StoreView(Protocol):
    """A layer's cache, read only: see :class:`kvbench.cache.store.LayerStore` for each member."""

    # --- shape --------------------------------------------------------------------------------
    @property
    def batch(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    def local(self, x: torch.Tensor) -> torch.Tensor: ...

    # --- the stored tokens: keys, values, positions ---------------------------------------------
    def view(self) -> PaddedView: ...
    def keys(self) -> torch.Tensor: ...
    def kv(self) -> tuple[torch.Tensor, torch.Tensor]: ...
    def columns(self) -> int: ...
    def uniform_tokens(self) -> int | None: ...
    def row_tokens_host(self) -> list[int] | None: ...
    def by_position(self) -> torch.Tensor: ...
    def in_position_order(self) -> bool: ...
    def unprotected_in_position_order(self) -> bool: ...
    def position_key(self, qpos: torch.Tensor) -> tuple[Any, ...] | None: ...

    # --- the representations that hold them ----------------------------------------------------
    @property
    def segments(self) -> Sequence[Segment | FPSegment]: ...
    @property
    def fp(self) -> FPSegment: ...
    def fp_view(self, name: str = "pos") -> torch.Tensor: ...
    def fp_valid(self) -> torch.Tensor: ...
    @property
    def edits(self) -> int: ...
    @property
    def changes(self) -> int: ...
    def nbytes(self) -> int: ...

    # --- sequences: lengths, the last chunk, protected positions --------------------------------
    @property
    def seen(self) -> torch.Tensor: ...
    @property
    def seen_host(self) -> Sequence[int]: ...
    @property
    def seen_max(self) -> int: ...
    @property
    def last_qpos(self) -> torch.Tensor: ...
    @property
    def last_padded(self) -> bool: ...
    @property
    def protect_from(self) -> torch.Tensor | None: ...
    @property
    def protect_from_host(self) -> tuple[int, ...] | None: ...

    # --- per-token state and side data -----------------------------------------------------------
    def state(self, st: TokenState) -> torch.Tensor: ...
    def states(self) -> list[TokenState]: ...
    def side(self, kind: type[S]) -> S | None: ...


class TechniqueStore(StoreView, Protocol):
    """A layer's cache as a technique acts on it: :class:`StoreView` and these operations."""

    # --- keep or drop tokens -------------------------------------------------------------------
    def keep(self, mask: torch.Tensor, kept: list[int] | None = None, few: bool = False) -> None: ...
    def can_drop(self, kept: int) -> bool: ...
    def drop(self, cols: torch.Tensor) -> None: ...
    def close_column(self, col: int, stop: int, heads: tuple[bool, ...]) -> None: ...

    # --- move them into a representation, or replace them ---------------------------------------
    def move_out(
        self, move: torch.Tensor | Columns, build: Build, first: bool = False, per_row: int | None = None
    ) -> Segment | None: ...
    def replace(
        self,
        sel: torch.Tensor,
        seg: Segment,
        state: dict[str, torch.Tensor],
        kept: list[int] | None = None,
        per_row: int | None = None,
    ) -> None: ...

    # --- per-token state, side data, copies elsewhere -------------------------------------------
    def add_state(self, st: TokenState, values: torch.Tensor) -> None: ...
    def put_state(
        self, st: TokenState, index: tuple[Any, ...], values: torch.Tensor | float, add: float = 0
    ) -> None: ...
    def set_state(self, st: TokenState, values: torch.Tensor) -> None: ...
    def set_side(self, data: SideData) -> None: ...
    @property
    def copies(self) -> dict[str, Any]: ...


# --- what derives from the view's members: functions over it, not more members -----------------------
def chunk_start(store: StoreView, qpos: torch.Tensor) -> torch.Tensor:
    """First position of each sequence's current chunk ``(B,)``: its first real query (``qpos``
    ``(B, q)``, -1 for padding), else ``seen`` (every real query lies below ``seen``)."""
    return torch.where(qpos >= 0, qpos, store.seen[:, None]).amin(-1)


def protected_from(store: StoreView) -> torch.Tensor | None:
    """``protect_from`` shaped ``(B, 1, 1)`` to compare with ``view().pos``; None where unset."""
    start = store.protect_from
    return None if start is None else start[:, None, None]


def every_query_real(store: StoreView, qpos: torch.Tensor) -> bool:
    """The queries at ``qpos`` are the whole last chunk and none is padding (from host figures)."""
    last = store.last_qpos  # the engine's read passes this very tensor: no shape compared
    return not store.last_padded and (qpos is last or qpos.shape == last.shape)


def every_position(store: StoreView) -> bool:
    """Every stored slot holds the token of its own position (row ``t`` of ``view()`` is position
    ``t`` in every head-row), from host figures: one in-order segment, nothing evicted, every
    sequence at the same length and the last chunk unpadded. Layers of one step then share the
    layout, and whatever derives from positions alone."""
    if not store.in_position_order() or store.last_padded:
        return False
    width = store.uniform_tokens()
    seen = store.seen_host
    return width is not None and seen.count(width) == len(seen)


def members(protocol: type) -> frozenset[str]:
    """The public members ``protocol`` declares itself (not those of its bases)."""
    return frozenset(name for name in vars(protocol) if not name.startswith("_"))


if TYPE_CHECKING:
    from kvbench.cache.store import LayerStore

    def _conforms(store: LayerStore) -> TechniqueStore:
        return store  # mypy checks here that the store has every member above, with its type


READS = members(StoreView)  # what a technique may read
ACTS = members(TechniqueStore)  # and what it may do
