"""Block scoring for the read selectors as a Triton kernel, beside its torch references
(:func:`kvbench.cache.attention.group_bounds` and :func:`~kvbench.cache.attention.group_scores`,
same signatures).

A read selector scores blocks of the cache for each query and reads the best (block-sparse
decode, :mod:`kvbench.kernels.attention`, then loads only those). Quest scores a page by the upper
bound of ``q·k`` over it, ``Σ_i max(q_i·min_i, q_i·max_i)``, the maximum over the KV head's query
group; the centroid routers score an expert by ``q·c`` summed over the group. A program takes one
KV head's query group at one query position and a block of pages or experts, reads each page's
minimum and maximum (or centroid) once for the whole group, and writes one score per block. The
top-k choice that follows stays in torch (``topk``, Quest's take-while-it-fits): it reads the scores,
a few bytes per page, not the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbench.cache import attention as att
from kvbench.kernels.attention import cdiv, pow2

group_bounds_reference = att.group_bounds
group_scores_reference = att.group_scores

BLOCK_P = 32  # pages (or experts) a program scores


@triton.jit
def _scores_kernel(
    q, lo, hi, out,
    H, G, Q, P, D,
    sq_b, sq_h, sq_q, sl_b, sl_h, sl_p, sh_b, sh_h, sh_p,
    BOUND: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # (b, KV head, query position)
    qi = row % Q
    h = (row // Q) % H
    b = row // (Q * H)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    g_ok = g < G  # BLOCK_G: the query group rounded up (at least 16, for tl.dot)
    d_ok = d < D
    p_ok = p < P  # the last block of pages runs past P
    qs = tl.load(
        q + b * sq_b + (h * G + g[:, None]) * sq_h + qi * sq_q + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    tile = p_ok[:, None] & d_ok[None, :]
    low = tl.load(lo + b * sl_b + h * sl_h + p[:, None] * sl_p + d[None, :], mask=tile, other=0.0)
    if BOUND:  # Quest: q⁺·max + q⁻·min per query head, then the group's maximum
        high = tl.load(hi + b * sh_b + h * sh_h + p[:, None] * sh_p + d[None, :], mask=tile, other=0.0)
        s = tl.dot(
            tl.maximum(qs, 0.0), tl.trans(high.to(tl.float32)), out_dtype=tl.float32, input_precision="ieee"
        )
        s += tl.dot(
            tl.minimum(qs, 0.0), tl.trans(low.to(tl.float32)), out_dtype=tl.float32, input_precision="ieee"
        )
        score = tl.max(tl.where(g_ok[:, None], s, float("-inf")), axis=0)  # rows past the group: none
    else:  # centroids: (Σ_g q_g)·c
        summed = tl.sum(qs, axis=0)  # rows past the group were loaded as zeros
        score = tl.sum(summed[None, :] * low.to(tl.float32), axis=1)
    tl.store(out + row * P + p, score, mask=p_ok)


def _launch(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor | None) -> torch.Tensor:
    b, hq, nq, d = query.shape
    h, pages = lo.shape[1], lo.shape[2]
    query, lo = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, lo))
    high = lo if hi is None else (hi if hi.stride(-1) == 1 else hi.contiguous())
    out = torch.empty(b, h, nq, pages, dtype=torch.float32, device=query.device)
    if out.numel():
        _scores_kernel[(b * h * nq, cdiv(pages, BLOCK_P))](
            query, lo, high, out, h, hq // h, nq, pages, d,
            query.stride(0), query.stride(1), query.stride(2),
            lo.stride(0), lo.stride(1), lo.stride(2), high.stride(0), high.stride(1), high.stride(2),
            BOUND=hi is not None, BLOCK_G=max(16, pow2(hq // h)),
            BLOCK_P=BLOCK_P, BLOCK_D=max(16, pow2(d)),
        )  # fmt: skip
    return out


def group_bounds(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's page bounds, the maximum over each KV head's query group: query ``(B, Hq, q, D)``,
    ``kmin``/``kmax`` ``(B, H, P, D)``; returns ``(B, H, q, P)`` fp32."""
    return _launch(query, kmin, kmax)


def group_scores(query: torch.Tensor, centroid: torch.Tensor) -> torch.Tensor:
    """The routers' expert scores, ``q·c`` summed over each KV head's query group: query
    ``(B, Hq, q, D)``, centroid ``(B, H, E, D)``; returns ``(B, H, q, E)`` fp32."""
    return _launch(query, centroid, None)
