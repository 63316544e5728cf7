"""What techniques attach to a layer's store: per-token state (:class:`TokenState`, declared by
the technique, kept by the store beside each token) and per-layer metadata that attention needs
(:class:`SideData`, counted in the layer's bytes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenState:
    """A named per-token state a technique keeps (float32, ``shape`` per token).

    Declared once at module level by the technique that owns it, and read or written only
    through the store's :meth:`LayerStore.state`, :meth:`LayerStore.add_state` and
    :meth:`LayerStore.set_state`; it follows its token through moves and evictions. A token holds
    ``fill`` until the technique sets it (a token stored since, or stored before the state was made).
    """

    name: str
    shape: tuple[int, ...] = ()
    fill: float = 0.0


class SideData:
    """Base of a technique's per-layer metadata that attention needs (page bounds, centroids,
    bases, replicas): a dataclass whose tensor fields are counted in the layer's bytes.

    A technique gets its own with ``store.side(MyData)`` (None until set) and sets it with
    ``store.set_side(MyData(...))``.
    """

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out.append(value)
        return out
