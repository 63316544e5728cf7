"""DuoAttention gates: which KV heads need the full cache (arXiv:2410.10819).

One gate ``g`` per layer and KV head, initialised at 1, is fitted with the model frozen: every query
head of a KV head outputs ``g * full + (1 - g) * streaming`` (streaming = sinks + last ``window``
tokens, causal), and the loss is the mean squared difference between the mixed model's final hidden
states and the full model's (computed once, detached) on the last tokens of synthetic passkey
samples (the question and answer), plus ``l1 * mean(|g|)``. Adam, gates projected onto [0, 1] after
each step. Heads whose gate stays high need the full cache; the rest can stream.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence

import torch
from tqdm import tqdm

from kvbench.cache.capture import Capture, run
from kvbench.data.calibration import calibration_ids
from kvbench.errors import ConfigError

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? The pass key is {key}"
SENTENCE_ENDS = (".", "!", "?")


def passkey_samples(lm, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` synthetic passkey samples built on consecutive ``length``-token chunks of calibration text.

    Each sample is the chunk with the needle sentence (a seeded five-digit key) inserted at a seeded
    sentence boundary in its middle 80 %, followed by the question and the answer; the answer is the
    sample's last tokens.
    """
    if n < 1 or length < 16:
        raise ConfigError(f"passkey samples n={n}, length={length}: need n >= 1 and length >= 16")
    rng = random.Random(seed)
    ids = calibration_ids(lm, n * length)
    samples = []
    for i in range(n):
        chunk = ids[i * length : (i + 1) * length]
        key = rng.randrange(10_000, 100_000)
        at = _sentence_boundary(lm.codec, chunk, rng)
        needle = lm.codec.encode(NEEDLE.format(key=key))
        question = lm.codec.encode(QUESTION.format(key=key))
        samples.append(chunk[:at] + needle + chunk[at:] + question)
    return samples


def _sentence_boundary(codec, chunk: list[int], rng: random.Random) -> int:
    """A seeded index ``j`` in the middle 80 % of ``chunk`` whose token ``j - 1`` ends a sentence."""
    lo, hi = len(chunk) // 10, len(chunk) - len(chunk) // 10
    ends = [
        j for j in range(max(lo, 1), hi + 1) if codec.decode([chunk[j - 1]]).rstrip().endswith(SENTENCE_ENDS)
    ]
    return rng.choice(ends) if ends else len(chunk) // 2


def duo_gates(
    lm,
    samples: Sequence[Sequence[int]],
    sinks: int = 4,
    window: int = 32,
    steps: int = 50,
    lr: float = 0.02,
    l1: float = 0.05,
    seed: int = 0,
    loss_tokens: int = 16,
    progress: bool = False,
) -> torch.Tensor:
    """Fit DuoAttention's gates on ``samples`` with the model frozen.

    Args:
        lm: a :class:`kvbench.models.LoadedModel`.
        samples: token id sequences, e.g. from :func:`passkey_samples`; the loss reads each one's last
            ``loss_tokens`` tokens.
        sinks, window: the streaming heads' pattern (the stack's sinks and window).
        steps: optimizer steps, one sample each (drawn with ``seed``).
        lr: Adam's learning rate.
        l1: weight of ``mean(|g|)``: larger pushes more heads to streaming.
        seed: the sample order.
        loss_tokens: trailing tokens of each sample the distillation loss reads.
        progress: show a tqdm bar.

    Returns:
        ``(L, Hkv)`` float32 gates in [0, 1] on CPU.
    """
    _check(samples, sinks, window, steps, lr, l1, loss_tokens)
    with torch.no_grad():
        refs = [run(lm, s, Capture())[:, -loss_tokens:].float() for s in samples]
    gates = torch.ones(lm.num_layers, lm.kv_heads, device=lm.device, requires_grad=True)
    opt = torch.optim.Adam([gates], lr=lr)
    order = torch.Generator().manual_seed(seed)
    bar = tqdm(range(steps), desc="duo gates", disable=not progress)
    with _frozen(lm.model), torch.enable_grad():
        for _ in bar:
            i = int(torch.randint(len(samples), (1,), generator=order))
            mixed = run(lm, samples[i], Capture(gates=gates, sinks=sinks, window=window))
            distill = (mixed[:, -loss_tokens:].float() - refs[i]).pow(2).mean()
            loss = distill + l1 * gates.abs().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                gates.clamp_(0.0, 1.0)
                bar.set_postfix(distill=f"{distill.item():.3g}", gate=f"{gates.mean().item():.3f}")
    return gates.detach().cpu()


def _check(samples, sinks: int, window: int, steps: int, lr: float, l1: float, loss_tokens: int) -> None:
    if not samples:
        raise ConfigError("duo gates: no calibration samples")
    if sinks < 0 or window < 1 or steps < 0 or lr <= 0 or l1 < 0 or loss_tokens < 1:
        raise ConfigError(
            f"duo gates sinks={sinks}, window={window}, steps={steps}, lr={lr}, l1={l1}, "
            f"loss_tokens={loss_tokens}: need sinks >= 0, window >= 1, steps >= 0, lr > 0, l1 >= 0, "
            "loss_tokens >= 1"
        )
    short = min(len(s) for s in samples)
    if short <= loss_tokens:
        raise ConfigError(f"duo gates loss_tokens={loss_tokens}: a sample has only {short} tokens")


@contextlib.contextmanager
def _frozen(model) -> Iterator[None]:
    """No parameter gradients inside the block; each parameter's flag restored afterwards."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
