"""A decode step attended part by part: each segment of a layer gives its logits over its own tokens
(:meth:`Segment.attend_partials`), in its encoded form where that saves work over decoding it, and
the parts are read as one softmax. On the Triton path the parts are softmax states from kernels,
merged by log-sum-exp (:mod:`kvbench.kernels.attention`); here is the torch path's
(:class:`Partial`), for segments whose encoded form saves work over decoding it (latent or factored
values, expanded once after the sum instead of token by token)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.cache.attention import _logits

# A segment attended through its own :class:`Partial` on the torch path saves the expansion of its
# values (a third of the bytes a step writes), but costs 3 operations more than SDPA over the
# decoded rows. It was set where the log-sum-exp merge it replaced began to pay on the CPU; read as
# one softmax, the parts take the same step time either way from 512 tokens on (docs/performance.md).
PARTIAL_MIN_SLOTS = 1024

# A row's largest logit, lowered to this where the row read nothing (-inf): ``logit - m`` is then
# -inf, whose exp is 0, and every other row keeps its largest logit, bit for bit.
_LOWEST = torch.finfo(torch.float32).min


@dataclass
class Partial:
    """One decode step's part of a layer's slots, on the torch path (the Triton path has its own,
    :class:`kvbench.kernels.attention.Partials`): per KV head's query group, the float32 logits
    ``(B, H, g, q, T)`` over the part's slots before the ``scaling`` (-inf where a slot is not read:
    the parts of a step are scaled together), and its values ``(B, H, T, Dv)``: rows of the output,
    or latents on ``basis`` (see :func:`partial`)."""

    logits: torch.Tensor
    scaling: float | None  # None: the logits are scaled already (:meth:`scaled_probs`)
    value: torch.Tensor
    basis: torch.Tensor | None = None

    def scaled_probs(self) -> torch.Tensor:
        """The part's slots' probabilities ``(B, H, g, q, T)`` float32, as one softmax over its
        logits (a query group must read some slot); the logits are scaled in place first, so
        :func:`merge` of this part alone reads them as they are."""
        if self.scaling is not None:
            self.logits.mul_(self.scaling)
            self.scaling = None
        return torch.softmax(self.logits, -1)

    def output(self, p: torch.Tensor) -> torch.Tensor:
        """``(B, H, g, q, D)`` float32: the part's values weighted by ``p`` (its slots' share of
        the probabilities, or of their unnormalized exponentials), summed; latents summed in
        latent space and expanded once per basis, ``(p·latents)·basisᵀ``."""
        value, basis = self.value.float(), self.basis
        if basis is None:
            return torch.einsum("bhgqt,bhtd->bhgqd", p, value)
        if basis.dim() == 3:
            return torch.einsum(
                "bhgqr,hdr->bhgqd", torch.einsum("bhgqt,bhtr->bhgqr", p, value), basis.float()
            )
        blocks = basis.shape[2]
        lat = torch.einsum(
            "bhgqmn,bhmnr->bhgqmr", p.unflatten(-1, (blocks, -1)), value.unflatten(2, (blocks, -1))
        )
        return torch.einsum("bhgqmr,bhmdr->bhgqd", lat, basis.float())


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
    ``(B, H, M, D, Dv)`` (each of a head-row's ``M`` blocks of ``T / M`` consecutive slots its own)."""
    logits = _logits(query, key, None)  # (B, H, g, q, T)
    if valid is not None:
        logits = torch.where(valid[:, :, None, None, :], logits, float("-inf"))
    return Partial(logits, scaling, value, basis)


def merge(parts: list[Partial], query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The attention output ``(B, Hq, q, D)`` (the query's dtype) over the slots of every part.
    (``kv_heads``: as the Triton path's :func:`kvbench.kernels.attention.merge`, whose partials are
    not grouped by head; here they are.)

    Several parts are read as one softmax over their logits side by side, each part's share of the
    probabilities summing its own values. Every head-row reads at least the step's own token (it is
    stored before the step attends), so no row of the whole is empty.

    One part (a layer of one segment whose head-rows hold different numbers of tokens) is its own
    quotient, ``Σ e^(x - m) v / Σ e^(x - m)``; a query group that reads nothing gets zeros, as SDPA
    gives (``e^(x - m)`` is 0 on every slot, and the sum, at least 1 where anything is read, is
    taken as 1)."""
    if len(parts) == 1:
        scaling = parts[0].scaling
        logits = parts[0].logits if scaling is None else parts[0].logits.mul_(scaling)  # -inf stays -inf
        p = logits.sub_(logits.amax(-1, keepdim=True).clamp_min_(_LOWEST)).exp_()
        out = parts[0].output(p) / p.sum(-1, keepdim=True).clamp_min_(1.0)
        return out.flatten(1, 2).to(query.dtype)
    scaling = parts[0].scaling
    assert scaling is not None and all(part.scaling == scaling for part in parts)
    p = torch.softmax(torch.cat([part.logits for part in parts], -1).mul_(scaling), -1)
    ends = list(itertools.accumulate(part.logits.shape[-1] for part in parts))
    out = parts[0].output(p[..., : ends[0]])
    for part, start, stop in zip(parts[1:], ends, ends[1:]):
        out.add_(part.output(p[..., start:stop]))
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
