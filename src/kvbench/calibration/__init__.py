"""Calibration for KV techniques: fitted once on calibration text, saved keyed by model and settings,
reused, and recorded in results (docs/methods.md rows ``lora``, ``duo_attention``, ``allocation=rankkv``).

- :mod:`~kvbench.calibration.store`: the on-disk artifact store (:func:`get_or_compute`).
- :mod:`~kvbench.cache.capture`: the ``"kvbench_calib"`` attention that exposes keys, values and
  attention probabilities, and mixes in streaming heads.
- :mod:`~kvbench.calibration.ranks`, :mod:`~kvbench.calibration.bases`,
  :mod:`~kvbench.calibration.duo`: the three fits.
- :mod:`~kvbench.calibration.artifacts`: each technique's artifact with its settings.
"""

from kvbench.cache.capture import CALIB_NAME, Capture, capturing, register, run
from kvbench.calibration.artifacts import duo_artifact, lora_artifact, rankkv_artifact
from kvbench.calibration.bases import kv_bases, prerope_kv, principal_basis
from kvbench.calibration.duo import duo_gates, passkey_samples
from kvbench.calibration.ranks import effective_rank, effective_ranks
from kvbench.calibration.store import get_or_compute

__all__ = [
    "CALIB_NAME",
    "Capture",
    "capturing",
    "duo_artifact",
    "duo_gates",
    "effective_rank",
    "effective_ranks",
    "get_or_compute",
    "kv_bases",
    "lora_artifact",
    "passkey_samples",
    "prerope_kv",
    "principal_basis",
    "rankkv_artifact",
    "register",
    "run",
]
