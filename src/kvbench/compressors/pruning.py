"""ThinK: query-driven pruning of key channels per KV head; kept channels stored only (arXiv:2407.21018).

Channel ``j`` of a KV head scores ``‖Q_obs[:, j]‖₂ · ‖K[:, j]‖₂`` (ThinK's per-channel magnitude
criterion ``‖Q_obs[:, j] K[:, j]ᵀ‖_F``, which factors into the two norms), where ``Q_obs`` holds the
last ``obs_window`` rotated queries of the head's query group and ``K`` the stored rotated keys. The
top ``keep_ratio`` share of channels is kept. The tokens past the full-precision window (unprotected
full-precision tokens) leave it in whole groups of ``move_group`` and move into a
:class:`PrunedSegment` that stores only the kept key channels and the full values; reads put zeros
in the pruned channels, so ``q · k`` uses the kept channels only.

The channel set of each head-row (one sequence, one KV head) is chosen once, at the first
compression point where that head-row has tokens to prune (a whole group leaving the window), and
stays fixed after: every later
token leaving the window is pruned to the same channels, and the indices are stored once per
head-row (:class:`KeptChannels`, the layer's side data, counted in bytes).

Differences from the paper: ThinK prunes the prefill keys once and leaves the keys of decoded
tokens whole; here the decoded tokens past the window are pruned too, with the head-row's fixed
set, so the saving holds as the sequence grows. They leave the window a group at a time (as KIVI's
and Palu's full-precision residuals do), so a decoded token stays whole until its group is full,
and the move's work is done once in ``move_group`` steps. ThinK selects per attention head; under
GQA the cache holds one key per KV head, so the query norm here spans every query head of the group.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.cache.ragged import segment_ids
from kvbench.cache.segments import RowCounts, Segment, packed_rows
from kvbench.cache.side import SideData
from kvbench.cache.surface import Columns, TechniqueStore
from kvbench.compressors.lowrank import check_rank
from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.roles import Compressor, Flags
from kvbench.select import leaving, moving_per_row


@dataclass
class KeptChannels(SideData):
    """``channels`` ``(BH, d_keep)`` int16: the kept key channels of each head-row (stored, counted in
    the layer's bytes); ``index``: the same as int64, the index gather and scatter take, made once
    per set of channels so that no move or read converts it again (held: in the resident bytes,
    not the stored ones)."""

    channels: torch.Tensor
    index: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.channels]


@packed_rows("kp", "v")
@dataclass
class PrunedSegment(RowCounts, Segment):
    """Tokens with thinned keys. ``kp`` ``(N, d_keep)`` kept key channels, ``v`` ``(N, D)``.

    ``channels`` ``(BH, d_keep)`` int16 are the kept channel indices of each head-row, ``index`` the
    same as int64; both are the layer's :class:`KeptChannels` (the int16 counted there, once).
    """

    head_dim: int = 64
    kp: torch.Tensor = None  # type: ignore[assignment]
    v: torch.Tensor = None  # type: ignore[assignment]
    channels: torch.Tensor = None  # type: ignore[assignment]
    index: torch.Tensor = None  # type: ignore[assignment]

    ZEROED = True  # full keys are the kept channels scattered into zeros

    def data_fields(self) -> dict[str, torch.Tensor]:
        return {"kp": self.kp, "v": self.v}

    def keys(self, k: torch.Tensor, prune: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """The kept channels of full keys ``k`` ``(N, D)`` (``prune``), or full keys (zeros in the
        pruned channels) from kept ones ``(N, d_keep)`` (or ``(BH, n, d_keep)`` per head-row, any row
        stride): by each head-row's channels, broadcast over its tokens when every head-row holds the
        same number (no per-token index), else indexed per token. Full keys go into ``out`` when
        given: ``(BH, n, D)`` slots of zeros (any strides), returned."""
        n, channels = self.row_count(), self.index
        if n is None:
            index = channels[segment_ids(self.lens)]
            if prune:
                return torch.gather(k, 1, index)
            full = k.new_zeros(k.shape[0], self.head_dim).scatter_(1, index, k)
            return full if out is None else out.copy_(full.view(out.shape))
        bh = self.lens.numel()
        index = channels[:, None, :].expand(bh, n, channels.shape[1])
        rows = k.view(bh, n, k.shape[-1])
        if prune:
            return torch.gather(rows, 2, index).view(-1, channels.shape[1])
        if out is not None:
            return out.scatter_(2, index, rows)
        return k.new_zeros(bh, n, self.head_dim).scatter_(2, index, rows).view(-1, self.head_dim)

    def attend_partials(self, query: torch.Tensor, scaling: float, batch: int) -> Any:
        """On the Triton path, the fused kernel (:mod:`kvbench.kernels.pruned_decode`: the query's
        kept channels read by each head-row's indices, scored against the kept keys as stored, no
        full key rebuilt). None on the torch path (the step is decoded: keys scattered into zeros)."""
        pruned_decode = dispatch.kernels("pruned_decode", batch, self.rows.width)
        if pruned_decode is None:
            return None
        per_row = self.row_count() is not None  # then read in place, else flat
        kp, v = (self.per_row_field(n) if per_row else getattr(self, n) for n in ("kp", "v"))
        return pruned_decode.partials(
            query, kp, v, self.channels, self.lens, self.rows.width, scaling, per_row=per_row
        )

    def writes_into(self) -> tuple[bool, bool]:
        """Keys are scattered straight into the slots given (zeros: :attr:`Segment.ZEROED`); values
        are stored as read, joined by a ``cat``."""
        return True, False

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.read_into(None, None, dtype)
        return keys, values.reshape(-1, values.shape[-1])

    def read_into(
        self, k: torch.Tensor | None, v: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Segment.read_into`; where every head-row holds ``n`` tokens, values not given slots
        come per head-row ``(BH, n, D)`` (a view of the stored values in their dtype)."""
        if self.row_count() is None:  # head-rows of different lengths: flat
            kp, values = self.kp, self.v
        else:  # per head-row, in place (a packed segment's buffers are not unpacked)
            kp, values = self.per_row_field("kp"), self.per_row_field("v")
        keys = self.keys(kp.to(dtype), prune=False, out=k)
        values = values.to(dtype)
        return keys, (values if v is None else v.copy_(values.view(v.shape)))

    def head_rows(self, lo: int, hi: int) -> Segment:
        part = super().head_rows(lo, hi)
        if part is not self:
            assert isinstance(part, PrunedSegment)
            part.channels, part.index = self.channels[lo:hi], self.index[lo:hi]
        return part

    def extend(self, other: Segment) -> None:
        assert isinstance(other, PrunedSegment)
        super().extend(other)
        self.channels, self.index = other.channels, other.index


@dataclass
class PruningCompressor(Compressor):
    """ThinK key-channel pruning with ``keep_ratio`` of the channels kept per KV head.

    Args:
        keep_ratio: share of key channels kept, in (0, 1]; ``ceil(keep_ratio * head_dim)`` channels.
        obs_window: number of latest queries whose norms drive the channel score.
        move_group: the tokens past the full-precision window leave it in whole groups of this
            many (the window then holds up to ``move_group - 1`` tokens more); 1: each token as it
            leaves.
    """

    name: str = "pruning"
    # 2: packed pruned keys and values, resident bytes at their capacity; 3: the int64 index of
    # the kept channels held (resident bytes) so that no step converts it (issue 29, CHANGELOG.md);
    # 4: the tokens past the window leave it in whole groups of ``move_group``, and a decode step
    # after every head-row chose its channels takes the bare read (resident bytes; issue 29)
    version = 4
    keep_ratio: float = 0.5
    obs_window: int = 16
    move_group: int = 16
    flags = Flags(changes_representation=True)
    wants_queries = True
    # Per cache layer: the window's queries ``(B, Hq, w, D)`` and positions ``(B, w)`` (-1 empty),
    # which head-rows ``(BH,)`` have chosen their channels, and whether all have (then the
    # channels are fixed for good: no query is kept any more, nothing is chosen again).
    _queries: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )
    _chosen: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )
    _settled: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )

    def check_knobs(self) -> None:
        if not 0.0 < self.keep_ratio <= 1.0:
            raise ConfigError(f"compressor.keep_ratio={self.keep_ratio}: must be in (0, 1]")
        if self.obs_window < 1:
            raise ConfigError(f"compressor.obs_window={self.obs_window}: must be >= 1")
        check_rank("compressor.move_group", self.move_group)

    def kept_channels(self, head_dim: int) -> int:
        return max(1, math.ceil(self.keep_ratio * head_dim - 1e-9))

    def observe_queries(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> None:
        """Keep the ``obs_window`` latest real queries of each sequence (padding has ``qpos`` -1), until
        every head-row of the layer has chosen its channels (no score is computed after)."""
        if store in self._settled:
            return
        prev = self._queries.get(store)
        if prev is not None:
            query = torch.cat([prev[0], query], dim=2)
            qpos = torch.cat([prev[1], qpos], dim=1)
        top = qpos.topk(min(self.obs_window, qpos.shape[1]), dim=-1).indices  # (B, w)
        b, hq, _, d = query.shape
        queries = torch.gather(query, 2, top[:, None, :, None].expand(b, hq, -1, d))
        self._queries[store] = (queries, torch.gather(qpos, 1, top))

    def watches_queries(self, stores: Sequence[TechniqueStore]) -> bool:
        """Until every head-row of every layer has chosen its channels: a decode step after that
        reads its cache as if no technique read the queries (the bare read, no view made)."""
        return not all(store in self._settled for store in stores)

    def channel_scores(self, store: TechniqueStore) -> torch.Tensor:
        """``(B * H, D)``: ‖Q_obs[:, j]‖ over the group's window queries times ‖K[:, j]‖ over stored keys."""
        view = store.view()
        b, h, _, d = view.k.shape
        keys = view.k.float() * view.valid[..., None]
        knorm = keys.pow(2).sum(2).sqrt()  # (B, H, D)
        window = self._queries.get(store)
        if window is None:  # no query seen (not driven by the engine): keys alone
            return knorm.reshape(b * h, d)
        queries, qpos = window
        q = queries.float() * (qpos >= 0)[:, None, :, None]
        qnorm = q.view(b, h, -1, q.shape[2], d).pow(2).sum((2, 3)).sqrt()  # (B, H, D)
        return (qnorm * knorm).reshape(b * h, d)

    def _channels(self, store: TechniqueStore, move: torch.Tensor | Columns) -> KeptChannels:
        """The layer's kept channels ``(BH, d_keep)``, chosen now for head-rows with tokens in ``move``
        ``(BH, W)`` (the same columns of every head-row: all of them) and no set yet."""
        kept = store.side(KeptChannels)
        if store in self._settled and kept is not None:  # every head-row has its set: nothing to do
            return kept
        bh, d = store.batch * store.kv_heads, store.head_dim
        keep = self.kept_channels(d)
        side = (
            torch.zeros(bh, keep, dtype=torch.int16, device=store.device) if kept is None else kept.channels
        )
        chosen = self._chosen.get(store)
        if chosen is None:
            chosen = torch.zeros(bh, dtype=torch.bool, device=store.device)
        new = ~chosen if isinstance(move, Columns) else move.any(-1) & ~chosen
        if bool(new.any()):
            top = self.channel_scores(store).topk(keep, dim=-1).indices.sort(-1).values
            side = torch.where(new[:, None], top.to(torch.int16), side)
            chosen = chosen | new
            if bool(chosen.all()):
                self._settled[store] = True
                self._queries.pop(store, None)
        self._chosen[store] = chosen
        if kept is None or side is not kept.channels:
            kept = KeptChannels(side, side.long())
            store.set_side(kept)
        return kept

    def compress(self, layer: int, store: TechniqueStore) -> None:
        group = self.move_group
        move = leaving(store, self.budget, group)  # columns where the host knows them, else a mask
        # a group's mask holds a token (``leaving_groups`` read that already); one token's may not
        if move is None or (group == 1 and isinstance(move, torch.Tensor) and not bool(move.any())):
            return
        per_row = moving_per_row(store, self.budget, group)
        kept = self._channels(store, move)

        def build(k, v, pos, lens):
            return self._prune(k, v, pos, lens, kept, store.head_dim)

        store.move_out(move, build, per_row=per_row)

    @staticmethod
    def _prune(k, v, pos, lens, kept: KeptChannels, head_dim: int) -> PrunedSegment:
        seg = PrunedSegment(
            lens=lens, pos=pos, head_dim=head_dim, kp=k, v=v, channels=kept.channels, index=kept.index
        )
        seg.kp = seg.keys(k, prune=True)
        return seg
