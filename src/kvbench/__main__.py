"""``python -m kvbench``: one cell, or a sweep of cells (``-m``) through kvbench's matrix sweeper.

Every cell of the command is composed and validated before anything launches, so a bad value
fails with one line naming the key, the value and what is allowed, before any model loads.
"""

from __future__ import annotations

import sys
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

import hydra_plugins.kvbench_plugins as own
from kvbench import config, logger, run
from kvbench.errors import ConfigError, DatasetLoadError
from kvbench.paths import CONF_DIR
from kvbench.report.tables import render_table
from kvbench.sweep.plan import compose_error


def register() -> None:
    """Registers the config schema, and kvbench's Hydra plugins by hand.

    Hydra finds plugins by walking the ``hydra_plugins`` folders on disk, which misses a package
    installed in editable mode (``pip install -e``); registering them directly works for both.
    """
    config.register()
    for plugin in (own.MatrixSweeper, own.SlurmLauncher, own.LocalLauncher):
        Plugins.instance().register(plugin)


register()


def _fail(message: str) -> None:
    print(f"kvbench: error: {message}", file=sys.stderr)
    sys.exit(2)


def _compose(combo: list[str]) -> DictConfig:
    try:
        return compose("config", overrides=combo)
    except (HydraException, OmegaConfBaseException) as err:
        _fail(compose_error(err, combo, CONF_DIR))
    raise AssertionError("unreachable")


def prevalidate(argv: list[str]) -> int:
    """Checks the command before Hydra starts; returns the number of cells checked.

    A single run is composed and validated whole (a sweep without ``-m`` fails to compose). A
    multirun is composed without its sweeps (an unknown option or a syntax error fails here, in one
    line); its sweeper then expands, composes, validates and identifies every cell
    (:mod:`kvbench.sweep.plan`) before anything launches.
    """
    args = get_args_parser().parse_args(argv)  # Hydra's own: the value of --cfg job is no override
    overrides = [a for a in args.overrides if not a.startswith("hydra")]
    multirun = bool(args.multirun)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        if not multirun:
            config.validate(_compose(overrides))
            return 1
        parsed = OverridesParser.create().parse_overrides(overrides)
        _compose([str(ov.input_line) for ov in parsed if not ov.is_sweep_override()])
    return 0


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _app(cfg: DictConfig) -> dict[str, Any] | None:
    """One cell. In a multirun it returns the cell's outcome to the sweeper instead of printing."""
    try:
        outcome = run.execute(cfg)
    except (ConfigError, DatasetLoadError) as err:
        _fail(str(err))
    record = outcome.record
    if outcome.ran:
        logger.log(cfg, record)
    summary = {k: record.get(k) for k in ("cell_id", "status", "error")} | {"ran": outcome.ran}
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return summary
    if record.get("status") != "done":
        print(f"kvbench: cell {record.get('cell_id')} failed: {record.get('error')}", file=sys.stderr)
        sys.exit(1)
    print(render_table([record]))
    return None


def main() -> None:
    try:
        prevalidate(sys.argv[1:])
    except (ConfigError, DatasetLoadError) as err:
        _fail(str(err))
    _app()


if __name__ == "__main__":
    main()
