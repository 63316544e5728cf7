"""Where kvbench's Hydra configs are: the one place that says so.

``conf/`` lives at the repository's top level and is shipped inside the package as ``kvbench/conf``
(pyproject maps it). An installed wheel finds it
beside this file; a checkout (an editable install, or ``src`` on the path) finds it two folders up.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _conf_dir() -> Path:
    shipped = _PACKAGE / "conf"
    return shipped if shipped.is_dir() else _PACKAGE.parents[1] / "conf"


CONF_DIR = _conf_dir()
