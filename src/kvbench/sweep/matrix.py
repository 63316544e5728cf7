"""The technique matrix: single, double and triple stacks, exact combinations, presets, a baseline.

A PiKV-style matrix is not a cartesian product. It is every technique alone, chosen pairs and
triples of roles, a few named system variants and the full cache once. :func:`expand` turns a
:class:`MatrixSpec` into stack cells, each a set of Hydra overrides that names all three roles
(a role a cell leaves out is ``none``). Everything here is pure: no config composition, no model.

A stack entry is written ``router/eplb + compressor/chain[chunkkv,svd]`` (roles qualified, as
docs/methods.md asks, since ``pikv`` and ``random`` exist in two roles), or as a mapping of overrides
``{router: eplb, compressor: quantized, compressor.bits: 2}``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from kvbench.errors import ConfigError

ROLES = ("router", "compressor", "scheduler")
SECTIONS = ("baseline", "floor", "single", "double", "triple", "variant")
ORDER_SECTION = {1: "single", 2: "double", 3: "triple"}
# Keys of an experiment preset that are not part of its stack (where records go, how it sweeps).
_PRESET_SKIP = ("defaults", "name", "hydra")
_CHAIN = re.compile(r"^chain\[(.*)\]$")


@dataclass(frozen=True)
class StackCell:
    """One stack of the matrix: its overrides (all three roles named) and where the report shows it."""

    section: str
    label: str
    overrides: tuple[str, ...]

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(sorted(self.overrides))


@dataclass
class MatrixSpec:
    """What to expand. ``order`` empty and no lists: the plain product of the role options."""

    order: list[int] = field(default_factory=list)
    options: dict[str, list[str]] = field(default_factory=dict)
    pairs: list[Any] | None = None
    triples: list[Any] | None = None
    floor: list[Any] | None = None  # sanity-floor stacks (random selection, several seeds)
    variants: list[str] = field(default_factory=list)
    baseline: bool = True

    @property
    def is_matrix(self) -> bool:
        return bool(self.order or self.pairs or self.triples or self.floor or self.variants)


def _plain(value: Any) -> Any:
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def parse_order(value: Any) -> list[int]:
    """``order`` as a sorted list: ``2``, ``[1, 3]`` or ``"1,2,3"``; each of 1, 2, 3."""
    value = _plain(value)
    if value is None or value == []:
        return []
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
    try:
        orders = sorted({int(str(v).strip()) for v in items})
    except ValueError:
        orders = []
    if not orders or any(o not in ORDER_SECTION for o in orders):
        raise ConfigError(f"hydra.sweeper.order={value!r}: allowed any of 1, 2, 3 (a number or a list)")
    return orders


def format_value(value: Any) -> str:
    """A Python value in Hydra's override syntax (lists and dicts recursively, strings quoted if needed)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    text = str(value)
    if isinstance(value, str) and (text == "" or re.search(r"[\s,\[\]{}:='\"()\\]", text)):
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return text


def _flatten(node: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def _role_choice(role: str, name: str, where: str) -> list[str]:
    """Overrides choosing ``name`` for ``role``; ``chain[a,b]`` becomes a chain with those stages."""
    name = name.strip()
    chain = _CHAIN.match(name)
    if chain:
        return [f"{role}=chain", f"{role}.stages=[{chain.group(1)}]"]
    if not name or "[" in name or "=" in name:
        raise ConfigError(f"{where}: {role}/{name!r} is not a technique name (e.g. {role}/h2o or chain[a,b])")
    return [f"{role}={name}"]


def parse_entry(entry: Any, where: str) -> tuple[list[str], str]:
    """One stack entry as (overrides naming all three roles, a label).

    Args:
        entry: ``"router/eplb + scheduler/duo_attention"`` or a mapping of overrides.
        where: The config key it came from, for errors (e.g. ``hydra.sweeper.pairs[3]``).

    Raises:
        ConfigError: An unknown role, a role named twice, or not a string or mapping.
    """
    entry = _plain(entry)
    chosen: dict[str, list[str]] = {}
    extra: list[str] = []
    if isinstance(entry, str):
        for part in (p.strip() for p in entry.split("+")):
            role, slash, name = part.partition("/")
            if not slash or role not in ROLES:
                raise ConfigError(
                    f"{where}={entry!r}: {part!r} must be role/name with role one of {', '.join(ROLES)}"
                )
            if role in chosen:
                raise ConfigError(f"{where}={entry!r}: {role} is named twice")
            chosen[role] = _role_choice(role, name, where)
    elif isinstance(entry, Mapping):
        for key, value in entry.items():
            key = str(key)
            if key in ROLES:
                chosen[key] = _role_choice(key, str(value), where)
            else:
                extra.append(f"{key}={format_value(value)}")
    else:
        raise ConfigError(f"{where}={entry!r}: must be 'role/name + role/name' or a mapping of overrides")
    overrides = [o for role in ROLES for o in chosen.get(role, [f"{role}=none"])] + extra
    return overrides, stack_label(overrides)


def stack_label(overrides: Sequence[str]) -> str:
    """``router/eplb + compressor/chain[chunkkv,svd]`` from a cell's overrides (roles set to none omitted)."""
    choice = {k: v for k, _, v in (o.partition("=") for o in overrides)}
    parts = []
    for role in ROLES:
        name = choice.get(role, "none")
        if name == "none":
            continue
        if name == "chain":
            name = f"chain{choice.get(f'{role}.stages', '[]')}"
        parts.append(f"{role}/{name}")
    knobs = [
        o
        for o in overrides
        if o.partition("=")[0] not in ROLES and not o.partition("=")[0].endswith(".stages")
    ]
    label = " + ".join(parts) or "full cache"
    return f"{label} ({', '.join(knobs)})" if knobs else label


def preset_overrides(name: str, conf_dir: Path) -> list[str]:
    """An experiment preset's stack as overrides: its role choices and its other keys, dotted.

    Its ``name`` (where records go) and ``hydra`` node are left out: in a matrix, the cell
    belongs to the matrix's experiment.

    Raises:
        ConfigError: No such preset (listing those that exist).
    """
    path = conf_dir / "experiment" / f"{name}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in (conf_dir / "experiment").glob("*.yaml"))
        raise ConfigError(f"hydra.sweeper.variants: {name!r} is not a preset; allowed: {', '.join(options)}")
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(node, dict)
    chosen: dict[str, str] = {}
    for item in node.get("defaults") or []:
        if isinstance(item, dict):
            for key, value in item.items():
                group = str(key).removeprefix("override").strip().lstrip("/")
                if group in ROLES:
                    chosen[group] = str(value)
    overrides = [f"{role}={chosen.get(role, 'none')}" for role in ROLES]
    body = {k: v for k, v in node.items() if k not in _PRESET_SKIP}
    return overrides + [f"{key}={format_value(value)}" for key, value in _flatten(body, "")]


def _combos(spec: MatrixSpec, order: int) -> list[list[str]]:
    """Every stack of ``order`` roles from the option lists (``none`` options ignored)."""
    opts = {role: [o for o in spec.options.get(role, []) if o != "none"] for role in ROLES}
    out = []
    for roles in itertools.combinations(ROLES, order):
        for names in itertools.product(*(opts[r] for r in roles)):
            pick = dict(zip(roles, names))
            out.append([o for role in ROLES for o in _role_choice(role, pick.get(role, "none"), "order")])
    return out


def expand(spec: MatrixSpec, conf_dir: Path) -> list[StackCell]:
    """The matrix's stack cells in report order: baseline, floor, singles, doubles, triples, variants.

    Exact duplicates (same overrides) are kept once, at their first place; the sweeper later
    merges cells that differ in spelling but not in identity (same cell id).
    """
    cells: list[StackCell] = []
    if not spec.is_matrix:
        return cells
    if spec.baseline:
        cells.append(StackCell("baseline", "full cache", tuple(f"{r}=none" for r in ROLES)))
    for i, entry in enumerate(spec.floor or []):
        overrides, label = parse_entry(entry, f"hydra.sweeper.floor[{i}]")
        cells.append(StackCell("floor", label, tuple(overrides)))
    exact = {2: spec.pairs, 3: spec.triples}
    for order in (1, 2, 3):
        section = ORDER_SECTION[order]
        given = exact.get(order)
        if given is not None:
            key = "pairs" if order == 2 else "triples"
            for i, entry in enumerate(given):
                overrides, label = parse_entry(entry, f"hydra.sweeper.{key}[{i}]")
                cells.append(StackCell(section, label, tuple(overrides)))
        elif order in spec.order:
            cells += [StackCell(section, stack_label(c), tuple(c)) for c in _combos(spec, order)]
    for name in spec.variants:
        cells.append(StackCell("variant", name, tuple(preset_overrides(name, conf_dir))))
    seen: set[tuple[tuple[str, ...], str]] = set()
    unique = []
    for cell in cells:
        if (cell.key, cell.section) not in seen:
            seen.add((cell.key, cell.section))
            unique.append(cell)
    return unique


def full_counts(options: Mapping[str, Sequence[str]]) -> dict[int, int]:
    """Cells of the full order-1/2/3 expansions of ``options`` (before legality checks)."""
    sizes = [len([o for o in options.get(r, []) if o != "none"]) for r in ROLES]
    return {k: sum(math.prod(c) for c in itertools.combinations(sizes, k)) for k in ORDER_SECTION}
