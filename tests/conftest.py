"""Shared fixtures: tiny random models of several families, built from configs (GQA on)."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
if not torch.cuda.is_available():  # Triton's kernels run interpreted on the CPU (before kvbench imports them)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Two threads a test process; under pytest-xdist, the machine's cores shared among its workers (a
# worker per core: one thread each), and the same for the processes the tests start.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = 2 if _WORKERS == 1 else max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(_THREADS)

FAMILIES = {
    "llama": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 2, "sliding_window": 24},
    "qwen2": {"num_key_value_heads": 2},
    "gpt_neox": {"rotary_pct": 0.25},
}


def tiny_cfg(family: str = "llama", heads: int = 6, **extra):
    config = dict(
        vocab_size=256,
        hidden_size=16 * heads,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        max_position_embeddings=1024,
        **FAMILIES[family],
    )
    config.update(extra)
    return OmegaConf.create(
        {
            "name": f"tiny_{family}_{heads}",
            "source": "tiny",
            "family": family,
            "seed": 0,
            "dtype": "float32",
            "device_map": None,
            "description": "test",
            "config": config,
        }
    )


@pytest.fixture(scope="session")
def tiny():
    from kvbench import models

    return models.load(tiny_cfg("llama"), "cpu")


@pytest.fixture(scope="session")
def tiny_93():
    """The embedded model's 9 query / 3 KV head split."""
    from kvbench import models

    return models.load(tiny_cfg("llama", heads=9, num_key_value_heads=3), "cpu")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
