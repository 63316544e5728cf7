"""The device key of what a process keeps between calls and layers (memos of angles, of constant
index tensors): only layers on one device share such a tensor, so no layer reads one made on
another device (across GPUs, ``device_map="auto"``, that read would fail)."""

from __future__ import annotations

import torch


def device_of(t: torch.Tensor) -> object:
    """The key of ``t``'s device for a memo shared between layers (tests split one CPU into fake
    devices by replacing it, as :meth:`kvbench.cache.store.LayerStore.position_key` names the device
    for the same reason)."""
    return t.device
