"""The cache engine with the stack `none` equals plain transformers; positions never shift."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, tiny_cfg
from helpers import make_stack, run_chunks, tokens
from kvbench import models
from kvbench.eval import perplexity
from kvbench.schedulers.streaming_llm import StreamingLLMScheduler


def plain_logits(lm, ids):
    lm.model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return lm.model(torch.tensor([ids])).logits[0].float()
    finally:
        lm.model.set_attn_implementation("kvbench")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_none_stack_equals_transformers(family):
    lm = models.load(tiny_cfg(family), "cpu")
    ids = tokens(60)
    got, cache = run_chunks(lm, make_stack(lm), ids, [30, 7, 1, 1, 21])
    assert torch.allclose(got, plain_logits(lm, ids), atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 60


def test_gqa_9_3_split_equals_transformers(tiny_93):
    assert (tiny_93.kv_heads, tiny_93.model.config.num_attention_heads) == (3, 9)
    ids = tokens(40)
    got, _ = run_chunks(tiny_93, make_stack(tiny_93), ids, [20, 20])
    assert torch.allclose(got, plain_logits(tiny_93, ids), atol=1e-4, rtol=1e-4)


def test_chunked_perplexity_equals_full_pass(tiny):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        dict(name="t", prefill=40, chunk=8, chunks_per_window=4, windows=1, decode_steps=0)
    )
    ids = tokens(200)
    metrics, wins = perplexity.evaluate(tiny, make_stack(tiny), ids, cfg, None)
    window = ids[: perplexity.window_length(cfg)]
    full = torch.log_softmax(plain_logits(tiny, window), -1)
    target = torch.tensor(window[41:])
    ref_nll = -full[40:-1].gather(-1, target[:, None])[:, 0]
    assert torch.allclose(wins[0].nll, ref_nll, rtol=1e-4, atol=1e-6)
    assert metrics.score.value == pytest.approx(float(ref_nll.mean().exp()), rel=1e-4)


def test_eviction_keeps_true_positions(tiny):
    """After eviction the next token's rotary position is the true count, not the stored length."""
    stack = make_stack(tiny, scheduler=StreamingLLMScheduler(), budget=0.25, sinks=2, window=4)
    _, cache = run_chunks(tiny, stack, tokens(64), [64])
    assert cache.get_seq_length() == 64
    assert cache.stores[0].stored_tokens() < 64 * tiny.kv_heads
    pos = cache.stores[0].view().pos
    assert int(pos.max()) == 63  # the newest token kept its original position


def test_compressed_cache_refuses_crop_and_beam(tiny):
    _, cache = run_chunks(tiny, make_stack(tiny), tokens(8), [8])
    with pytest.raises(NotImplementedError, match="crop"):
        cache.crop(4)
    with pytest.raises(NotImplementedError, match="beam"):
        cache.reorder_cache(torch.tensor([0]))


def test_kernels_folder_does_not_shadow_hf_kernels():
    import kvbench.kernels  # noqa: F401
    import transformers.utils.import_utils as iu

    assert not iu.is_kernels_available()
