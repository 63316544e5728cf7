"""The calibration artifacts kvbench's techniques use, each keyed by every setting that changes it.

Techniques and ``scripts/calibrate.py`` go through these, so a precomputed artifact is the one a run
finds. Each returns ``(tensors, record)`` from :func:`kvbench.calibration.store.get_or_compute`.
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.calibration.bases import kv_bases
from kvbench.calibration.duo import duo_gates, passkey_samples
from kvbench.calibration.ranks import effective_ranks
from kvbench.calibration.store import get_or_compute
from kvbench.data.calibration import calibration_ids
from kvbench.errors import ConfigError
from kvbench.models import model_identity

Artifact = tuple[dict[str, torch.Tensor], dict[str, Any]]
CALIBRATION_TOKENS = 1024  # rankkv's calibration text
LORA_TOKENS = 2048


def identity(lm) -> dict[str, Any]:
    """The model identity artifacts are keyed by (:func:`kvbench.models.model_identity`)."""
    if lm.cfg is None:
        raise ConfigError("calibration needs the model's config (load it with kvbench.models.load)")
    return model_identity(lm.cfg)


def rankkv_artifact(lm, tokens: int = CALIBRATION_TOKENS) -> Artifact:
    """``{"ranks": (L,)}``: per-layer effective rank of attention (``allocation=rankkv``)."""
    return get_or_compute(
        "rankkv",
        identity(lm),
        {"tokens": tokens},
        lambda: {"ranks": effective_ranks(lm, calibration_ids(lm, tokens))},
    )


def lora_artifact(lm, key_rank: int, value_rank: int, tokens: int = LORA_TOKENS) -> Artifact:
    """``{"key": (L, Hkv, D, key_rank), "value": (L, Hkv, D, value_rank)}``: ``lora``'s bases."""
    return get_or_compute(
        "lora",
        identity(lm),
        {"tokens": tokens, "key_rank": key_rank, "value_rank": value_rank},
        lambda: kv_bases(lm, calibration_ids(lm, tokens), key_rank, value_rank),
    )


def duo_artifact(
    lm,
    sinks: int = 4,
    window: int = 32,
    samples: int = 8,
    length: int = 1024,
    steps: int = 50,
    lr: float = 0.02,
    l1: float = 0.05,
    seed: int = 0,
    loss_tokens: int = 16,
    progress: bool = False,
) -> Artifact:
    """``{"gates": (L, Hkv)}``: DuoAttention's gates fitted on ``samples`` passkey samples of ``length``."""
    fit: dict[str, Any] = {
        "sinks": sinks, "window": window, "steps": steps, "lr": lr, "l1": l1, "seed": seed,
        "loss_tokens": loss_tokens,
    }  # fmt: skip
    settings = {"samples": samples, "length": length, **fit}

    def compute() -> dict[str, torch.Tensor]:
        data = passkey_samples(lm, samples, length, seed)
        return {"gates": duo_gates(lm, data, **fit, progress=progress)}

    return get_or_compute("duo", identity(lm), settings, compute)
