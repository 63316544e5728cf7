"""A stack: one router, one compressor and one scheduler (any may be absent), and its legality."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError, IllegalStack
from kvbench.roles import BindContext, Budget, Compressor, Router, Scheduler, Technique

ROLES = ("router", "compressor", "scheduler")
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass
class Stack:
    """The techniques applied to one cache, in docs/methods.md's order within a step."""

    router: Router | None = None
    compressor: Compressor | None = None
    scheduler: Scheduler | None = None
    budget: Budget = field(default_factory=Budget.keep_all)

    def __post_init__(self) -> None:
        check_legal(self.techniques)

    @property
    def techniques(self) -> list[Technique]:
        return [t for t in (self.router, self.compressor, self.scheduler) if t is not None]

    @property
    def pipeline(self) -> list[Technique]:
        """Every acting technique in application order, a chain's stages in place of the chain."""
        out: list[Technique] = []
        for tech in self.techniques:
            out.extend(getattr(tech, "stages", None) or [tech])
        return out

    @property
    def observers(self) -> list[Technique]:
        return [t for t in self.pipeline if t.flags.needs_attention_scores]

    @property
    def query_observers(self) -> list[Technique]:
        return [t for t in self.pipeline if t.wants_queries]

    @property
    def read_selector(self) -> Technique | None:
        """The one technique that selects reads inside attention (a router or ``quest``)."""
        return next((t for t in self.pipeline if t.flags.selects_reads), None)

    @property
    def placer(self) -> Technique | None:
        """The technique that places cache tiers and computes attention per tier (``flexgen``)."""
        return next((t for t in self.pipeline if t.flags.places_tiers and hasattr(t, "attend_tiers")), None)

    @property
    def order(self) -> int:
        return len(self.techniques)

    def bind(self, ctx: BindContext | int) -> BindContext:
        """Bind every technique; the n-th token selection gets ``budget ** n`` (docs/methods.md).

        ``ctx`` may be a bare layer count (no model: techniques that need one refuse).
        """
        if isinstance(ctx, int):
            ctx = BindContext(num_layers=ctx)
        ctx = replace(ctx, budget=self.budget)
        depth = 0
        for tech in self.techniques:
            if getattr(tech, "stages", None):
                tech.bind(ctx)
            for part in getattr(tech, "stages", None) or [tech]:
                depth += part.flags.evicts_tokens
                part.bind(replace(ctx, budget=self.budget.scaled(depth)) if part.flags.evicts_tokens else ctx)
        self.ctx = ctx
        return ctx

    def apply(self, layer: int, store: LayerStore) -> None:
        """After a forward chunk: the compressor, then the scheduler's eviction, then router writes."""
        if self.compressor is not None:
            self.compressor.compress(layer, store)
        if self.scheduler is not None:
            self.scheduler.evict(layer, store)
        if self.router is not None:
            self.router.write(layer, store)

    def names(self) -> dict[str, str]:
        return {role: (getattr(self, role).name if getattr(self, role) else "none") for role in ROLES}

    def metrics(self) -> dict[str, Any]:
        return {f"{t.role}/{t.name}": t.metrics() for t in self.pipeline if t.metrics()}

    def calibrations(self) -> list[dict[str, Any]]:
        """Records of the calibration artifacts the bound techniques used."""
        ctx = getattr(self, "ctx", None)
        return list(ctx.calibrations) if ctx is not None else []


def check_legal(techniques: list[Technique]) -> None:
    """Refuse combinations the capability flags make meaningless, with the reason."""
    parts: list[Technique] = []
    for tech in techniques:
        parts.extend(getattr(tech, "stages", None) or [tech])
    readers = [f"{t.role}/{t.name}" for t in parts if t.flags.selects_reads]
    if len(readers) > 1:
        raise IllegalStack(
            f"stack {' + '.join(readers)}: both select reads; a stack may hold one read selector"
        )
    tiers = [f"{t.role}/{t.name}" for t in parts if t.flags.places_tiers]
    if len(tiers) > 1:
        raise IllegalStack(f"stack {' + '.join(tiers)}: both place cache tiers; a stack may hold one placer")
    reps = [f"{t.role}/{t.name}" for t in parts if t.flags.changes_representation]
    if len(reps) > 1:
        raise IllegalStack(
            f"stack {' + '.join(reps)}: both change the representation of the tokens leaving the "
            "full-precision window; a stack may hold one"
        )


def build_technique(node: DictConfig | None, role: str) -> Technique | None:
    """Instantiate one technique from its YAML node; a node without ``_target_`` is ``none``."""
    if node is None or node.get("_target_") is None:
        return None
    try:
        tech = instantiate(node)
    except Exception as err:  # hydra wraps the technique's own ConfigError
        cause = err.__cause__ if isinstance(err.__cause__, ConfigError) else err
        message = str(cause) if str(cause).startswith(f"{role}.") else f"{role}={node.get('name')}: {cause}"
        raise ConfigError(message) from err
    if tech.role != role:
        raise ConfigError(f"{role}={node.get('name')}: is a {tech.role}, not a {role}")
    return tech


def build_stack(cfg: DictConfig) -> Stack:
    """Build and validate the stack of a resolved config (no model needed)."""
    parts = {role: build_technique(cfg.get(role), role) for role in ROLES}
    return Stack(**parts, budget=Budget.from_config(cfg))  # type: ignore[arg-type]


def stack_identity(cfg: DictConfig, stack: Stack) -> dict[str, Any]:
    """What of the stack can change a number: each technique's resolved knobs, and the budget if used."""
    ident: dict[str, Any] = {}
    for role in ROLES:
        node = cfg.get(role)
        ident[role] = OmegaConf.to_container(node, resolve=True) if node is not None else None
        tech = getattr(stack, role)
        if tech is not None and hasattr(tech, "resolved"):
            ident[role]["stages"] = tech.resolved  # a chain: its stages' full knobs
    if stack.order:
        ident["budget"] = {k: cfg[k] for k in ("budget", "budget_tokens", "sinks", "window")}
    return ident
