"""Rotary position embedding, applied and undone on cached keys.

Keys are cached after rotary embedding. Compressors that factor keys (``svd``, ``lora``) work on
pre-RoPE keys, as ShadowKV and Palu do: they undo the rotation at each token's original position,
compress, and rotate again on read. Only the ``rotate_half`` convention (Llama, Mistral, Qwen2,
GPT-NeoX with partial rotary) is supported; other models are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.errors import ConfigError

ROTATE_HALF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gemma", "gemma2", "phi3", "olmo2")


@dataclass
class Rotary:
    """``inv_freq`` ``(rot_dim / 2,)``; ``scaling`` multiplies cos and sin; the first ``rot_dim``
    channels of each head rotate, the rest pass through (partial rotary)."""

    inv_freq: torch.Tensor
    scaling: float = 1.0
    _sign_cache: dict[tuple[torch.device, float], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

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

    def angles(self, pos: torch.Tensor, device: torch.device) -> Angles:
        """cos and signed sin at ``pos``: compute once to unrotate and rotate the same tokens."""
        cos, sin = self._cos_sin(pos, device)
        return Angles(cos, sin * self._signs(device, 1.0), sin * self._signs(device, -1.0))

    def _cos_sin(self, pos: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.to(device).float()[..., None] * self.inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.scaling == 1.0:  # multiplying by 1 changes no value: save two operations
            return emb.cos(), emb.sin()
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def _signs(self, device: torch.device, sign: float) -> torch.Tensor:
        """``(rot_dim,)``: the signs of ``rotate_half`` (first half negated) times ``sign``, per device."""
        key = (device, sign)
        if key not in self._sign_cache:
            half = self.rot_dim // 2
            signs = torch.tensor([-sign] * half + [sign] * half, dtype=torch.float32, device=device)
            self._sign_cache[key] = signs
        return self._sign_cache[key]

    def rotate(self, x: torch.Tensor, pos: torch.Tensor, angles: Angles | None = None) -> torch.Tensor:
        """Apply RoPE. ``x`` ``(..., D)``; ``pos`` broadcastable to ``x.shape[:-1]``; ``angles`` of
        ``pos`` when already computed (:meth:`angles`)."""
        angles = self.angles(pos, x.device) if angles is None else angles
        return self._turn(x, angles.cos, angles.rotate, undo=False)

    def unrotate(self, x: torch.Tensor, pos: torch.Tensor, angles: Angles | None = None) -> torch.Tensor:
        """Undo :meth:`rotate` (exact up to rounding; divides out the attention scaling)."""
        angles = self.angles(pos, x.device) if angles is None else angles
        return self._turn(x, angles.cos, angles.unrotate, undo=True)

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, undo: bool) -> torch.Tensor:
        """``x·cos + rotate_half(x)·sin`` on the rotated channels, with ``rotate_half(x)·sin`` taken as
        ``roll(x)·signed_sin``: negating a factor of a product negates the product exactly, so this
        is bitwise what ``cat(-x2, x1)·sin`` gives, in one operation instead of four."""
        r = self.rot_dim
        partial = r < x.shape[-1]
        xr = x[..., :r] if partial else x
        xr = xr if xr.dtype == torch.float32 else xr.float()
        out = xr * cos + xr.roll(r // 2, dims=-1) * signed_sin
        if undo and self.scaling != 1.0:  # dividing by 1 changes no value
            out = out / (self.scaling**2)
        out = out if out.dtype == x.dtype else out.to(x.dtype)
        return torch.cat((out, x[..., r:]), dim=-1) if partial else out


@dataclass
class Angles:
    """cos ``(..., rot_dim)`` of some positions and their sin with the signs of rotating
    (``rotate``) or unrotating (``unrotate``) folded in."""

    cos: torch.Tensor
    rotate: torch.Tensor
    unrotate: torch.Tensor
