"""Rotary position embedding, applied and undone on cached keys.

Keys are cached after rotary embedding. Compressors that factor keys (``svd``, ``lora``) work on
pre-RoPE keys, as ShadowKV and Palu do: they undo the rotation at each token's original position,
compress, and rotate again on read. Only the ``rotate_half`` convention (Llama, Mistral, Qwen2,
GPT-NeoX with partial rotary) is supported; other models are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.errors import ConfigError

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
        freqs = pos.to(device).float()[..., None] * self.inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Apply RoPE. ``x`` ``(..., D)``; ``pos`` broadcastable to ``x.shape[:-1]``."""
        return self._turn(x, pos, sign=1.0)

    def unrotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`rotate` (exact up to rounding; divides out the attention scaling)."""
        return self._turn(x, pos, sign=-1.0)

    def _turn(self, x: torch.Tensor, pos: torch.Tensor, sign: float) -> torch.Tensor:
        cos, sin = self._cos_sin(pos, x.device)
        r = self.rot_dim
        xr, rest = x[..., :r].float(), x[..., r:]
        half = xr.shape[-1] // 2
        turned = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        out = xr * cos + sign * turned * sin
        if sign < 0:
            out = out / (self.scaling**2)
        return torch.cat((out.to(x.dtype), rest), dim=-1)
