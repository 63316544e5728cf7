"""What one decode step costs the host, for kvbench's cache and for plain transformers (issue 29).

At batch 1 a decode step on a GPU is bound by the host: one kernel launch per operation, plus the
Python around it. Both can be measured without a GPU:

- **Launches and bytes written**, counted: every aten operation that is not a view (each at least
  one launch on a GPU) and the bytes it writes (an allocation writes none), while decoding only
  (:class:`LaunchCounter`). Per
  layer per step, from the difference of two runs of ``short`` and ``long`` new tokens after the
  same prefill, so prefill and compression points before the first step cancel
  (:func:`decode_cost`). Deterministic: tests bound them per technique.
- **Host time**, on a model whose arithmetic is negligible (:data:`HOST_MODEL`: eight thin layers,
  a short context, one thread): its step costs what the host spends per operation and per line of
  Python, as a batch-1 step on a GPU does (:func:`paired_steps`: one step of each side in turn,
  each side's mean step, so that work done once in several steps counts at its amortized cost).
  Time ratios belong to the benchmark (``scripts/bench_decode.py``), not to tests. Where that
  time goes (:func:`paired_parts`): the cache's update, the attention function and the technique
  hooks after the forward, against the same parts of transformers' step.

Both sides run the same greedy loop: the next token read on the host after each step (as
``generate()`` does to test for the end of a sequence), transformers through its own
``DynamicCache`` with SDPA, kvbench through :mod:`kvbench.eval.loop` with the stack applied after
every step.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvbench.cache.engine import ATTN_NAME, KVCache
from kvbench.eval import loop
from kvbench.models import LoadedModel
from kvbench.paths import CONF_DIR
from kvbench.roles import BindContext
from kvbench.stack import ROLES, Stack, build_stack

# A random Llama with Llama-3.1-8B's attention shapes (32 query and 8 KV heads of 128): what a
# layer's decode step launches and writes depends on these, not on the hidden size or depth.
LAUNCH_MODEL: dict = {
    "name": "launch_8b_attention",
    "source": "tiny",
    "family": "llama",
    "seed": 0,
    "dtype": "float32",
    "device_map": None,
    "description": "random Llama with Llama-3.1-8B's attention shapes (step costs only)",
    "config": {
        "vocab_size": 256,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
    },
}

# A random Llama whose arithmetic is negligible: eight layers of hidden size 64, 4 query and 2 KV
# heads of 16. With one thread and a short context its step costs what the host spends.
HOST_MODEL: dict = {
    "name": "launch_bound",
    "source": "tiny",
    "family": "llama",
    "seed": 0,
    "dtype": "float32",
    "device_map": None,
    "description": "random thin Llama whose decode step is bound by the host (step costs only)",
    "config": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 8192,
    },
}

# Knobs a technique needs on these models to count what it does on a large one: FastV prunes
# after layer 2 by default, and the launch model has two layers; Quest leaves its first two layers
# dense (2 of 32 on an 8B model), which would be every layer of the launch model, so here every
# layer selects its pages.
MODEL_OVERRIDES: dict[str, tuple[str, ...]] = {
    "compressor/fastv": ("compressor.layer=1",),
    "scheduler/quest": ("scheduler.dense_layers=0",),
}

# Operations that read a device value on the host: a synchronisation on a GPU.
SYNCS = frozenset({"_local_scalar_dense", "is_nonzero", "nonzero", "nonzero_numpy", "equal", "item"})
# In-place operations that write only what their index names, not the whole tensor they return.
_INDEXED = frozenset(
    {"index_put_", "index_copy_", "index_add_", "scatter_", "scatter_add_", "scatter_reduce_"}
)
# Allocations: memory handed out uninitialized, nothing written (what is written into it later is
# counted by the operations that write it). Each still counts as an operation.
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _is_view(func, args: Sequence = (), out=None) -> bool:
    """Whether ``func`` returned a view of its input. An operation whose schema may alias its input
    (``to``, ``reshape``, ``contiguous``, ``flatten``: under inference mode they reach the counter
    whole, not as the copy they make) is a view only where its output shares the input's memory;
    a conversion or a copy is a launch."""
    if not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
        return False
    src = args[0] if args else None
    if isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out.numel():
        return out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    return True


def _nbytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def _written(name: str, args: Sequence, out) -> int:
    """Bytes an operation writes: its outputs; for an indexed in-place write, the slots it names;
    none for an allocation."""
    if name in _ALLOCATIONS:
        return 0
    if name in _INDEXED:
        target = args[0]
        if name == "index_put_":  # a bool index names its true slots (read here, on the host)
            idx = [i for i in args[1] if i is not None]
            if idx[0].dtype == torch.bool:
                slots, dims = int(idx[0].sum()), idx[0].dim()
            else:
                slots, dims = torch.broadcast_shapes(*(i.shape for i in idx)).numel(), len(idx)
            per = target.shape[dims:].numel()
            return slots * per * target.element_size()
        if name.startswith("scatter"):
            return args[2].numel() * target.element_size()
        return _nbytes(args[3])  # index_copy_ / index_add_: the source
    outs = out if isinstance(out, (tuple, list)) else [out]
    return sum(_nbytes(o) for o in outs)


class LaunchCounter(TorchDispatchMode):
    """Counts, while active and ``on``, the aten operations that are not views (each at least one
    kernel launch on a GPU), the bytes they write and the ones that read a device value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.on = True
        self.ops = 0
        self.bytes = 0
        self.syncs = 0
        self.by_op: dict[str, int] = {}

    def __enter__(self):
        # ``Tensor.tolist`` reads a device value without an aten operation: counted here
        self._tolist = torch.Tensor.tolist
        counter, tolist = self, self._tolist

        def counted_tolist(x):
            counter.syncs += counter.on
            return tolist(x)

        torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
        self._runs = _count_triton(self)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        for cls, run in self._runs:
            cls.run = run
        return super().__exit__(*exc)

    def launched(self, name: str) -> None:
        """One launch of ``name`` (a Triton kernel: no aten operation)."""
        self.ops += 1
        self.by_op[name] = self.by_op.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on and not _is_view(func, args, out):
            name = func.overloadpacket.__name__
            self.ops += 1
            self.by_op[name] = self.by_op.get(name, 0) + 1
            self.bytes += _written(name, args, out)
            self.syncs += name in SYNCS
        return out


def _count_triton(counter: LaunchCounter) -> list[tuple[type, Any]]:
    """Count each Triton kernel launch as one operation, named ``triton.<kernel>``, while the
    counter is on; what Triton's interpreter runs inside a launch (torch operations on the CPU,
    standing for the kernel's work) is not counted. Returns the patched classes and their ``run``."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    patched = []
    for cls in (InterpretedFunction, JITFunction):
        run = cls.run

        def counted_run(fn, *args, run=run, **kwargs):
            if not counter.on or kwargs.get("warmup"):
                return run(fn, *args, **kwargs)
            counter.launched(f"triton.{fn.fn.__name__}")
            counter.on = False
            try:
                return run(fn, *args, **kwargs)
            finally:
                counter.on = True

        cls.run = counted_run  # type: ignore[method-assign]
        patched.append((cls, run))
    return patched


@dataclass
class StepCost:
    """Per layer per decode step: operations launched, megabytes written, host reads."""

    ops: float
    mb: float
    syncs: float
    by_op: dict[str, float] = field(default_factory=dict)


# ``run(n, counter)``: prefill, then ``n`` decode steps with ``counter`` active around them only.
Run = Callable[[int, LaunchCounter], None]


def decode_cost(run: Run, layers: int, short: int = 4, long: int = 20) -> StepCost:
    """:class:`StepCost` of ``run``'s decode steps, by the difference of ``long`` and ``short`` steps."""
    a, b = LaunchCounter(), LaunchCounter()
    run(short, a)
    run(long, b)
    per = (long - short) * layers
    names = set(a.by_op) | set(b.by_op)
    by_op = {n: (b.by_op.get(n, 0) - a.by_op.get(n, 0)) / per for n in names}
    return StepCost(
        (b.ops - a.ops) / per,
        (b.bytes - a.bytes) / per / 1e6,
        (b.syncs - a.syncs) / per,
        {n: c for n, c in sorted(by_op.items(), key=lambda kv: -kv[1]) if c},
    )


def counted(make: Callable[[], Callable[[], None]], finish: Callable[[], object] | None = None) -> Run:
    """A :data:`Run` of the step function ``make()`` prepares (its prefill outside the count), then
    ``finish()`` inside it."""

    def run(steps: int, counter: LaunchCounter) -> None:
        step = make()
        with counter:
            for _ in range(steps):
                step()
            if finish is not None:
                finish()

    return run


def kvbench_run(lm: LoadedModel, stack: Stack, ids: list[int]) -> Run:
    """Prefill ``ids`` through kvbench's cache with ``stack`` applied, then greedy steps (a needle
    case's shape: the context compressed at the end of the prefill, then decoding).

    Each run ends with the techniques' figures (``stack.metrics()``), inside the count: what a
    technique keeps to settle later (a router's read figures) counts with the steps it came from.
    """
    return counted(lambda: kvbench_stepper(lm, stack, ids), stack.metrics)


def plain_model(lm: LoadedModel) -> Any:
    """A copy of ``lm``'s model (the same weights) attending through SDPA: plain transformers,
    without switching the model kvbench runs."""
    model = copy.deepcopy(lm.model)
    model.set_attn_implementation("sdpa")
    return model


def plain_run(lm: LoadedModel, model: Any, ids: list[int]) -> Run:
    """The same work through plain transformers (``model``: :func:`plain_model`): ``DynamicCache``,
    SDPA, the last position's logits."""
    return counted(lambda: plain_stepper(lm, model, ids))


Stepper = Callable[[], Callable[[], None]]


def paired_steps(make_a: Stepper, make_b: Stepper, steps: int, warm: int = 2) -> tuple[float, float]:
    """Mean seconds of a step of ``make_a()``'s and of ``make_b()``'s step functions, timed in
    turn, one step of each by one of the other (``steps`` each, after ``warm`` untimed each): a
    drift of the machine's speed hits both sides alike, which timing one side's steps and then the
    other's does not. The mean (each side's time over its ``steps``), not the median: work done
    once in several steps (a group leaving the window, a compaction, a chunk's eviction) is in it
    at its amortized cost, where a median would leave it out."""
    step_a, step_b = make_a(), make_b()
    for _ in range(warm):
        step_a()
        step_b()
    times_a, times_b = [], []
    for _ in range(steps):
        start = time.perf_counter()
        step_a()
        mid = time.perf_counter()
        step_b()
        times_a.append(mid - start)
        times_b.append(time.perf_counter() - mid)
    return statistics.fmean(times_a), statistics.fmean(times_b)


# The parts of a step :func:`paired_parts` times, each the host's time in one call site of both sides.
PARTS = ("update", "attention", "hooks")


@dataclass
class HostParts:
    """Mean milliseconds of a decode step and of three parts of it (:func:`paired_parts`):

    - ``update``: the cache's ``update``, which stores the step's keys and values (kvbench's
      :meth:`KVCache.update`; transformers' ``DynamicCache.update``);
    - ``attention``: the model's attention function, which reads them (kvbench's engine, with the
      read selector's routing and the observers' probabilities; transformers' SDPA);
    - ``hooks``: the stack's work after the forward (:meth:`KVCache.after_forward`: compression,
      eviction, router writes); none in transformers.

    ``rest`` is the model's own layers and the greedy loop, the same work on both sides."""

    step: float
    update: float
    attention: float
    hooks: float

    @property
    def rest(self) -> float:
        return self.step - self.update - self.attention - self.hooks


@contextmanager
def _parts_timed(spent: list[dict[str, float]]) -> Iterator[None]:
    """Add the seconds spent in each of :data:`PARTS` to ``spent[0]`` (the running side's) while
    active: the two caches' ``update`` and :meth:`KVCache.after_forward` wrapped on their classes,
    and the attention functions registered as ``"sdpa"`` and kvbench's in transformers' attention
    interface; all restored after."""

    def timed(fn: Callable, part: str) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0][part] += time.perf_counter() - start

        return call

    methods = [
        (DynamicCache, "update", "update"),
        (KVCache, "update", "update"),
        (KVCache, "after_forward", "hooks"),
    ]
    undo: list[Callable[[], None]] = []  # what was patched, each undone in reverse order
    try:
        for cls, name, part in methods:
            own = cls.__dict__.get(name)  # None: inherited
            setattr(cls, name, timed(getattr(cls, name), part))
            undo.append(
                functools.partial(delattr, cls, name)
                if own is None
                else functools.partial(setattr, cls, name, own)
            )
        for name in ("sdpa", ATTN_NAME):
            fn = ALL_ATTENTION_FUNCTIONS[name]
            AttentionInterface.register(name, timed(fn, "attention"))
            undo.append(functools.partial(AttentionInterface.register, name, fn))
        yield
    finally:
        for step in reversed(undo):
            step()


def paired_parts(make_a: Stepper, make_b: Stepper, steps: int, warm: int = 2) -> tuple[HostParts, HostParts]:
    """:class:`HostParts` of ``make_a()``'s and ``make_b()``'s step functions, ``steps`` of each
    timed in turn as :func:`paired_steps` times them (after ``warm`` untimed), whole and in their
    parts (timed around their calls: a few microseconds a call on top of the ratio's steps)."""
    step_a, step_b = make_a(), make_b()
    for _ in range(warm):
        step_a()
        step_b()
    sides = [dict.fromkeys(("step", *PARTS), 0.0) for _ in range(2)]
    running = [sides[0]]
    with _parts_timed(running):
        for _ in range(steps):
            for side, step in zip(sides, (step_a, step_b)):
                running[0] = side
                start = time.perf_counter()
                step()
                side["step"] += time.perf_counter() - start
    ms = 1e3 / steps
    a, b = (HostParts(*(side[p] * ms for p in ("step", *PARTS))) for side in sides)
    return a, b


def kvbench_stepper(lm: LoadedModel, stack: Stack, ids: list[int]) -> Callable[[], None]:
    """A prefilled kvbench cache and a function that runs one greedy step through it."""
    cache = loop.new_cache(lm, stack)
    tok = [int(loop.step(lm, cache, ids, keep=1)[-1].argmax())]

    def step() -> None:
        tok[0] = int(loop.step(lm, cache, [tok[0]])[-1].argmax())

    return step


def plain_stepper(lm: LoadedModel, model: Any, ids: list[int]) -> Callable[[], None]:
    """A prefilled ``DynamicCache`` and a function that runs one greedy step of plain transformers
    (``model``: :func:`plain_model`) through it."""
    cached = {lm.cache_arg: DynamicCache(config=model.config), "use_cache": True}
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], device=lm.device), **cached, logits_to_keep=1)
    tok = [int(out.logits[0, -1].argmax())]

    @torch.inference_mode()
    def step() -> None:
        x = torch.tensor([[tok[0]]], device=lm.device)
        tok[0] = int(model(input_ids=x, **cached).logits[0, -1].argmax())

    return step


def catalog() -> list[str]:
    """Every technique as ``role/name``: each YAML of the three roles but ``none`` and ``chain``
    (whose stages are empty by default)."""
    return [
        f"{role}/{p.stem}"
        for role in ROLES
        for p in sorted((CONF_DIR / role).glob("*.yaml"))
        if p.stem not in ("none", "chain")
    ]


def tiny_knobs(technique: str) -> list[str]:
    """Knobs sized for a tiny model (a few layers, head_dim 16), from the technique's YAML's
    ``# tiny: k=v ...`` comment line, as overrides (``role.k=v``); none where it has no such line
    (its defaults suit any model)."""
    role, name = technique.split("/", 1)
    for line in (CONF_DIR / role / f"{name}.yaml").read_text().splitlines():
        if line.startswith("# tiny:"):
            return [f"{role}.{kv}" for kv in line.removeprefix("# tiny:").split()]
    return []


def technique_config(technique: str | None, budget: float, tiny: bool = False) -> DictConfig:
    """The resolved config of a cell with ``technique`` (``role/name``; None: the full cache) alone;
    ``tiny``: with the knobs its YAML sizes for tiny models (:func:`tiny_knobs`). Needs the schema
    registered (:func:`kvbench.config.register`)."""
    over = [f"budget={budget}", "model=tiny_random", "dataset=pydoc", "device=cpu"]
    if technique is not None:
        role, name = technique.split("/", 1)
        knobs = tiny_knobs(technique) if tiny else []
        over = [f"{role}={name}", *over, *MODEL_OVERRIDES.get(technique, ()), *knobs]
    if GlobalHydra.instance().is_initialized():
        return compose("config", overrides=over)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=over)


def technique_stack(
    lm: LoadedModel, technique: str | None, budget: float = 0.5, tiny: bool = False, seed: int = 0
) -> Stack:
    """The stack of ``technique`` alone at ``budget``, bound to ``lm`` (may fit a calibration);
    ``tiny``: see :func:`technique_config`."""
    stack = build_stack(technique_config(technique, budget, tiny))
    stack.bind(BindContext.for_model(lm, seed))
    return stack


def model_config(spec: dict) -> DictConfig:
    """A model config (as ``conf/model/*.yaml``) of one of this module's specs."""
    cfg = OmegaConf.create(spec)
    assert isinstance(cfg, DictConfig)
    return cfg
