"""Rotary position embedding, applied and undone on cached keys.

Keys are cached after rotary embedding. Compressors that factor keys (``svd``, ``lora``) work on
pre-RoPE keys, as ShadowKV and Palu do: they undo the rotation at each token's original position,
compress, and rotate again on read. Only the ``rotate_half`` convention (Llama, Mistral, Qwen2,
GPT-NeoX with partial rotary) is supported; other models are refused by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.cache import devices
from kvbench.errors import ConfigError


@dataclass
class _RowAngles:
    """One row of positions that every head-row held, with its angles: ``cos`` and ``sin``, and the
    two as one complex ``turn`` once :meth:`Rotary.rotate_pairs` asks for it."""

    rotary: Rotary
    device: object
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    turn: torch.Tensor | None = None


# The last positions whose head-rows all held the same, with that row's angles, on the CPU
# (:meth:`Rotary._row_angles`): at most one entry, outside the cache.
_ROW_ANGLES: list[_RowAngles] = []

ROTATE_HALF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gemma", "gemma2", "phi3", "olmo2")


@dataclass
class Rotary:
    """``inv_freq`` ``(rot_dim / 2,)``; ``scaling`` multiplies cos and sin; the first ``rot_dim``
    channels of each head rotate, the rest pass through (partial rotary)."""

    inv_freq: torch.Tensor
    scaling: float = 1.0

    @property
    def rot_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @classmethod
    def from_model(cls, model) -> Rotary:
        family = model.config.model_type
        rotary = getattr(model.get_decoder(), "rotary_emb", None)
        if family not in ROTATE_HALF_FAMILIES or rotary is None:
            raise ConfigError(
                f"model family {family!r}: pre-RoPE compressors support {', '.join(ROTATE_HALF_FAMILIES)}"
            )
        return cls(rotary.inv_freq.detach().float().cpu(), float(getattr(rotary, "attention_scaling", 1.0)))

    def _cos_sin(self, pos: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``(..., rot_dim / 2)`` at ``pos``, times the attention scaling: both halves of
        the rotated channels turn by the same angles, so each is computed once."""
        freqs = pos.to(device).float()[..., None] * self.inv_freq.to(device)
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:  # multiplying by 1 changes no value: save two operations
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos, sin

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Apply RoPE. ``x`` ``(..., D)``; ``pos`` broadcastable to ``x.shape[:-1]``."""
        return self._turn(x, *self._cos_sin(pos, x.device), undo=False)

    def rotate_rows(self, x: torch.Tensor, pos: torch.Tensor, per_row: int | None) -> torch.Tensor:
        """:meth:`rotate` of head-major tokens at their positions: flat ``x`` ``(N, D)`` at ``pos``
        ``(N,)``, or per head-row ``(BH, n, D)`` at ``(BH, n)`` (any row stride); ``per_row`` tokens in
        each head-row (None: the rows differ).

        On the CPU, when every head-row holds the same positions (a window's oldest token leaves
        every head at once; a batch's windows sit at the same positions), the angles are computed
        for one row and shared: the same values, and the angles cost as much as the rotation."""
        if per_row and pos.device.type == "cpu":
            p = pos.view(-1, per_row)
            angles = self._row_angles(p) if p.shape[0] > 1 else None
            if angles is not None:
                return self._turn(x.view(p.shape[0], per_row, x.shape[-1]), *angles, undo=False).view(x.shape)
        return self.rotate(x, pos)

    def _row_angles(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`_cos_sin` of the one row of positions that every head-row of ``pos`` ``(BH, n)``
        holds, on the CPU; None when the rows differ. Computed once for the layers of a step: each
        layer's segment holds the same positions (a representation keeps every token it is given),
        so the last positions found shared are kept with their row's angles, and a layer holding
        the same ones is answered by one comparison. The same values; the memo sits in this module,
        not in the cache, so what a cache holds is measured as before (it is one layer's positions
        and one row's angles)."""
        found = self._row_entry(pos)
        return None if found is None else (found.cos, found.sin)

    def _row_entry(self, pos: torch.Tensor) -> _RowAngles | None:
        """:data:`_ROW_ANGLES`' entry for ``pos`` (made if every head-row holds the same positions),
        or None (:meth:`_row_angles`)."""
        device = devices.device_of(pos)
        for entry in _ROW_ANGLES:
            seen = entry.pos
            if (
                entry.rotary is self
                and entry.device == device
                and seen.shape == pos.shape
                and torch.equal(seen, pos)
            ):
                return entry
        if not torch.equal(pos, pos[:1].expand_as(pos)):
            return None
        cos, sin = self._cos_sin(pos[0], pos.device)
        _ROW_ANGLES[:] = [_RowAngles(self, device, pos.clone(), cos, sin)]
        return _ROW_ANGLES[0]

    def rotate_rebuilt(
        self,
        rebuild: Callable[[torch.Tensor], torch.Tensor],
        basis: torch.Tensor,
        pos: torch.Tensor,
        per_row: int | None,
        paired: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`rotate_rows` of keys that ``rebuild`` makes, float32, from ``basis`` ``(H, D, r)``
        (each key channel a product with one row of it). Under a whole rotation, rebuilt on the
        basis with its rows in :meth:`pairs_order` (:meth:`in_pairs_order`, one gather of its
        values; ``paired``: that basis, where the caller holds it), so each pair the rotation turns
        together comes out side by side, and turned by :meth:`rotate_pairs` (a complex product and
        a copy, where the channels in their usual order take six operations): the same keys, bit
        for bit (a product's rows in another order are the same sums)."""
        if paired is None:
            paired = self.in_pairs_order(basis)
        if paired is None:
            return self.rotate_rows(rebuild(basis), pos, per_row)
        return self.rotate_pairs(rebuild(paired), pos, per_row)

    def in_pairs_order(self, basis: torch.Tensor) -> torch.Tensor | None:
        """``basis`` ``(H, D, r)`` with its rows in :meth:`pairs_order` (one gather), or None where
        the rotation is partial."""
        order = self.pairs_order(basis)
        return None if order is None else basis.index_select(1, order)

    def pairs_order(self, like: torch.Tensor) -> torch.Tensor | None:
        """The channel order ``[0, D/2, 1, D/2 + 1, ...]`` that puts each pair a rotation turns
        together (channels ``i`` and ``i + D/2``) side by side, for :meth:`rotate_pairs`, on the device
        of ``like`` (a basis ``(H, D, r)``, ``D`` its head size); None where the rotation is partial
        (``rot_dim < D``: the general :meth:`rotate_rows`)."""
        if self.rot_dim != like.shape[1]:
            return None
        return _pairs_order(self.rot_dim, like.device, devices.device_of(like))

    def rotate_pairs(self, x: torch.Tensor, pos: torch.Tensor, per_row: int | None) -> torch.Tensor:
        """:meth:`rotate_rows` of float32 keys whose channels come in :meth:`pairs_order` (each pair
        that turns together side by side, as a key rebuilt on a basis whose rows are in that order
        comes out), returned in the usual order: each pair read as one complex number, turned by one
        complex product with ``cos + i·sin`` and written back in order by one copy (a ``cat`` of its
        real and imaginary parts), where
        :meth:`_turn` takes six operations. Bitwise its values: a complex product of
        ``(x1 + i·x2)(cos + i·sin)`` is ``x1·cos - x2·sin`` and ``x1·sin + x2·cos``, each product
        rounded, then the difference and the sum, as :meth:`_turn` computes them, on the CPU
        (``tests/test_lowrank.py``, shared, per-row and flat positions). A GPU's complex product may
        fuse a product into its sum (one rounding less): there, on ``kernels=torch``, a key may
        differ in its last bit; the fused kernels, a GPU's default, do not take this path."""
        h = self.rot_dim // 2
        assert x.dtype == torch.float32 and x.shape[-1] == 2 * h, "rotate_pairs: float32 keys, whole rotation"
        turn = None
        if per_row and pos.device.type == "cpu":
            p = pos.view(-1, per_row)
            entry = self._row_entry(p) if p.shape[0] > 1 else None
            if entry is not None:  # one row's turn for every head-row, made once for the step's layers
                if entry.turn is None:
                    entry.turn = torch.complex(entry.cos, entry.sin)
                turn, shape = entry.turn, (p.shape[0], per_row, h, 2)
        if turn is None:
            turn, shape = torch.complex(*self._cos_sin(pos, x.device)), (*x.shape[:-1], h, 2)
        z = torch.view_as_complex(x.view(shape)) * turn
        # the turned pairs' first channels, then their second ones: one copy of the two strided
        # halves side by side (the same as reshaping the transposed pairs, a third less of the
        # CPU's time: its copy loop runs along each half, not across pairs of two)
        return torch.cat((z.real, z.imag), -1).view(x.shape)

    def unrotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`rotate` (exact up to rounding; divides out the attention scaling)."""
        return self._turn(x, *self._cos_sin(pos, x.device), undo=True)

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, undo: bool) -> torch.Tensor:
        """``x·cos + rotate_half(x)·sin`` on the rotated channels (``rotate_half(x) = (-x2, x1)``),
        half by half: ``(x1·cos - x2·sin, x2·cos + x1·sin)``, or with ``-sin`` to undo. Bitwise what
        the full-width form gives (negating a product is exact, ``a + (-b)`` is ``a - b``). Each half
        is written in place into one float32 buffer: no concatenation (on the CPU, the ``cat`` of
        the halves cost six times the arithmetic)."""
        r, h = self.rot_dim, self.rot_dim // 2
        xr = x[..., :r]
        xr = xr if xr.dtype == torch.float32 else xr.float()
        x1, x2 = xr[..., :h], xr[..., h:]
        shape = xr.shape[:-1]
        # torch.broadcast_shapes costs more than the whole turn of the few tokens a step moves
        if cos.shape[:-1] != shape:
            shape = torch.broadcast_shapes(shape, cos.shape[:-1])
        whole = r == x.shape[-1] and x.dtype == torch.float32
        out = x.new_empty(*shape, x.shape[-1] if whole else r, dtype=torch.float32)
        first, second = out[..., :h], out[..., h:r]
        if undo:
            torch.add(x1 * cos, x2 * sin, out=first)
            torch.sub(x2 * cos, x1 * sin, out=second)
        else:
            torch.sub(x1 * cos, x2 * sin, out=first)
            torch.add(x2 * cos, x1 * sin, out=second)
        if undo and self.scaling != 1.0:  # dividing by 1 changes no value
            out.div_(self.scaling**2)
        if whole:
            return out
        full = x.new_empty(*shape, x.shape[-1])
        full[..., :r] = out
        full[..., r:] = x[..., r:]
        return full


@functools.lru_cache(maxsize=16)
def _pairs_order(head_dim: int, device: torch.device, key: object) -> torch.Tensor:
    """:meth:`Rotary.pairs_order` of a whole rotation on ``device`` (``key``: its memo key,
    :func:`kvbench.cache.devices.device_of`), read-only."""
    h = head_dim // 2
    with torch.inference_mode(False):  # a plain tensor, also when first asked inside a forward
        return torch.tensor([c for i in range(h) for c in (i, i + h)], device=device)
