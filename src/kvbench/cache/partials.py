"""A decode step attended part by part: each segment of a layer gives its softmax state over its
own tokens (:meth:`Segment.attend_partials`), and the states merge by log-sum-exp. On the Triton
path the states come from kernels (:mod:`kvbench.kernels.attention`); here is the torch path's
(:class:`Partial`), for segments whose encoded form saves work over decoding it (latent or
factored values, expanded once after the sum instead of token by token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.cache.attention import _logits

# A segment attended through its own :class:`Partial` on the torch path saves the expansion of its
# values, but costs a dozen small operations more than SDPA over the decoded rows: on the CPU it
# pays from about a thousand tokens per head-row (one layer's step at SmolLM2's shapes: 450 us
# decoded against 560 us at 512 tokens, 2.9 ms against 1.7 ms at 2048).
PARTIAL_MIN_SLOTS = 1024


@dataclass
class Partial:
    """One decode step's softmax state over some of a layer's slots, on the torch path (the Triton
    path has its own, :class:`kvbench.kernels.attention.Partials`): per KV head's query group, the
    largest logit ``m`` ``(B, H, g, q)`` (-inf: nothing read), the sum ``l`` of ``exp(logit - m)``
    and the unnormalized output ``acc`` ``(B, H, g, q, D)``, float32."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741
    acc: torch.Tensor


def partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    basis: torch.Tensor | None = None,
) -> Partial:
    """:class:`Partial` of ``query`` ``(B, Hq, q, D)`` over keys ``(B, H, T, D)`` and values
    ``(B, H, T, Dv)``, the slots where ``valid`` ``(B, H, T)`` holds (None: all).

    ``basis``: the values are latents, on per-head bases ``(H, D, Dv)`` or on per-block bases
    ``(B, H, M, D, Dv)`` (each of a head-row's ``M`` blocks of ``T / M`` consecutive slots its own);
    the output is summed in latent space and expanded once per basis, ``(p·latents)·basisᵀ``,
    instead of expanding every value."""
    logits = _logits(query, key, scaling)  # (B, H, g, q, T)
    if valid is not None:
        logits.masked_fill_(~valid[:, :, None, None, :], float("-inf"))
    m = logits.amax(-1, keepdim=True)
    p = logits.sub_(m.masked_fill(m == float("-inf"), 0.0)).exp_()  # a row that read nothing: zeros
    value = value.float()
    if basis is None:
        acc = torch.einsum("bhgqt,bhtd->bhgqd", p, value)
    elif basis.dim() == 3:
        acc = torch.einsum("bhgqr,hdr->bhgqd", torch.einsum("bhgqt,bhtr->bhgqr", p, value), basis.float())
    else:
        blocks = basis.shape[2]
        lat = torch.einsum(
            "bhgqmn,bhmnr->bhgqmr", p.unflatten(-1, (blocks, -1)), value.unflatten(2, (blocks, -1))
        )
        acc = torch.einsum("bhgqmr,bhmdr->bhgqd", lat, basis.float())
    return Partial(m.squeeze(-1), p.sum(-1), acc)


def merge(parts: list[Partial], query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The attention output ``(B, Hq, q, D)`` (the query's dtype) from the :class:`Partial` of each
    part of a layer's slots, merged by their log-sum-exp: ``Σ e^(m_i - M) acc_i / Σ e^(m_i - M) l_i``.
    A query that read nothing gets zeros, as SDPA gives. (``kv_heads``: as the Triton path's
    :func:`kvbench.kernels.attention.merge`, whose partials are not grouped by head; here they are.)

    One part (a layer of one segment whose head-rows hold different numbers of tokens) is its own
    sum divided: its weight ``e^(m - M)`` is exactly 1 where it read something and its sums are
    zeros where it read nothing, so the merge's products leave every bit as it is."""
    if len(parts) == 1:
        total, acc = parts[0].l, parts[0].acc
        return (acc / total.masked_fill(total == 0, 1.0)[..., None]).flatten(1, 2).to(query.dtype)
    top = torch.stack([p.m for p in parts]).amax(0)
    top = top.masked_fill(top == float("-inf"), 0.0)
    weight = torch.exp(parts[0].m - top)
    total, acc = weight * parts[0].l, weight[..., None] * parts[0].acc
    for p in parts[1:]:
        weight = torch.exp(p.m - top)
        total, acc = total + weight * p.l, acc + weight[..., None] * p.acc
    out = acc / total.masked_fill(total == 0, 1.0)[..., None]  # (B, H, g, q, D)
    return out.flatten(1, 2).to(query.dtype)


def gather(segments: list[Any], query: torch.Tensor, scaling: float, batch: int) -> list[Any] | None:
    """Every segment's :meth:`Segment.attend_partials`, in order, or None as soon as one has none
    (the full-precision rows, always able, come last in a store's segments: asked after the rest)."""
    parts = []
    for seg in segments:
        part = seg.attend_partials(query, scaling, batch)
        if part is None:
            return None
        parts.append(part)
    return parts
