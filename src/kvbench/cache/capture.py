"""The calibration attention: plain causal attention through which calibration sees keys, values and
attention probabilities, and mixes in DuoAttention's streaming heads.

It is registered with transformers as ``attn_implementation="kvbench_calib"`` and switched on only
for the duration of :func:`capturing`; the model always goes back to ``"kvbench"``. It runs the full
sequence in one forward with no cache (``use_cache=False``, explicit ``position_ids``), so it sees
exactly what the model computes: rotated queries ``(B, Hq, T, D)`` and rotated keys and values
``(B, Hkv, T, D)``, whatever the model's module attribute names are (GPT-NeoX has no ``k_proj``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvbench.cache import engine

CALIB_NAME = "kvbench_calib"
_CAPTURE: contextvars.ContextVar[Capture | None] = contextvars.ContextVar("kvbench_calib", default=None)


@dataclass
class Capture:
    """What the calibration attention does besides attending, for one forward.

    Attributes:
        on_kv: called as ``on_kv(layer, key, value)`` with the rotated keys and the values,
            ``(B, Hkv, T, D)`` each.
        on_probs: called as ``on_probs(layer, probs)`` with the causal attention probabilities
            ``(B, Hq, T, T)`` (float32); asking for them computes attention explicitly.
        gates: ``(L, Hkv)`` DuoAttention gates: each KV head's output (all its query heads) becomes
            ``g * full + (1 - g) * streaming`` with ``g`` clamped to [0, 1]; None for full attention.
        sinks, window: the streaming pattern (first ``sinks`` tokens and the last ``window`` ones,
            the current token included) mixed in by ``gates``.
    """

    on_kv: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
    on_probs: Callable[[int, torch.Tensor], None] | None = None
    gates: torch.Tensor | None = None
    sinks: int = 4
    window: int = 32


def register() -> None:
    """Register the calibration attention with transformers (idempotent)."""
    AttentionInterface.register(CALIB_NAME, calibration_attention)


@contextlib.contextmanager
def capturing(lm, capture: Capture) -> Iterator[None]:
    """Run ``lm``'s attention through ``capture`` inside the block; ``"kvbench"`` again afterwards."""
    register()
    token = _CAPTURE.set(capture)
    try:
        lm.model.set_attn_implementation(CALIB_NAME)
        yield
    finally:
        lm.model.set_attn_implementation(engine.ATTN_NAME)
        _CAPTURE.reset(token)


def run(lm, ids: Sequence[int] | torch.Tensor, capture: Capture) -> torch.Tensor:
    """One forward of ``ids`` through ``lm``'s decoder with the calibration attention.

    Args:
        lm: a :class:`kvbench.models.LoadedModel`.
        ids: token ids ``(T,)`` or ``(B, T)`` (no padding).
        capture: what to observe or mix.

    Returns:
        The decoder's final hidden states ``(B, T, hidden)`` (after its final norm).
    """
    x = torch.as_tensor(ids, dtype=torch.long, device=lm.device)
    x = x[None] if x.ndim == 1 else x
    pos = torch.arange(x.shape[1], device=lm.device).expand_as(x)
    with capturing(lm, capture):
        out = lm.model.get_decoder()(input_ids=x, position_ids=pos, use_cache=False)
    return out.last_hidden_state


def causal_mask(q_len: int, k_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """``(q, k)`` True where query ``i`` (the last ``q`` of ``k`` positions) reads key ``j``."""
    qpos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    kpos = torch.arange(k_len, device=device)[None]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask = mask & (kpos > qpos - sliding_window)
    return mask


def streaming_mask(q_len: int, k_len: int, sinks: int, window: int, device: torch.device) -> torch.Tensor:
    """``(q, k)`` causal StreamingLLM pattern: the first ``sinks`` keys and the last ``window``."""
    qpos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    kpos = torch.arange(k_len, device=device)[None]
    return (kpos <= qpos) & ((kpos < sinks) | (kpos > qpos - window))


def calibration_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """Attention function registered as ``attn_implementation="kvbench_calib"``.

    ``query`` ``(B, Hq, T, D)``; ``key``, ``value`` ``(B, Hkv, T, D)`` (keys rotated). The sequence is
    unpadded, so ``attention_mask`` is not read; the mask is causal (with the sliding window when the
    layer has one). Returns ``(B, T, Hq, D)`` and no weights.
    """
    cap = _CAPTURE.get()
    if cap is None:
        raise RuntimeError("kvbench_calib attention runs only inside kvbench.calibration.capturing()")
    layer = module.layer_idx
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if cap.on_kv is not None:
        cap.on_kv(layer, key, value)
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    q_len, k_len = query.shape[2], k.shape[2]
    mask = causal_mask(q_len, k_len, sliding_window, query.device)
    if cap.on_probs is not None:
        scores = (query.float() @ k.float().transpose(-1, -2)) * scaling
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        cap.on_probs(layer, probs)
        out = (probs @ v.float()).to(query.dtype)
    else:
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
    if cap.gates is not None:
        stream = mask & streaming_mask(q_len, k_len, cap.sinks, cap.window, query.device)
        out_stream = F.scaled_dot_product_attention(query, k, v, attn_mask=stream, scale=scaling)
        g = cap.gates[layer].to(query.device).clamp(0.0, 1.0).repeat_interleave(groups)
        g = g[None, :, None, None].to(out.dtype)
        out = g * out + (1.0 - g) * out_stream
    return out.transpose(1, 2).contiguous(), None
