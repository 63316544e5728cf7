"""Attention over a kvbench cache: masked SDPA, blockwise scores, and the KV-hit probe.

Shapes: queries ``(B, Hq, q, D)``; stored keys/values ``(B, H, T, D)`` with ``Hq = H * g``;
masks ``(B, H, q, T)`` per KV head (ragged heads make one shared mask impossible).
SDPA returns no attention weights, so scores that techniques need are computed here in
query blocks that keep memory bounded at long context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Upper bound on elements of one block of attention probabilities (fp32): 2**26 = 256 MiB.
_BLOCK_ELEMS = 1 << 26


def read_mask(
    kpos: torch.Tensor, valid: torch.Tensor, qpos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Every stored past token visible, causal over the new ones, sliding window honoured.

    Args:
        kpos: ``(B, H, T)`` original positions of the stored tokens.
        valid: ``(B, H, T)`` real tokens (padding is False).
        qpos: ``(q,)`` query positions.
        sliding_window: the model's window, or None.

    Returns:
        ``(B, H, q, T)`` bool.
    """
    kp = kpos[:, :, None, :]
    qp = qpos[None, None, :, None]
    mask = valid[:, :, None, :] & (kp <= qp)
    if sliding_window is not None:
        mask = mask & (kp > qp - sliding_window)
    return mask


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Grouped-query attention with a per-KV-head boolean mask; ``mask=None`` means causal.

    Returns:
        ``(B, Hq, q, D)``.
    """
    groups = query.shape[1] // key.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=query.shape[2] > 1, scale=scaling, enable_gqa=groups > 1
        )
    if groups > 1:
        mask = mask.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=groups > 1
    )


def _logits(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """``(B, H, g, q, T)`` fp32 logits of grouped queries against per-KV-head keys."""
    b, hq, q, d = query.shape
    h = key.shape[1]
    grouped = query.view(b, h, hq // h, q, d).float()
    return torch.einsum("bhgqd,bhtd->bhgqt", grouped, key.float()) * scaling


def probs_blocks(query: torch.Tensor, key: torch.Tensor, mask_fn, scaling: float):
    """Yield ``(start, probs)`` for query blocks; ``probs`` ``(B, H, g, q_blk, T)`` fp32.

    ``mask_fn(start, stop)`` returns the ``(B, H, stop - start, T)`` read mask of that block, so a
    long prefill never materializes a full ``q x T`` mask.
    """
    b, hq, q, _ = query.shape
    t = key.shape[2]
    block = max(1, _BLOCK_ELEMS // max(1, b * hq * t))
    for start in range(0, q, block):
        stop = min(q, start + block)
        logits = _logits(query[:, :, start:stop], key, scaling)
        logits = logits.masked_fill(~mask_fn(start, stop)[:, :, None], float("-inf"))
        yield start, torch.softmax(logits, dim=-1)


def kv_hit(
    p_stack: torch.Tensor,
    stack_pos: torch.Tensor,
    p_full: torch.Tensor,
    exclude: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_u min(P_full(u), P_stack(u)) over original positions, and the same outside ``exclude``.

    Args:
        p_stack: ``(B, H, g, n, T)`` the distribution the stack used over its stored units.
        stack_pos: ``(B, H, T)`` original position of each unit (-1 for padding).
        p_full: ``(B, H, g, n, S)`` softmax over every exact key, ``S`` positions.
        exclude: ``(S,)`` True for sinks, window and the current chunk.

    Returns:
        ``hit`` and ``hit_excl`` per query head and query, ``(B, H, g, n)`` each. ``hit_excl`` is
        the share of the full-cache mass outside ``exclude`` that the stack recovers (NaN if none).
    """
    s = p_full.shape[-1]
    # Padding slots (position -1) carry zero probability under the read mask: park them on 0.
    idx = stack_pos.clamp(min=0)[:, :, None, None, :].expand_as(p_stack)
    on_pos = torch.zeros_like(p_full).scatter_add_(-1, idx, p_stack)
    overlap = torch.minimum(on_pos, p_full)
    keep = ~exclude[:s]
    mass = p_full[..., keep].sum(-1)
    hit_excl = overlap[..., keep].sum(-1) / mass
    return overlap.sum(-1), hit_excl
