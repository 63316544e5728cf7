"""A stack: one router, one compressor (or a chain of them) and one scheduler, any may be absent;
its legality; and building it from a resolved config. The stack is the only composer of
techniques."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from kvbench.cache.surface import TechniqueStore
from kvbench.errors import ConfigError, IllegalStack
from kvbench.paths import CONF_DIR
from kvbench.roles import BindContext, Budget, Compressor, Router, Scheduler, Technique

ROLES = ("router", "compressor", "scheduler")


@dataclass
class Stack:
    """The techniques applied to one cache, in docs/methods.md's order within a step.

    ``compressor`` may be a list: a chain of compressor stages applied in order
    (``compressor=chain compressor.stages=[chunkkv,svd]``); the stack holds the stages itself.
    """

    router: Router | None = None
    compressor: Compressor | list[Compressor] | None = None
    scheduler: Scheduler | None = None
    budget: Budget = field(default_factory=Budget.keep_all)

    def __post_init__(self) -> None:
        self.resolved_stages: list[dict[str, Any]] = []  # a chain built from a config: its stages' nodes
        comp = self.compressor
        self.chained = isinstance(comp, list)
        self.compressors: list[Compressor] = (
            list(comp) if isinstance(comp, list) else [c for c in [comp] if c]
        )
        if self.chained and not self.compressors:
            raise ConfigError("compressor.stages=[]: a chain needs at least one stage, e.g. [chunkkv,svd]")
        check_legal(self.pipeline)

    @property
    def pipeline(self) -> list[Technique]:
        """Every acting technique in application order (a chain's stages one by one)."""
        parts: list[Technique | None] = [self.router, *self.compressors, self.scheduler]
        return [t for t in parts if t is not None]

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
        return next((t for t in self.pipeline if t.flags.places_tiers), None)

    @property
    def order(self) -> int:
        """Roles filled: 1, 2 or 3 (a chain fills one)."""
        return sum(x is not None for x in (self.router, self.compressors or None, self.scheduler))

    def bind(self, ctx: BindContext | int) -> BindContext:
        """Bind every technique; the n-th token selection gets ``budget ** n`` (docs/methods.md).

        ``ctx`` may be a bare layer count (no model: techniques that need one refuse).
        """
        if isinstance(ctx, int):
            ctx = BindContext(num_layers=ctx)
        ctx = replace(ctx, budget=self.budget)
        depth = 0
        for part in self.pipeline:
            depth += part.flags.evicts_tokens
            part.bind(replace(ctx, budget=self.budget.scaled(depth)) if part.flags.evicts_tokens else ctx)
        self.ctx = ctx
        return ctx

    def apply(self, layer: int, store: TechniqueStore) -> None:
        """After a forward chunk: the compressors, then the scheduler's eviction, then router writes."""
        for comp in self.compressors:
            comp.compress(layer, store)
        if self.scheduler is not None:
            self.scheduler.evict(layer, store)
        if self.router is not None:
            self.router.write(layer, store)

    def names(self) -> dict[str, str]:
        comp = ",".join(c.name for c in self.compressors)
        return {
            "router": self.router.name if self.router else "none",
            "compressor": f"chain[{comp}]" if self.chained else (comp or "none"),
            "scheduler": self.scheduler.name if self.scheduler else "none",
        }

    def metrics(self) -> dict[str, Any]:
        return {f"{t.role}/{t.name}": t.metrics() for t in self.pipeline if t.metrics()}

    def settle(self) -> None:
        """:meth:`Technique.settle` of every technique: between chunks, outside the timed region."""
        for t in self.pipeline:
            t.settle()

    def calibrations(self) -> list[dict[str, Any]]:
        """Records of the calibration artifacts the bound techniques used."""
        ctx = getattr(self, "ctx", None)
        return list(ctx.calibrations) if ctx is not None else []


def check_legal(parts: list[Technique]) -> None:
    """Refuse combinations the capability flags make meaningless, with the reason."""
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


def chain_stages(stages: list[Any] | Any) -> tuple[list[Compressor], list[dict[str, Any]]]:
    """The compressors of a chain and their resolved nodes, stage by stage.

    Each stage is a compressor name, resolved by Hydra's composition of ``compressor=<name>``, or
    a mapping ``{name: svd, key_rank: 16}`` whose other keys override that composition. (Hydra's
    own list syntax would merge the YAMLs into one, silently.)
    """
    raw = list(stages)
    if not raw:
        raise ConfigError("compressor.stages=[]: a chain needs at least one stage, e.g. [chunkkv,svd]")
    allowed = sorted(
        p.stem for p in (CONF_DIR / "compressor").glob("*.yaml") if p.stem not in ("chain", "none")
    )
    techs: list[Compressor] = []
    resolved: list[dict[str, Any]] = []
    for i, stage in enumerate(raw):
        if isinstance(stage, str):
            name, overrides = stage, {}
        elif isinstance(stage, (dict, DictConfig)):
            given = OmegaConf.create(stage) if isinstance(stage, dict) else stage
            overrides = dict(OmegaConf.to_container(given))  # type: ignore[arg-type]
            name = overrides.pop("name", None)
        else:
            raise ConfigError(
                f"compressor.stages[{i}]={stage!r}: must be a compressor name or a mapping with 'name'"
            )
        if name not in allowed:
            raise ConfigError(f"compressor.stages[{i}]={name!r}: allowed {', '.join(allowed)}")
        node = _composed_compressor(str(name))
        for key in overrides:
            if key not in node:
                knobs = ", ".join(str(k) for k in node if k != "_target_")
                raise ConfigError(f"compressor.stages[{i}].{key}: {name} has no such knob (knobs: {knobs})")
        merged = OmegaConf.merge(node, overrides)
        assert isinstance(merged, DictConfig)
        try:
            tech = build_technique(merged, "compressor")
        except ConfigError as err:
            raise ConfigError(str(err).replace("compressor.", f"compressor.stages[{i}].", 1)) from err
        assert isinstance(tech, Compressor)
        techs.append(tech)
        resolved.append(OmegaConf.to_container(merged, resolve=True))  # type: ignore[arg-type]
    check_legal(list(techs))
    return techs, resolved


def _composed_compressor(name: str) -> DictConfig:
    """``compressor=<name>`` as Hydra composes it (inside a Hydra app, or from kvbench's configs)."""
    if GlobalHydra.instance().is_initialized():
        return compose(config_name=f"compressor/{name}").compressor
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose(config_name=f"compressor/{name}").compressor


def chain(*stages: Any) -> list[Compressor]:
    """A chain of compressor stages for :class:`Stack` (names or ``{name: ..., knob: ...}``)."""
    return chain_stages(list(stages))[0]


def build_stack(cfg: DictConfig) -> Stack:
    """Build and validate the stack of a resolved config (no model needed)."""
    parts: dict[str, Any] = {}
    for role in ROLES:
        node = cfg.get(role)
        if role == "compressor" and node is not None and "stages" in node:
            parts[role], resolved = chain_stages(node.stages)
        else:
            parts[role] = build_technique(node, role)
    stack = Stack(**parts, budget=Budget.from_config(cfg))
    if stack.chained:
        stack.resolved_stages = resolved
    return stack


def _versioned(knobs: dict[str, Any], tech: Any) -> dict[str, Any]:
    """A technique's knobs with its :attr:`Technique.version` once bumped past 1 (version 1 is left
    out, so the ids of cells computed before versions existed do not move)."""
    version = getattr(tech, "version", 1)
    return knobs if version == 1 else {**knobs, "version": version}


def stack_identity(cfg: DictConfig, stack: Stack) -> dict[str, Any]:
    """What of the stack can change a number: each technique's resolved knobs and version, and the
    budget if used."""
    ident: dict[str, Any] = {}
    for role in ROLES:
        node = cfg.get(role)
        ident[role] = OmegaConf.to_container(node, resolve=True) if node is not None else None
        if role == "compressor" and stack.chained:
            ident[role]["stages"] = [
                _versioned(stage, tech) for stage, tech in zip(stack.resolved_stages, stack.compressors)
            ]  # a chain: its stages' full knobs
        elif ident[role] is not None:
            ident[role] = _versioned(ident[role], getattr(stack, role))
    if stack.order:
        ident["budget"] = {k: cfg[k] for k in ("budget", "budget_tokens", "sinks", "window")}
    return ident
