"""The embedded SmolLM2 model end to end (slow: converts the GGUF once, then reuses the cache)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from helpers import make_stack, run_chunks
from kvbench import models
from kvbench.compressors.quantized import QuantizedCompressor
from kvbench.compressors.snapkv import SnapKVCompressor
from kvbench.compressors.svd import SVDCompressor
from kvbench.data import load_text
from kvbench.schedulers.h2o import H2OScheduler
from kvbench.schedulers.quest import QuestScheduler

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smol():
    return models.load(OmegaConf.load(ROOT / "conf/model/smollm2_135m.yaml"), "cpu")


def test_embedded_model_is_the_9_3_llama(smol):
    assert smol.info["family"] == "llama" and smol.kv_heads == 3 and smol.info["heads"] == 9
    assert smol.codec.tok.chat_template


SMOKE = {
    "h2o": lambda: {"scheduler": H2OScheduler()},
    "quantized": lambda: {"compressor": QuantizedCompressor(bits=2)},
    "snapkv": lambda: {"compressor": SnapKVCompressor()},
    "svd": lambda: {"compressor": SVDCompressor(key_rank=8, value_rank=16, block_size=64)},
    "quest": lambda: {"scheduler": QuestScheduler(dense_layers=2)},
}


@pytest.mark.parametrize("tech", sorted(SMOKE))
def test_techniques_change_the_embedded_model_output(smol, tech):
    ids = smol.codec.encode(load_text({"name": "pydoc", "source": "pydoc"})[:4000])[:200]
    full, _ = run_chunks(smol, make_stack(smol), ids, [160, 20, 20])
    got, cache = run_chunks(
        smol, make_stack(smol, **SMOKE[tech](), budget=0.2, sinks=4, window=16), ids, [160, 20, 20]
    )
    assert torch.isfinite(got).all()
    assert not torch.allclose(got[-40:], full[-40:], atol=1e-2)
    if tech != "quest":  # quest keeps every token and adds page bounds; it reads fewer
        assert cache.nbytes() < cache.reference_bytes() * 2  # fewer bytes than the float32 full cache
