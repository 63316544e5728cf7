"""Weighted k-means of each head-row's units, as distillation merges them (docs/methods.md): units
laid out as head-row rectangles, centroids initialized at units evenly spaced in position order,
Lloyd iterations that stop at a fixed point, distances in blocks that bound memory."""

from __future__ import annotations

import torch

from kvbench.cache import ragged

_BLOCK_ELEMS = 1 << 26  # bound on one block of unit-to-centroid distances (fp32)


def _nearest(x: torch.Tensor, c: torch.Tensor, cvalid: torch.Tensor) -> torch.Tensor:
    """Nearest valid centroid of every unit: ``x`` ``(R, n, D)``, ``c`` ``(R, M, D)`` -> ``(R, n)``."""
    r, n, _ = x.shape
    csq = c.pow(2).sum(-1)[:, None, :]  # (R, 1, M); |x|^2 is the same for every centroid
    # An invalid centroid is infinitely far: inf plus any finite product is inf, as masking gives.
    csq = csq.masked_fill(~cvalid[:, None, :], float("inf"))
    block = max(1, _BLOCK_ELEMS // max(1, r * c.shape[1]))
    out = []
    for s in range(0, n, block):
        # csq - 2·(x·c) in one pass, in place: ``-2·p`` is exact, so ``csq + (-2)·p`` is one rounding
        # of the same sum, fused or not, the float that ``p·(-2) + csq`` gives
        dist = torch.einsum("rnd,rmd->rnm", x[:, s : s + block], c)
        torch.add(csq, dist, alpha=-2, out=dist)
        out.append(dist.argmin(-1))
    return torch.cat(out, dim=1) if out else torch.zeros(r, 0, dtype=torch.long, device=x.device)


def _means(x: torch.Tensor, w: torch.Tensor, assign: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Weighted means of ``x`` ``(R, n, D)`` per centroid; empty centroids keep ``c``."""
    idx = assign[..., None].expand_as(x)
    total = torch.zeros_like(c).scatter_add_(1, idx, x * w[..., None])
    mass = torch.zeros(c.shape[:2], device=c.device).scatter_add_(1, assign, w)
    return torch.where(mass[..., None] > 0, total / mass.clamp(min=1e-30)[..., None], c)


def kmeans(
    keys: torch.Tensor,
    weight: torch.Tensor,
    pos: torch.Tensor,
    lens: torch.Tensor,
    slots: torch.Tensor,
    iters: int,
    uniform: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Weighted k-means of each head-row's units into ``slots`` ``(BH,)`` centroids.

    Args:
        keys: ``(S, D)`` flat head-major units (``lens`` ``(BH,)`` per head-row); weight, pos ``(S,)``.
        slots: centroids per head-row; initial centroids are units evenly spaced in position order.
        iters: Lloyd iterations (assign, then re-center); they stop early at a fixed point (an
            assignment that repeats), which every further iteration would return unchanged.
        uniform: ``(units, slots)`` of every head-row when all hold the same, known on the host
            (rectangles, no synchronisation; the same floats).

    Returns:
        ``(S,)`` the centroid slot of every unit (``0 <= slot < slots``), -1 where ``slots`` is 0.
    """
    valid: torch.Tensor | None = None
    if uniform is None:
        x, valid = ragged.to_padded(keys, lens)  # (R, n, D)
        w = ragged.to_padded(weight.float(), lens)[0] * valid
        key = ragged.to_padded(pos, lens, fill=torch.iinfo(pos.dtype).max)[0]
    else:
        r = lens.numel()
        x, w, key = keys.view(r, uniform[0], -1), weight.float().view(r, -1), pos.view(r, -1)
    order = key.argsort(-1)  # position order of each row's units
    slots = torch.where(lens > 0, slots, torch.zeros_like(slots))
    width = max(1, int(slots.max()) if uniform is None else uniform[1])
    j = torch.arange(width, device=keys.device)
    cvalid = j[None, :] < slots[:, None]  # (R, M)
    pick = ((j[None, :] + 0.5) * lens[:, None] / slots.clamp(min=1)[:, None]).long()
    pick = pick.clamp(max=(lens - 1).clamp(min=0)[:, None])
    first = torch.gather(order, 1, pick)  # (R, M) unit index of each initial centroid
    c = torch.gather(x, 1, first[..., None].expand(-1, -1, x.shape[-1]))
    assign = _nearest(x, c, cvalid)
    for _ in range(iters):
        c = _means(x, w, assign, c)
        after = _nearest(x, c, cvalid)
        # A repeated assignment is a fixed point: the same members give the same centroids (an
        # empty one keeps its own), so every later pass would return it again.
        if torch.equal(after, assign):
            break
        assign = after
    assign = torch.where(slots[:, None] > 0, assign, torch.full_like(assign, -1))
    return assign.reshape(-1) if valid is None else ragged.from_padded(assign, valid)
