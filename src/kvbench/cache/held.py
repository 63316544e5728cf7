"""What a cache holds in memory: every tensor reachable from it, each storage counted once.

:meth:`kvbench.cache.engine.KVCache.nbytes` counts what the format stores (codes, scales, kept
tokens); this counts what the run holds for it: rows at their capacity, joined positions, keys a
view decoded and has not yet released, technique state, side data, copies and the KV-hit shadow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch


def tensors(root: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``root`` through containers and kvbench's own objects."""
    seen: set[int] = set()
    pending = [root]
    while pending:
        obj = pending.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            pending.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            pending.extend(obj)
        elif type(obj).__module__.startswith("kvbench."):
            # what the object holds, as it holds it: a field stored in another form (a packed
            # segment's buffers, :func:`kvbench.cache.segments.packed_rows`) is not read through
            # its accessor, which would convert it
            own = getattr(obj, "__dict__", {})
            fields = (
                [getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in own]
                if dataclasses.is_dataclass(obj)
                else []
            )
            pending.extend([*fields, *own.values()])


def resident_by_device(root: Any) -> dict[str, int]:
    """Bytes of the storages of every tensor reachable from ``root``, each storage once, per device."""
    storages: dict[tuple[str, int], int] = {}
    for t in tensors(root):
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
    out: dict[str, int] = {}
    for (device, _), n in storages.items():
        out[device] = out.get(device, 0) + n
    return out


def resident_bytes(root: Any) -> int:
    """Bytes of the storages of every tensor reachable from ``root``, each storage once."""
    return sum(resident_by_device(root).values())


# The largest resident and stored bytes of a cache seen per device (``"cuda:0"``, ``"cpu"``) since
# :func:`reset_peaks`: noted wherever a protocol measures its cache, read into the record's
# per-device memory (:func:`kvbench.eval.measure.memory`).
PEAKS: dict[str, dict[str, int]] = {"resident": {}, "stored": {}}


def note_peaks(resident: dict[str, int], stored: dict[str, int]) -> None:
    for kind, now in (("resident", resident), ("stored", stored)):
        peaks = PEAKS[kind]
        for device, n in now.items():
            peaks[device] = max(peaks.get(device, 0), n)


def reset_peaks() -> None:
    for peaks in PEAKS.values():
        peaks.clear()
