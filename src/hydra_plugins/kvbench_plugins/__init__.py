"""kvbench's Hydra plugins. Hydra accepts plugin classes defined under ``hydra_plugins`` only; the
code lives in :mod:`kvbench.sweep`, and these subclasses are what ``conf/hydra/*/`` names."""

from kvbench.sweep import launcher as _launcher
from kvbench.sweep import sweeper as _sweeper


class MatrixSweeper(_sweeper.MatrixSweeper):
    """``hydra/sweeper=matrix``: see :mod:`kvbench.sweep.sweeper`."""


class SlurmLauncher(_launcher.GroupedSubmititLauncher):
    """``launcher=slurm``: see :mod:`kvbench.sweep.launcher`."""

    _EXECUTOR = "slurm"


class LocalLauncher(_launcher.GroupedSubmititLauncher):
    """``launcher=submitit_local``: see :mod:`kvbench.sweep.launcher`."""

    _EXECUTOR = "local"
