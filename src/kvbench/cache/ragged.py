"""Flat head-major tensors: the encoded form of compressed segments, and tokens in transit.

``flat`` has shape ``(N, *rest)`` where ``N = lens.sum()`` and the first ``lens[0]`` rows belong
to head-row 0 (batch 0, KV head 0), the next ``lens[1]`` to head-row 1, and so on. Encoders and
decoders that work per head (bases, blocks, clusters) lay them out as rectangles with
:func:`to_padded`; what attention reads lives in :mod:`kvbench.cache.rows`, already rectangular.
"""

from __future__ import annotations

import torch

from kvbench.cache import devices

# Count tensors ``lens`` whose common value (or None: they differ) is known on the host: told when
# made from host figures (a move of the same number from each row, an extend), or read once.
_SAME = devices.TensorMemo()


def same_count(lens: torch.Tensor) -> int | None:
    """The count every entry of ``lens`` holds, or None when they differ: from what :func:`tell`
    recorded for this tensor, else read once (two scalar reads) and remembered."""
    count = _SAME.get(lens, devices.ABSENT)
    if count is not devices.ABSENT:
        return count
    low, high = (int(x) for x in torch.aminmax(lens)) if lens.numel() else (0, 0)
    count = _SAME[lens] = high if low == high else None
    return count


def tell(lens: torch.Tensor, count: int | None) -> torch.Tensor:
    """Record that every entry of ``lens`` is ``count`` (None: not all the same); returns ``lens``."""
    _SAME[lens] = count
    return lens


def told(lens: torch.Tensor) -> int | None:
    """What :func:`tell` recorded of ``lens`` (or a read remembered), None when nothing is known."""
    return _SAME.get(lens)


def groups_of(lens: torch.Tensor, size: int) -> torch.Tensor:
    """Whole groups of ``size`` per row of ``lens`` tokens (multiples of ``size``), told what
    :func:`tell` recorded of ``lens``: one count in every row where the tokens are, as a decode
    step moves them."""
    count = told(lens)
    return tell(lens // size, None if count is None else count // size)


def slice_of(lens: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``lens[lo:hi]``, known to hold one count where ``lens`` is known to (:func:`told`)."""
    part = lens[lo:hi]
    count = told(lens)
    return part if count is None else tell(part, count)


# Host copies of count tensors' running ends (``lens.cumsum()``), read once per tensor by :func:`span`.
_ENDS = devices.TensorMemo()


def span(lens: torch.Tensor, lo: int, hi: int) -> tuple[int, int]:
    """The flat rows of head-rows ``lo .. hi - 1``: ``[start, stop)``, from the common count when
    known (:func:`same_count`), else from the running ends, read once per ``lens`` tensor."""
    count = same_count(lens)
    if count is not None:
        return lo * count, hi * count
    ends = _ENDS.get(lens)
    if ends is None:
        ends = _ENDS[lens] = [0, *lens.cumsum(0).tolist()]
    return ends[lo], ends[hi]


def valid_mask(lens: torch.Tensor, width: int) -> torch.Tensor:
    """Boolean ``(BH, width)`` mask, True for the first ``lens[i]`` slots of row ``i``."""
    return devices.arange(width, lens)[None, :] < lens[:, None]


def to_padded(flat: torch.Tensor, lens: torch.Tensor, fill: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay a flat head-major tensor out as a rectangle.

    Args:
        flat: ``(N, *rest)`` rows, head-major.
        lens: ``(BH,)`` int64 row counts per head-row, summing to N.
        fill: value of the padding slots.

    Returns:
        ``padded`` of shape ``(BH, T, *rest)`` with ``T = lens.max()``, and ``valid`` ``(BH, T)``.
    """
    bh = lens.numel()
    width = int(lens.max()) if bh else 0
    if bh and bool((lens == width).all()):
        return flat.view(bh, width, *flat.shape[1:]), torch.ones(
            bh, width, dtype=torch.bool, device=flat.device
        )
    valid = valid_mask(lens, width)
    padded = flat.new_full((bh, width, *flat.shape[1:]), fill)
    padded[valid] = flat
    return padded, valid


def from_padded(padded: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_padded`: keep the valid slots, head-major. ``(BH, T, *rest) -> (N, *rest)``."""
    if bool(valid.all()):
        return padded.reshape(-1, *padded.shape[2:])
    return padded[valid]


def concat(a: torch.Tensor, a_lens: torch.Tensor, b: torch.Tensor, b_lens: torch.Tensor) -> torch.Tensor:
    """Append ragged ``b`` after ragged ``a`` within each head-row; returns the flat result."""
    if a.shape[0] == 0:
        return b
    pa, va = to_padded(a, a_lens)
    pb, vb = to_padded(b, b_lens)
    return from_padded(torch.cat([pa, pb], dim=1), torch.cat([va, vb], dim=1))


def segment_ids(lens: torch.Tensor) -> torch.Tensor:
    """Head-row index of every flat row: ``(N,)``."""
    return torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)


def starts(lens: torch.Tensor) -> torch.Tensor:
    """Flat index of the first row of each head-row ``(BH,)``."""
    return lens.cumsum(0) - lens
