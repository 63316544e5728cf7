"""One cell: validate -> identify -> skip if done -> load -> baseline -> evaluate -> save -> log."""

from __future__ import annotations

import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers
from omegaconf import DictConfig, OmegaConf

import kvbench
from kvbench import baseline as baselines
from kvbench import config, models, results
from kvbench.data import corpus
from kvbench.eval import measure, needle, perplexity
from kvbench.roles import BindContext
from kvbench.stack import Stack, stack_identity


def _container(node: DictConfig) -> dict[str, Any]:
    value = OmegaConf.to_container(node, resolve=True)
    assert isinstance(value, dict)
    return value  # type: ignore[return-value]


def identity(cfg: DictConfig, stack: Stack, text_sha: str) -> dict[str, Any]:
    """Everything that can change a number; leaves out logging, launcher and output paths."""
    return {
        "protocol_version": kvbench.PROTOCOL_VERSION,
        "model": models.model_identity(cfg.model),
        "dataset": {**_container(cfg.dataset), "sha256": text_sha},
        "stack": stack_identity(cfg, stack),
        "device": models.resolve_device(cfg.device).type,
        "seed": cfg.seed,
    }


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


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run one cell and return its record (or the existing record when the cell is done)."""
    stack = config.validate(cfg)  # before anything loads
    text = corpus.load_text(cfg.dataset)
    source = corpus.describe_source(cfg.dataset, text)
    ident = identity(cfg, stack, source["sha256"])
    cell_id = results.cell_hash(ident)
    path = results.record_path(Path(cfg.results_dir).resolve(), cfg.name, cell_id)
    if results.is_done(path) and not cfg.force:
        print(f"kvbench: cell {cell_id} is done ({path}); force=true redoes it", file=sys.stderr)
        return results.read_record(path) or {}
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(cfg.seed)
    record = _skeleton(cfg, stack, ident, cell_id, source)
    start = time.perf_counter()
    try:
        lm = models.load(cfg.model, cfg.device)
        record["timings"]["load_s"] = time.perf_counter() - start
        record["model"].update(lm.info)
        record["device"] = device_info(lm.device)
        _evaluate(cfg, lm, stack, text, ident, record)
    except Exception as err:
        record.update(status="failed", error=f"{type(err).__name__}: {err}")
        results.write_record(path, record)
        raise
    record["timings"]["total_s"] = time.perf_counter() - start
    results.write_record(path, record)
    return record


def _evaluate(cfg, lm, stack, text, ident, record) -> None:
    stack.bind(BindContext.for_model(lm, stack.budget, int(cfg.seed)))  # may calibrate (cached)
    base = baselines.get(cfg, lm, text, ident) if stack.order else None  # once per model x dataset
    measure.reset_peak(lm.device)
    t0 = time.perf_counter()
    if cfg.dataset.task == "perplexity":
        metrics, windows = perplexity.evaluate(
            lm, stack, lm.codec.encode(text), cfg.dataset, base, keep_logprobs=not stack.order
        )
        record["per_layer_bytes"] = windows[-1].per_layer_prefill
        record["examples"] = [
            {"window": i, "nll": float(w.nll.mean()), "chunk_nll": w.chunk_nll} for i, w in enumerate(windows)
        ]
        examples: list[Any] = windows
    else:
        metrics, cases = needle.evaluate(lm, stack, text, cfg.dataset, base)
        record["examples"] = [{k: v for k, v in c.items() if k != "tpot"} for c in cases]
        examples = cases
    if not stack.order and baselines.lookup(ident) is None:
        baselines.store(ident, examples)  # the full-cache cell is the baseline: reuse it
    metrics["peak_memory_mb"] = measure.peak_mb(lm.device)
    metrics["techniques"] = stack.metrics()
    record["metrics"] = metrics
    record["calibrations"] = stack.calibrations()
    record["timings"]["eval_s"] = time.perf_counter() - t0
    record["dataset"]["n_examples"] = metrics["n_examples"]
    record["status"] = "done"


def _skeleton(cfg, stack, ident, cell_id, source) -> dict[str, Any]:
    container = _container(cfg)
    container.pop("hydra", None)
    return {
        "kvbench_version": kvbench.__version__,
        "protocol_version": kvbench.PROTOCOL_VERSION,
        "experiment": cfg.name,
        "cell_id": cell_id,
        "status": "running",
        "error": None,
        "stack": {**stack.names(), "order": stack.order},
        "config": container,
        "identity": ident,
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
            "source": source,
        },
        "device": {"type": models.resolve_device(cfg.device).type},
        "metrics": {},
        "per_layer_bytes": [],
        "calibrations": [],
        "timings": {"load_s": None, "eval_s": None, "total_s": None},
        "versions": {
            "kvbench": kvbench.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
