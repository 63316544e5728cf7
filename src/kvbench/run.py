"""One cell: validate -> identify -> skip if done -> load -> baseline -> evaluate -> save -> log."""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import kvbench
from kvbench import baseline as baselines
from kvbench import cellstate, config, limits, models, results
from kvbench.cache import timing
from kvbench.eval import loop, measure, protocol
from kvbench.kernels import dispatch
from kvbench.roles import BindContext
from kvbench.stack import Stack, stack_identity

_DATA: dict[str, protocol.Dataset] = {}


def _file_stamp(path: str | None) -> str:
    try:
        stat = Path(str(path)).expanduser().stat() if path else None
    except OSError:
        return ""
    return f"{stat.st_size}:{stat.st_mtime_ns}" if stat else ""


def _container(node: DictConfig) -> dict[str, Any]:
    value = OmegaConf.to_container(node, resolve=True)
    assert isinstance(value, dict)
    return value  # type: ignore[return-value]


# Keys added after cells were recorded, left out of a cell's identity at their defaults so that
# those cells keep their ids.
LATER_DEFAULTS = {"batch_size": 1, "kv_hit": True, "kv_hit_layers": None, "kv_hit_queries": 4}


def dataset_identity(ds: DictConfig, sha: str) -> dict[str, Any]:
    """The dataset config and its data's sha256; a key of :data:`LATER_DEFAULTS` only when it is
    not at its default (``batch_size`` 1, the KV-hit probe's settings)."""
    out = {**_container(ds), "sha256": sha}
    for key, default in LATER_DEFAULTS.items():
        if key in out and out[key] == default:
            del out[key]
    return out


def identity(cfg: DictConfig, stack: Stack, text_sha: str) -> dict[str, Any]:
    """Everything that can change a number; leaves out logging, launcher and output paths."""
    return {
        "protocol_version": kvbench.PROTOCOL_VERSION,
        "model": models.model_identity(cfg.model),
        "dataset": dataset_identity(cfg.dataset, text_sha),
        "stack": stack_identity(cfg, stack),
        "device": models.resolve_device(cfg.device).type,
        "seed": cfg.seed,
        # the Triton path can move numbers within float tolerance; the torch path, the one every
        # cell ran before the kernels existed, keeps their ids
        **({"kernels": kernel_identity(path)} if (path := kernel_path(cfg)) != "torch" else {}),
    }


def kernel_path(cfg: DictConfig) -> str:
    """The cache's kernels this cell runs: ``kernels`` resolved for its device (:mod:`kvbench.kernels`)."""
    return dispatch.resolve(str(cfg.get("kernels", "auto")), models.resolve_device(cfg.device))


def kernel_identity(path: str) -> str:
    """A path as a cell's identity says it, with the kernels' versions (:func:`dispatch.versions_stamp`):
    ``triton@<versions>``, or ``auto@<commit>@<versions>`` on CUDA, with the commit(s) the dispatch
    table that decides each call was measured at (:func:`dispatch.table_stamp`)."""
    if path == "auto":
        return f"auto@{dispatch.table_stamp()}@{dispatch.versions_stamp()}"
    return f"{path}@{dispatch.versions_stamp()}"


def device_info(device: torch.device) -> dict[str, Any]:
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    return {
        "type": device.type,
        "name": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }


@dataclass
class CellPlan:
    """A cell before it runs: its validated stack, its data, its identity and where its record goes."""

    stack: Stack
    data: Any
    source: dict[str, Any]
    ident: dict[str, Any]
    cell_id: str
    path: Path


@dataclass
class Outcome:
    """What running a cell did: its record, and whether it ran now (False: an existing record)."""

    record: dict[str, Any]
    ran: bool


def plan(cfg: DictConfig) -> CellPlan:
    """Validate a cell and compute its identity and record path; loads the data, never the model."""
    stack = config.validate(cfg)  # before anything loads
    ds = cfg.dataset
    unbatched = {k: v for k, v in _container(ds).items() if k != "batch_size"}
    key = json.dumps(unbatched, sort_keys=True) + _file_stamp(ds.get("path"))
    if key not in _DATA:  # a sweep plans many cells of one dataset
        _DATA.clear()
        _DATA[key] = protocol.get(ds.task).load(ds)
    data = _DATA[key]
    ident = identity(cfg, stack, data.source["sha256"])
    cell_id = results.cell_hash(ident)
    return CellPlan(
        stack,
        data.data,
        data.source,
        ident,
        cell_id,
        results.record_path(Path(cfg.results_dir).resolve(), cfg.name, cell_id),
    )


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run one cell and return its record (or the existing record when the cell is complete)."""
    return execute(cfg).record


def execute(cfg: DictConfig, cell: CellPlan | None = None) -> Outcome:
    """Run one cell in isolation: whatever goes wrong inside it becomes a ``failed`` record.

    An exception, running out of memory, a NaN or infinite metric or ``timeout_s`` (checked
    between chunks) ends the cell with status ``failed`` and a one-line reason; the caller goes on.
    A cell found started :data:`~kvbench.cellstate.MAX_STARTS` times without finishing (its
    process was killed) is recorded ``failed: killed`` instead of being tried again.
    """
    cell = cell or plan(cfg)
    existing = results.read_record(cell.path)
    status = cellstate.status(existing, cell.path)
    if not cellstate.needs_run(status, force=bool(cfg.force), retry_failed=bool(cfg.get("retry_failed"))):
        assert existing is not None
        hint = "retry_failed=true retries it" if status == "failed" else "force=true redoes it"
        print(f"kvbench: cell {cell.cell_id} is {status} ({cell.path}); {hint}", file=sys.stderr)
        return Outcome(existing, ran=False)
    if status == "failed":
        cellstate.clear(cell.path)  # a retry starts its count afresh
    threads = thread_count(cfg.threads)
    if threads:
        torch.set_num_threads(threads)
    record = _skeleton(cfg, cell.stack, cell.ident, cell.cell_id, cell.source)
    before = cellstate.begin(cell.path)
    if len(before) >= cellstate.MAX_STARTS:
        record.update(status="failed", error=cellstate.killed_reason(before), failure="killed")
        return Outcome(_finish(cell.path, record), ran=True)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    try:
        with limits.deadline(cfg.get("timeout_s")):
            lm = models.load(cfg.model, cfg.device)
            record["timings"]["load_s"] = time.perf_counter() - start
            record["model"].update(lm.info)
            record["device"] = device_info(lm.device)
            with dispatch.using(record["kernels"], record["device"]["name"]):
                _evaluate(cfg, lm, cell.stack, cell.data, cell.ident, record)
                if record["kernels"] != "torch":  # which path each kernel module took (auto: per call)
                    record["kernel_paths"] = dispatch.taken()
            _check_finite(record["metrics"])
    except Exception as err:
        kind, reason = classify(err)
        record.update(status="failed", error=reason, failure=kind, metrics={})
        _release_memory(kind)
    record["timings"]["total_s"] = time.perf_counter() - start
    return Outcome(_finish(cell.path, record), ran=True)


def _finish(path: Path, record: dict[str, Any]) -> dict[str, Any]:
    results.write_record(path, record)
    cellstate.clear(path)
    return record


def classify(err: BaseException) -> tuple[str, str]:
    """A failure's kind (``timeout``, ``nonfinite``, ``oom``, ``error``) and a one-line reason."""
    message = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, limits.CellTimeout):
        return "timeout", message
    if isinstance(err, limits.NonFiniteMetric):
        return "nonfinite", message
    lowered = message.lower()
    if isinstance(err, MemoryError | torch.OutOfMemoryError) or any(
        s in lowered for s in ("out of memory", "can't allocate memory", "cannot allocate memory")
    ):
        return "oom", f"out of memory: {type(err).__name__}: {message}"[:500]
    return "error", f"{type(err).__name__}: {message}"[:500]


def _check_finite(metrics: dict[str, Any]) -> None:
    """Raises :class:`~kvbench.limits.NonFiniteMetric` naming the first NaN or infinite metric."""
    for where, leaf in results.json_leaves(metrics, "metrics"):
        if isinstance(leaf, float) and not math.isfinite(leaf):
            raise limits.NonFiniteMetric(f"non-finite metric: {where} is {leaf!r}")


def _release_memory(kind: str) -> None:
    gc.collect()
    if kind == "oom" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _evaluate(cfg, lm, stack, data, ident, record) -> None:
    stack.bind(BindContext.for_model(lm, int(cfg.seed)))  # may calibrate (cached)
    loop.warm_up(lm)  # before the first timed pass of the process (the baseline's, if computed now)
    loop.warm_up_kernels(lm, lambda: _bound(config.validate(cfg), lm, cfg))  # its Triton kernels' first calls
    base = baselines.get(cfg, lm, data, ident) if stack.order else None  # once per model x dataset
    measure.reset_peak(lm.devices)
    t0 = time.perf_counter()
    with timing.cell() as attn:  # the decode attention of sampled steps, beside TPOT
        result = protocol.get(cfg.dataset.task).evaluate(lm, stack, data, cfg.dataset, base)
    if result.per_layer_bytes:
        record["per_layer_bytes"] = result.per_layer_bytes
    record["examples"] = result.examples
    if not stack.order and baselines.lookup(ident) is None:
        baselines.store(ident, result.baseline)  # the full-cache cell is the baseline: reuse it
    metrics = result.metrics.as_dict()
    metrics.update(attn.metrics())  # decode_attn_ms, decode_attn_steps
    metrics["peak_memory_mb"] = measure.peak_mb(lm.devices)
    metrics["memory"] = measure.memory(lm.devices, lm.weight_bytes)
    metrics["techniques"] = stack.metrics()
    record["metrics"] = metrics
    record["calibrations"] = stack.calibrations()
    record["timings"]["eval_s"] = time.perf_counter() - t0
    record["dataset"]["n_examples"] = metrics["n_examples"]
    record["status"] = "done"


def _bound(stack: Stack, lm, cfg) -> Stack:
    """``stack`` bound as a cell's (a throwaway copy for :func:`loop.warm_up_kernels`)."""
    stack.bind(BindContext.for_model(lm, int(cfg.seed)))
    return stack


def thread_count(threads: int | None) -> int | None:
    """CPU threads for torch: ``threads`` when set, else the scheduler's allocation
    (``SLURM_CPUS_PER_TASK``) when there is one, else None (torch's default: every core).

    On a shared node, torch's default oversubscribes the cores another job holds, and kvbench's many
    small per-step operations then slow down several-fold.
    """
    if threads:
        return int(threads)
    allocated = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return int(allocated) if allocated.isdigit() and int(allocated) > 0 else None


def cell_command() -> str | None:
    """The overrides that rerun this cell alone, ``python -m kvbench <them>``; None outside Hydra.

    ``results_dir`` is left out: it says where the record goes, not what it measures.
    """
    if not HydraConfig.initialized():
        return None
    task = HydraConfig.get().overrides.task
    return " ".join(shlex.quote(o) for o in task if not o.startswith("results_dir="))


def _skeleton(cfg, stack, ident, cell_id, source) -> dict[str, Any]:
    """The record before the cell runs. Each fact is written once: the versions of kvbench (top
    level) and of torch, transformers and Python (``device``, rewritten for the loaded model's
    device), the data's sha256 in ``dataset`` (and, hashed, in ``identity``)."""
    container = _container(cfg)
    container.pop("hydra", None)
    return {
        "kvbench_version": kvbench.__version__,
        "protocol_version": kvbench.PROTOCOL_VERSION,
        "experiment": cfg.name,
        "cell_id": cell_id,
        "status": "running",
        "error": None,
        "failure": None,
        "stack": {**stack.names(), "order": stack.order},
        "config": container,
        "identity": ident,
        "command": cell_command(),
        "model": {
            "name": cfg.model.name,
            "hf_id": cfg.model.get("hf_id"),
            "description": cfg.model.get("description"),
            "dtype": cfg.model.dtype,
        },
        "dataset": {
            "name": cfg.dataset.name,
            "task": cfg.dataset.task,
            "sha256": source["sha256"],
            "source": {k: v for k, v in source.items() if k != "sha256"},
        },
        "device": device_info(models.resolve_device(cfg.device)),
        "kernels": kernel_path(cfg),
        "metrics": {},
        "per_layer_bytes": [],
        "calibrations": [],
        "timings": {"load_s": None, "eval_s": None, "total_s": None},
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
