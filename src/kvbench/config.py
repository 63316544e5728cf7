"""Structured schema for the top-level scalars, and validation of a whole cell before any model loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from kvbench import models
from kvbench.errors import ConfigError
from kvbench.eval import protocol
from kvbench.kernels import dispatch
from kvbench.stack import Stack, build_stack


@dataclass
class Schema:
    """Types of the top-level keys: ``seed=abc`` or a misspelled key fails at composition.

    Types only: every value, and so every default, is ``conf/config.yaml``'s.
    """

    model: Any = MISSING
    dataset: Any = MISSING
    router: Any = MISSING
    compressor: Any = MISSING
    scheduler: Any = MISSING
    logger: Any = MISSING
    launcher: Any = MISSING
    name: str = MISSING
    results_dir: str = MISSING
    force: bool = MISSING
    retry_failed: bool = MISSING
    timeout_s: float | None = MISSING
    device: str = MISSING
    kernels: str = MISSING
    seed: int = MISSING
    threads: int | None = MISSING
    budget: float = MISSING
    budget_tokens: int | None = MISSING
    sinks: int = MISSING
    window: int = MISSING


def register() -> None:
    """Registers the schema that ``config.yaml`` extends (the entry point registers the plugins)."""
    ConfigStore.instance().store(name="schema", node=Schema)


def validate_protocol(cfg: DictConfig, order: int) -> None:
    """``dataset.task`` names a protocol, which checks its own keys; ``dataset.batch_size`` >= 1."""
    batch_size = cfg.dataset.get("batch_size", 1)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"dataset.batch_size={batch_size!r}: must be an integer >= 1")
    protocol.get(cfg.dataset.task).validate(cfg, order)


def validate(cfg: DictConfig) -> Stack:
    """Every check that needs no model: the stack, the protocol, the data source, the model source."""
    if cfg.name.strip() == "" or "/" in cfg.name:
        raise ConfigError(f"name={cfg.name!r}: must be a non-empty name without '/'")
    stack = build_stack(cfg)
    validate_protocol(cfg, stack.order)
    models.validate(cfg.model)
    if cfg.logger is not None and cfg.logger.name not in ("none", "wandb"):
        raise ConfigError(f"logger={cfg.logger.name!r}: allowed none, wandb")
    if cfg.get("timeout_s") is not None and float(cfg.timeout_s) <= 0:
        raise ConfigError(f"timeout_s={cfg.timeout_s}: must be > 0 seconds, or null for no limit")
    check_threads(cfg.get("threads"))
    models.check_device(cfg.device, here=runs_here(cfg))
    dispatch.check(cfg.get("kernels", "auto"), str(cfg.device), here=runs_here(cfg))
    return stack


def check_threads(threads: Any) -> None:
    """``threads`` is null (the scheduler's allocation, else torch's default) or a count >= 1."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(
            f"threads={threads!r}: must be null (SLURM_CPUS_PER_TASK when set, else torch's default) "
            "or an integer >= 1"
        )


def runs_here(cfg: DictConfig) -> bool:
    """Whether the cell runs on this machine: every launcher but SLURM's, whose nodes have their own GPUs."""
    launcher = cfg.get("launcher")
    return launcher is None or launcher.get("name") != "slurm"
