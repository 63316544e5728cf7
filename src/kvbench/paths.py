"""Where kvbench's Hydra configs are: the one place that says so (``conf/`` at the repository's top)."""

from __future__ import annotations

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
