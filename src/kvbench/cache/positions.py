"""The positions of a step's new tokens, made once for every layer of that step.

The layers of a forward append the same chunk at the same positions, and the loop feeds the model
those positions too: :func:`step_positions` makes them (and the counts of tokens seen after them)
on the first call of a step and hands the same tensors to the others.
"""

from __future__ import annotations

from typing import Any

import torch

# key ``(device, seen before, q)`` -> ``(qpos (B, q), seen after (B,))``: one entry, outside any
# cache, read-only to its readers.
_STEP: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def step_positions(device: torch.device, seen: list[int], q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qpos, seen after)`` of ``q`` new tokens of every sequence after ``seen`` (host counts)."""
    key = (device, tuple(seen), q)
    hit = _STEP.get(key)
    if hit is None:
        if len(seen) == 1:
            qpos = torch.arange(seen[0], seen[0] + q, device=device).view(1, q)
        elif len(set(seen)) == 1:  # every sequence at one position: one arange for the batch
            qpos = torch.arange(seen[0], seen[0] + q, device=device).repeat(len(seen), 1)
        else:
            qpos = torch.tensor(seen, device=device)[:, None] + torch.arange(q, device=device)
        # the lengths after, made on the device from the last positions: an upload from a host
        # list would wait for the GPU's stream (a pageable copy)
        hit = (qpos, qpos[:, -1] + 1 if q else torch.tensor(seen, device=device))
        _STEP.clear()
        _STEP[key] = hit
    return hit
