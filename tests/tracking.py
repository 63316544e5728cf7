"""What a forward does, recorded on the CPU through torch's dispatch hooks, for tests of properties
that matter on GPUs: what it allocates (no ``q x vocabulary`` logits beyond the scored rows), and
whether a layer's work reads another layer's device (a model across GPUs)."""

from __future__ import annotations

import traceback
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary


class Allocations(TorchDispatchMode):
    """Every tensor an operator returns in fresh storage (views and in-place results aside):
    ``shapes`` ``[(shape, dtype, bytes)]`` in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.shapes.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return out

    def largest(self) -> int:
        """Bytes of the largest allocation."""
        return max((n for _, _, n in self.shapes), default=0)

    def rows_of(self, width: int) -> int:
        """The most rows any allocation of ``(..., width)`` elements held (its elements / width)."""
        return max(
            (int(torch.Size(s).numel()) // width for s, _, _ in self.shapes if s and s[-1] == width),
            default=0,
        )


class LayerDevices(TorchDispatchMode):
    """A fake placement of a model's layers on two devices, ``"a"`` (layers before ``split``) and
    ``"b"``, for a test on one CPU.

    Every tensor an operator makes while kvbench works on a layer (:meth:`at`) is tagged with that
    layer's device. Tensors made elsewhere are not: the model's own operators (it moves its hidden
    states across devices itself) and the stores' construction (each on its layer's device). An
    operator inside a layer's work that reads a tensor of the other device, a view aside, is
    recorded in ``mixed``: across GPUs it would fail. A tensor made without a device is the host's
    and goes anywhere; ``.to(device)`` and :meth:`moving` are explicit moves (on one CPU, ``.to``
    is often no operator at all).
    """

    def __init__(self, split: int) -> None:
        super().__init__()
        self.split = split
        self.tags: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.layer: int | None = None
        self.move = False
        self.mixed: list[tuple[str, int, list[str]]] = []
        self.trace, self.traces = False, []

    def device(self, layer: int) -> str:
        return "a" if layer < self.split else "b"

    @contextmanager
    def at(self, layer: int):
        before, self.layer = self.layer, layer
        try:
            yield
        finally:
            self.layer = before

    @contextmanager
    def moving(self):
        before, self.move = self.move, True
        try:
            yield
        finally:
            self.move = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        found = {self.tags[t] for t in given if t in self.tags}
        here = None if self.layer is None else self.device(self.layer)
        moves = func.__name__.startswith(("to.", "_to_copy")) and any(
            isinstance(a, torch.device) for a in tree_leaves((args, kwargs))
        )
        if here is not None and not (self.move or moves or func.is_view) and found - {here}:
            self.mixed.append((str(func), self.layer, sorted(found | {here})))
            if self.trace:  # where, for a reader chasing one
                self.traces.append("".join(traceback.format_stack(limit=14)))
        # a view keeps its base's tag; a fresh tensor takes the layer's, but a factory without a
        # device makes a host tensor, and outside a layer's work the model's own operators (it
        # moves what crosses devices) and the stores' construction (on their device) tag nothing
        bases = {t.untyped_storage().data_ptr(): self.tags.get(t) for t in given}
        fresh = None if not given and kwargs.get("device") is None else here
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                tag = bases[ptr] if ptr in bases and not (self.move or moves) else fresh
                if tag is None:
                    self.tags.pop(t, None)
                else:
                    self.tags[t] = tag
        return out


# Operators after which the host waits for the device: a scalar read (``int``, ``float``, ``bool``,
# ``.item()``), a result whose size depends on values (``nonzero``, boolean indexing, ``unique``,
# ``masked_select``, ``repeat_interleave`` without ``output_size``), and ``equal``. ``.tolist()``
# is no operator on the CPU: :class:`HostSyncs` counts its calls itself. A copy to the host
# (``.cpu()``, ``.to("cpu")``) is none on one CPU either and goes uncounted.
_SYNCS = {"item", "_local_scalar_dense", "nonzero", "nonzero_numpy", "masked_select", "equal", "is_nonzero"}
_SYNCS |= {"_unique2", "unique_dim", "unique_consecutive"}  # (``item``: under inference mode)


class HostSyncs(TorchDispatchMode):
    """Counts the operators that make the host wait for the device (``count``, and ``by_op``),
    and the calls of ``Tensor.tolist`` (``by_op["tolist"]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = {}
        self._tolist = None

    def __enter__(self):
        self._tolist = original = torch.Tensor.tolist

        def counted(t, *args, **kwargs):
            self.by_op["tolist"] = self.by_op.get("tolist", 0) + 1
            return original(t, *args, **kwargs)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    @property
    def count(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        sync = name in _SYNCS
        if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):  # tensor repeats
            sync = kwargs.get("output_size") is None
        if name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1:2])
        ):
            sync = True  # a boolean index is a nonzero inside
        if sync:
            self.by_op[name] = self.by_op.get(name, 0) + 1
        return func(*args, **kwargs)
