"""A sweep's plan: every cell composed, validated and identified before anything launches.

The plan expands the command line (and a preset's ``hydra.sweeper`` node) into cells, drops
illegal stacks with the catalog's reason, merges cells that are the same measurement (same cell
id), reads which cells already have a complete record, and orders the rest so that each model
loads once per worker. It writes ``<results>/<experiment>/sweep.plan``, the matrix's shape, which
the report renders; records stay the only results.
"""

from __future__ import annotations

import difflib
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbench import cellstate, results, run
from kvbench.errors import ConfigError, IllegalStack
from kvbench.sweep.matrix import ORDER_SECTION, ROLES, MatrixSpec, StackCell, expand, parse_order, stack_label

Compose = Callable[[list[str]], DictConfig]


@dataclass
class PlannedCell:
    """One cell to measure (possibly shown in several rows of the matrix)."""

    overrides: list[str]
    rows: list[dict[str, str]]
    cell_id: str
    path: Path
    experiment: str
    model: str
    dataset: str
    model_key: str
    status: str  # pending | interrupted | done | failed
    error: str | None = None

    def manifest(self) -> dict[str, Any]:
        return {
            "cell_id": self.cell_id,
            "rows": self.rows,
            "model": self.model,
            "dataset": self.dataset,
            "overrides": self.overrides,
        }


@dataclass
class Dropped:
    section: str
    label: str
    reason: str


@dataclass
class SweepPlan:
    cells: list[PlannedCell] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    merged: int = 0
    is_matrix: bool = False  # a technique matrix (its shape is written for the report), not a product

    def to_run(self, retry_failed: bool, force: bool) -> list[PlannedCell]:
        """Cells without a complete record (failed ones too with ``retry_failed``), in launch order."""
        return [
            c for c in self.cells if cellstate.needs_run(c.status, force=force, retry_failed=retry_failed)
        ]

    def counts(self) -> dict[str, int]:
        out = {"done": 0, "failed": 0, "interrupted": 0, "pending": 0}
        for cell in self.cells:
            out[cell.status] += 1
        return out


def compose_error(err: Exception, overrides: Sequence[str], conf_dir: Path) -> str:
    """One line for a composition error: an unknown option lists the allowed ones."""
    if isinstance(err, MissingConfigException):
        for ov in overrides:
            group, _, value = ov.partition("=")
            folder = conf_dir / group.lstrip("+~")
            if folder.is_dir() and not (folder / f"{value}.yaml").exists():
                options = sorted(p.stem for p in folder.glob("*.yaml"))
                close = difflib.get_close_matches(value, options, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                return f"{group}={value!r}: unknown option{hint}; allowed: {', '.join(options)}"
        return str(err).splitlines()[0]
    cause = f": {str(err.__cause__).splitlines()[0]}" if err.__cause__ else ""
    return " ".join(str(err).split()) + cause


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def spec_from(node: Any) -> MatrixSpec:
    """The matrix part of the sweeper's config node (``hydra.sweeper``)."""
    get = (lambda k: _plain(node.get(k))) if node is not None else (lambda k: None)
    return MatrixSpec(
        order=parse_order(get("order")),
        options={role: list(get(role) or []) for role in ROLES},
        pairs=get("pairs"),
        triples=get("triples"),
        floor=get("floor"),
        variants=list(get("variants") or []),
        baseline=bool(get("baseline") if get("baseline") is not None else True),
    )


def split_arguments(
    arguments: Sequence[str], spec: MatrixSpec, params: dict[str, Any] | None
) -> tuple[list[str], list[list[str]], list[str]]:
    """The command line as (fixed overrides, product dimensions, role-knob overrides).

    In a matrix, a role group given on the command line (``router=base,pikv``) replaces that
    role's option list, and a role knob (``compressor.bits=2``) applies only to the cells
    where that role is not ``none``. Elsewhere every sweep is a product dimension, as in Hydra's
    basic sweeper. ``params`` (a preset's ``hydra.sweeper.params``) adds dimensions for the keys
    the command line leaves alone.
    """
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(list(arguments))
    given = {ov.get_key_element().lstrip("+~") for ov in parsed}
    for key, value in (params or {}).items():
        if key not in given:
            parsed += parser.parse_overrides([f"{key}={value}"])
    fixed: list[str] = []
    dims: list[list[str]] = []
    knobs: list[str] = []
    for ov in parsed:
        key = ov.get_key_element()
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else None
        if spec.is_matrix and key in ROLES:
            spec.options[key] = values if values is not None else [str(ov.value())]
        elif values is not None:
            dims.append([f"{key}={v}" for v in values])
        elif spec.is_matrix and key.partition(".")[0] in ROLES:
            knobs.append(str(ov.input_line))
        else:
            fixed.append(str(ov.input_line))
    return fixed, dims, knobs


def stack_cells(spec: MatrixSpec, conf_dir: Path) -> list[StackCell]:
    """The matrix's stacks, or one empty stack (the product alone decides) outside a matrix."""
    if not spec.is_matrix:
        return [StackCell("", "", ())]
    if spec.order and not any(spec.options[r] for r in ROLES) and not (spec.pairs or spec.triples):
        raise ConfigError(
            "hydra.sweeper.order is set but no role has options: give e.g. hydra.sweeper.router=[base,pikv] "
            "or router=base,pikv"
        )
    return expand(spec, conf_dir)


def _role_knob_applies(knob: str, stack: StackCell) -> bool:
    role = knob.partition(".")[0]
    return f"{role}=none" not in stack.overrides


def _row(stack: StackCell, cfg: DictConfig, order: int, combo: list[str]) -> dict[str, str]:
    """Where the report shows a cell: its section, and a label with the swept settings it has.

    ``model`` and ``dataset`` are left out of the label: the report groups by them.
    """
    if stack.section:
        section, label = stack.section, stack.label
    else:
        section = ORDER_SECTION.get(order, "baseline")
        label = stack_label([f"{r}={(cfg.get(r) or {}).get('name', 'none')}" for r in ROLES])
    swept = [o for o in combo if o.partition("=")[0] not in ("model", "dataset", *ROLES)]
    if swept:
        stack_part, _, knobs = label.partition(" (")
        settings = [knobs.rstrip(")")] if knobs else []
        label = f"{stack_part} ({', '.join(settings + swept)})"
    return {"section": section, "label": label}


def build(
    arguments: Sequence[str],
    sweeper: Any,
    compose: Compose,
    conf_dir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> SweepPlan:
    """Expands, composes, validates and identifies every cell of a sweep.

    Args:
        arguments: The command line's overrides.
        sweeper: The ``hydra.sweeper`` node (order, role lists, pairs, triples, variants, params).
        compose: Composes one cell's config from its overrides.
        conf_dir: kvbench's config folder (presets and option lists).
        progress: Called with (composed, total) while composing, for large matrices.

    Raises:
        ConfigError: A value is invalid (not merely an illegal combination, which is dropped).
    """
    spec = spec_from(sweeper)
    params = _plain(sweeper.get("params")) if sweeper is not None else None
    fixed, dims, knobs = split_arguments(arguments, spec, params)
    stacks = stack_cells(spec, conf_dir)
    combos = [list(c) for c in itertools.product(*dims)]
    plan = SweepPlan(is_matrix=spec.is_matrix)
    by_id: dict[str, PlannedCell] = {}
    total = len(stacks) * len(combos)
    for n, (stack, combo) in enumerate(itertools.product(stacks, combos)):
        if progress:
            progress(n, total)
        overrides = fixed + list(stack.overrides) + [k for k in knobs if _role_knob_applies(k, stack)] + combo
        try:
            cfg = compose(overrides)
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(compose_error(err, overrides, conf_dir)) from err
        try:
            cell = run.plan(cfg)
        except IllegalStack as err:
            drop = Dropped(stack.section or "stack", stack.label or " ".join(overrides), str(err))
            if drop not in plan.dropped:
                plan.dropped.append(drop)
            continue
        row = _row(stack, cfg, cell.stack.order, combo)
        if cell.cell_id in by_id:
            plan.merged += 1
            if row not in by_id[cell.cell_id].rows:
                by_id[cell.cell_id].rows.append(row)
            continue
        record = results.read_record(cell.path)
        status = cellstate.status(record, cell.path)
        if status in cellstate.COMPLETE and cellstate.starts(cell.path):
            cellstate.clear(cell.path)  # killed between writing its record and removing its marker
        launch = [o for o in overrides if not o.startswith("results_dir=")]
        launch.append(f"results_dir={Path(cfg.results_dir).resolve()}")
        by_id[cell.cell_id] = PlannedCell(
            overrides=launch,
            rows=[row],
            cell_id=cell.cell_id,
            path=cell.path,
            experiment=str(cfg.name),
            model=str(cfg.model.name),
            dataset=str(cfg.dataset.name),
            model_key=json.dumps(cell.ident["model"], sort_keys=True) + str(cfg.device),
            status=status,
            error=record.get("error") if record else None,
        )
        plan.cells.append(by_id[cell.cell_id])
    # Stable: the matrix order within one model; the first model's cells first.
    first = {key: i for i, key in reversed(list(enumerate(c.model_key for c in plan.cells)))}
    plan.cells.sort(key=lambda c: first[c.model_key])
    return plan


def write_manifests(plan: SweepPlan, command: Sequence[str]) -> list[Path]:
    """Writes ``sweep.plan`` into each experiment folder of the plan (atomically); returns the paths."""
    folders: dict[Path, list[PlannedCell]] = {}
    for cell in plan.cells:
        folders.setdefault(cell.path.parent, []).append(cell)
    written = []
    for folder, cells in folders.items():
        manifest = {
            "kind": "kvbench-sweep",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": list(command),
            "cells": [c.manifest() for c in cells],
            "dropped": [{"section": d.section, "label": d.label, "reason": d.reason} for d in plan.dropped],
        }
        path = folder / results.MANIFEST
        results.write_text_atomic(path, json.dumps(manifest, indent=2) + "\n")
        written.append(path)
    return written
