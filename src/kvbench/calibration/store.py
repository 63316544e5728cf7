"""Calibration artifacts on disk: computed once per model, settings and calibration text, then reused.

An artifact is ``<cache_root>/calibration/<kind>-<hash16>.pt``, a ``torch.save`` of
``{"tensors": {name: CPU tensor}, "meta": <JSON string>}`` where the meta holds the kind, the hash,
the model identity, the settings and the calibration text's description. The hash covers all four,
so a different model, setting or Python (whose docstrings are the text) gives a different file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from kvbench import models
from kvbench.data import calibration as text


def artifact_key(kind: str, lm_identity: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """Everything an artifact depends on, as plain JSON values."""
    return _plain({"kind": kind, "model": lm_identity, "settings": settings, "text": text.describe()})


def artifact_path(kind: str, key: dict[str, Any]) -> tuple[Path, str]:
    """The artifact's file and its 16-hex-digit hash."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    return models.cache_root() / "calibration" / f"{kind}-{digest}.pt", digest


def get_or_compute(
    kind: str,
    lm_identity: dict[str, Any],
    settings: dict[str, Any],
    compute: Callable[[], dict[str, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load the artifact for (kind, model, settings, calibration text), computing and saving it if absent.

    Args:
        kind: the artifact family, e.g. ``"rankkv"``, ``"lora"``, ``"duo"`` (the file name's prefix).
        lm_identity: :func:`kvbench.models.model_identity` of the model.
        settings: every setting that changes the result (ranks, token counts, hyperparameters).
        compute: makes the tensors; called only when no file exists.

    Returns:
        The tensors (on CPU) and the record ``{kind, hash, path, sha256, settings, text}`` for results.
    """
    key = artifact_key(kind, lm_identity, settings)
    path, digest = artifact_path(kind, key)
    tensors = _load(path, digest)
    if tensors is None:
        name = lm_identity.get("name", "model")
        print(f"kvbench: calibrating {kind} for {name} (cached at {path})", file=sys.stderr, flush=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in compute().items()}
        _save(path, {"tensors": tensors, "meta": json.dumps({"hash": digest, **key}, sort_keys=True)})
    record = {
        "kind": kind,
        "hash": digest,
        "path": str(path),
        "sha256": models.file_sha256(path),
        "settings": key["settings"],
        "text": key["text"],
    }
    return tensors, record


def _load(path: Path, digest: str) -> dict[str, torch.Tensor] | None:
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        meta = json.loads(payload["meta"])
    except Exception as err:  # an unreadable file is recomputed, never trusted
        print(f"kvbench: ignoring unreadable calibration artifact {path} ({err})", file=sys.stderr)
        return None
    return payload["tensors"] if meta.get("hash") == digest else None


def _save(path: Path, payload: dict[str, Any]) -> None:
    """Atomic write: a process-private temporary file, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    """JSON-plain copy (omegaconf nodes, tuples and paths become dicts, lists and strings)."""
    return json.loads(json.dumps(value, sort_keys=True, default=_default))


def _default(value: Any) -> Any:
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return str(value)
