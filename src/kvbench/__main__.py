"""``python -m kvbench``: one cell, or a Hydra multirun of cells in one process (model loaded once)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from kvbench import config
from kvbench.errors import ConfigError, DatasetLoadError

config.register()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="config")
def _app(cfg: DictConfig) -> None:
    from kvbench import logger, run
    from kvbench.report.tables import render_table

    record = run.run(cfg)
    logger.log(cfg, record)
    print(render_table([record]))


def main() -> None:
    try:
        _app()
    except (ConfigError, DatasetLoadError) as err:
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
