"""``python -m kvbench``: one cell, or a Hydra multirun of cells in one process (model loaded once).

Every cell of the command is composed and validated before Hydra launches anything, so a bad
value fails with one line naming the key, the value and what is allowed, before any model loads.
"""

from __future__ import annotations

import difflib
import itertools
import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from kvbench import config
from kvbench.errors import ConfigError, DatasetLoadError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
config.register()


def _fail(message: str) -> None:
    print(f"kvbench: error: {message}", file=sys.stderr)
    sys.exit(2)


def _unknown_option(err: MissingConfigException, overrides: list[str]) -> str:
    for ov in overrides:
        group, _, value = ov.partition("=")
        folder = CONF_DIR / group.lstrip("+~")
        if folder.is_dir() and not (folder / f"{value}.yaml").exists():
            options = sorted(p.stem for p in folder.glob("*.yaml"))
            close = difflib.get_close_matches(value, options, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"{group}={value!r}: unknown option{hint}; allowed: {', '.join(options)}"
    return str(err).splitlines()[0]


def cells(overrides: list[str]) -> list[list[str]]:
    """Expand comma sweeps (``a=1,2``) into the list of per-cell override lists."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for ov in parsed:
        if ov.is_sweep_override():
            choices.append([f"{ov.get_key_element()}={v}" for v in ov.sweep_string_iterator()])
        else:
            choices.append([str(ov.input_line)])
    return [list(c) for c in itertools.product(*choices)]


def _compose(combo: list[str], hydra_node: bool = False) -> DictConfig:
    try:
        return compose("config", overrides=combo, return_hydra_config=hydra_node)
    except MissingConfigException as err:
        _fail(_unknown_option(err, combo))
    except (HydraException, OmegaConfBaseException) as err:
        cause = f": {str(err.__cause__).splitlines()[0]}" if err.__cause__ else ""
        _fail(" ".join(str(err).split()) + cause)
    raise AssertionError("unreachable")


def _preset_sweeps(combo: list[str]) -> list[list[str]]:
    """A preset's own ``hydra.sweeper.params`` (under a multirun) expanded, command line first."""
    params = _compose(combo, hydra_node=True).hydra.sweeper.get("params") or {}
    given = {c.partition("=")[0].lstrip("+~") for c in combo}
    extra = [f"{k}={v}" for k, v in params.items() if k not in given]
    return [combo + more for more in cells(extra)] if extra else [combo]


def prevalidate(argv: list[str]) -> int:
    """Compose and validate every cell the command would run; returns the number of cells."""
    overrides = [a for a in argv if not a.startswith("-") and not a.startswith("hydra")]
    multirun = any(a in ("-m", "--multirun") for a in argv)
    combos = cells(overrides)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        if multirun:
            combos = [full for combo in combos for full in _preset_sweeps(combo)]
        for combo in combos:
            config.validate(_compose(combo))
    return len(combos)


@hydra.main(version_base="1.3", config_path="../../conf", config_name="config")
def _app(cfg: DictConfig) -> None:
    from kvbench import logger, run
    from kvbench.report.tables import render_table

    try:
        record = run.run(cfg)
    except (ConfigError, DatasetLoadError) as err:
        _fail(str(err))
    logger.log(cfg, record)
    print(render_table([record]))


def main() -> None:
    try:
        prevalidate(sys.argv[1:])
    except (ConfigError, DatasetLoadError) as err:
        _fail(str(err))
    _app()


if __name__ == "__main__":
    main()
