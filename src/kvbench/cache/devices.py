"""The device key of what a process keeps between calls and layers (memos of angles, of constant
index tensors): only layers on one device share such a tensor, so no layer reads one made on
another device (across GPUs, ``device_map="auto"``, that read would fail)."""

from __future__ import annotations

import weakref
from typing import Any

import torch


def device_of(t: torch.Tensor) -> object:
    """The key of ``t``'s device for a memo shared between layers (tests split one CPU into fake
    devices by replacing it, as :meth:`kvbench.cache.store.LayerStore.position_key` names the device
    for the same reason)."""
    return t.device


_COUNTS: dict[tuple[Any, ...], torch.Tensor] = {}


def arange(n: int, like: torch.Tensor, dtype: torch.dtype = torch.long, step: int = 1) -> torch.Tensor:
    """``torch.arange(0, n * step, step)`` in ``dtype`` on ``like``'s device, as a slice of one tensor
    kept per device, dtype and step (grown to twice what was asked when too short): no launch per
    call. Read-only: its callers compare, index or expand it, never write into it."""
    key = (device_of(like), dtype) if step == 1 else (device_of(like), dtype, step)
    held = _COUNTS.get(key)
    if held is None or held.shape[0] < n:
        size = max(2 * n, 1024)
        with torch.inference_mode(False):  # a plain tensor, also when first asked inside a forward
            held = _COUNTS[key] = torch.arange(0, size * step, step, device=like.device, dtype=dtype)
    return held[:n]


def whole(n: int, like: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A 0-d tensor of the whole number ``n >= 0`` in ``dtype`` on ``like``'s device: an element of
    :func:`arange`'s held tensor, a view (no upload from the host, which a GPU's stream waits for,
    and no launch). Read-only. In a floating ``dtype`` exact while ``n`` is (below 2**24 in float32)."""
    held = _COUNTS.get((device_of(like), dtype))
    if held is None or held.shape[0] <= n:
        return arange(n + 1, like, dtype)[n]
    return held[n]  # the same element, without the prefix view


_TRUE: dict[tuple[object, torch.Size], torch.Tensor] = {}


def true_like(like: torch.Tensor) -> torch.Tensor:
    """A bool tensor of ``like``'s shape, all True, on its device: one 0-d True expanded, made once
    per device and shape (read-only; the few shapes of a choice's indices)."""
    key = (device_of(like), like.shape)
    held = _TRUE.get(key)
    if held is None:
        if len(_TRUE) >= 64:  # chunks of many lengths: start over rather than grow
            _TRUE.clear()
        with torch.inference_mode(False):
            held = _TRUE[key] = torch.ones((), dtype=torch.bool, device=like.device).expand(like.shape)
    return held


ABSENT = object()  # what :meth:`TensorMemo.get` gives for a tensor it holds nothing for


class TensorMemo:
    """Values remembered per tensor object, by its identity, and forgotten when it is freed: what
    :class:`torch.utils.weak.WeakTensorKeyDictionary` keeps, found by one dict lookup of ``id()``
    instead of a weak reference made, hashed and compared at each (the cache's readers ask about
    the same count tensors several times a layer and step, 5 µs each that way on a CPU)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, key: torch.Tensor, default: Any = None) -> Any:
        entry = self._entries.get(id(key))
        return default if entry is None or entry[0]() is not key else entry[1]

    def __contains__(self, key: torch.Tensor) -> bool:
        return self.get(key, ABSENT) is not ABSENT

    def __getitem__(self, key: torch.Tensor) -> Any:
        value = self.get(key, ABSENT)
        if value is ABSENT:
            raise KeyError(id(key))
        return value

    def __setitem__(self, key: torch.Tensor, value: Any) -> None:
        ident, entries = id(key), self._entries

        def forget(ref: weakref.ref, ident: int = ident) -> None:  # the tensor was freed
            if entries.get(ident, (None,))[0] is ref:
                del entries[ident]

        entries[ident] = (weakref.ref(key, forget), value)

    def __len__(self) -> int:
        return len(self._entries)
