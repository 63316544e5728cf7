"""A chain of compressors applied in order in the compressor slot.

``compressor=chain compressor.stages=[chunkkv,svd]``: each stage is a name resolved by kvbench
against ``conf/compressor/<name>.yaml`` (Hydra's own list syntax would merge the YAMLs into one,
silently), or a mapping ``{name: svd, key_rank: 16}`` whose other keys override that YAML.
Selections in a chain compose multiplicatively (docs/methods.md); a chain may hold one stage that
changes the representation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError
from kvbench.roles import Compressor, Flags, Technique

FORBIDDEN = ("chain", "none")


def available() -> list[str]:
    from kvbench.stack import CONF_DIR

    return sorted(p.stem for p in (CONF_DIR / "compressor").glob("*.yaml") if p.stem not in FORBIDDEN)


def resolve_stage(stage: Any, index: int) -> DictConfig:
    """The YAML node of one stage, with its overrides applied."""
    from kvbench.stack import CONF_DIR

    if isinstance(stage, str):
        name, overrides = stage, {}
    elif isinstance(stage, (dict, DictConfig)):
        given = OmegaConf.create(stage) if isinstance(stage, dict) else stage
        overrides = dict(OmegaConf.to_container(given))  # type: ignore[arg-type]
        name = overrides.pop("name", None)
    else:
        raise ConfigError(
            f"compressor.stages[{index}]={stage!r}: must be a compressor name or a mapping with 'name'"
        )
    allowed = available()
    if name not in allowed:
        raise ConfigError(f"compressor.stages[{index}]={name!r}: allowed {', '.join(allowed)}")
    node = OmegaConf.load(CONF_DIR / "compressor" / f"{name}.yaml")
    for key in overrides:
        if key not in node:
            knobs = ", ".join(str(k) for k in node if k != "_target_")
            raise ConfigError(f"compressor.stages[{index}].{key}: {name} has no such knob (knobs: {knobs})")
    return OmegaConf.merge(node, overrides)  # type: ignore[return-value]


@dataclass
class ChainCompressor(Compressor):
    """Applies ``stages`` in order after each forward chunk."""

    name: str = "chain"
    stages: list[Any] = field(default_factory=list)
    flags = Flags()

    def check_knobs(self) -> None:
        from kvbench.stack import build_technique, check_legal

        raw = list(self.stages)
        if not raw:
            raise ConfigError("compressor.stages=[]: a chain needs at least one stage, e.g. [chunkkv,svd]")
        nodes = [resolve_stage(stage, i) for i, stage in enumerate(raw)]
        self.resolved = [OmegaConf.to_container(n, resolve=True) for n in nodes]
        techs: list[Technique] = []
        for i, node in enumerate(nodes):
            try:
                tech = build_technique(node, "compressor")
            except ConfigError as err:
                raise ConfigError(str(err).replace("compressor.", f"compressor.stages[{i}].", 1)) from err
            assert tech is not None
            techs.append(tech)
        check_legal(techs)
        self.stages = techs
        self.name = "chain[" + ",".join(t.name for t in techs) + "]"
        flags = [t.flags for t in techs]
        union = {k: any(getattr(f, k) for f in flags) for k in Flags.__dataclass_fields__}
        union["lossless"] = all(f.lossless for f in flags)  # a chain is lossless only if every stage is
        self.flags = Flags(**union)  # type: ignore[misc]  # per instance: the union of its stages

    def compress(self, layer: int, store: LayerStore) -> None:
        for stage in self.stages:
            stage.compress(layer, store)  # type: ignore[attr-defined]
