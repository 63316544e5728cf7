"""Compress-then-generate, shared by the generation protocols (needle, LongBench).

Each prompt is split in two: ``head`` (the document) is prefilled and compressed; ``tail`` (the
question and the answer cue) is fed after the compression and is never evicted, then greedy
decoding runs on the compressed cache. With ``query_aware`` the tail is prefilled with the head
(still protected), so score-based techniques see the question before they compress.

``batch_size`` prompts run at once through the engine's padded-batch path: left-padded, each
sequence at its own positions, selected per sequence, finished rows fed as padding. Bytes are
the batch's (the store's side data cannot be split by sequence), so every example of a batch
records the batch's bytes and its ``batch`` number, and :func:`cache_metrics` sums over batches:
over a whole cell, compression and mean stored bytes per example are the same at any batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from kvbench.cache.engine import KVCache
from kvbench.eval import loop
from kvbench.models import LoadedModel
from kvbench.stack import Stack


@dataclass
class Prompt:
    """One example's token ids: ``head`` is compressed, ``tail`` is protected; up to ``max_new`` tokens."""

    head: list[int]
    tail: list[int]
    max_new: int
    done: Callable[[list[int]], bool] | None = None  # stop early once the tokens so far suffice


@dataclass
class Generated:
    """What generating one prompt measured (bytes are its batch's, see the module docstring)."""

    tokens: list[int]
    batch: int
    ttft: float
    tpot: list[float] = field(default_factory=list)
    bytes_prefill: int = 0
    reference_prefill: int = 0
    bytes_end: int = 0
    reference_end: int = 0
    resident_peak: int = 0  # bytes the batch's cache held, max after the context and at the end

    def accounting(self) -> dict:
        """The fields every generation protocol stores per example."""
        return {
            "batch": self.batch,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "bytes_prefill": self.bytes_prefill,
            "reference_prefill": self.reference_prefill,
            "compression_prefill": self.reference_prefill / self.bytes_prefill,
            "bytes_end": self.bytes_end,
            "reference_end": self.reference_end,
            "compression_end": self.reference_end / self.bytes_end,
            "resident_peak": self.resident_peak,
        }


AfterPrefill = Callable[[KVCache, int, int], None]  # (cache, row in the batch, prompt index)


def generate(
    lm: LoadedModel,
    stack: Stack,
    prompts: Sequence[Prompt],
    batch_size: int = 1,
    query_aware: bool = False,
    after_prefill: AfterPrefill | None = None,
    desc: str = "examples",
) -> list[Generated]:
    """Run every prompt, ``batch_size`` at a time; ``after_prefill`` sees the cache after compression."""
    out: list[Generated] = []
    bar = tqdm(total=len(prompts), desc=desc, leave=False, disable=None)
    for b, start in enumerate(range(0, len(prompts), batch_size)):
        group = prompts[start : start + batch_size]
        run = _solo if len(group) == 1 and batch_size == 1 else _batch
        out.extend(run(lm, stack, group, b, start, query_aware, after_prefill))
        bar.update(len(group))
    bar.close()
    return out


def _solo(lm, stack, group, b, start, query_aware, after_prefill) -> list[Generated]:
    (p,) = group
    cache = loop.new_cache(lm, stack)
    for store in cache.stores:
        store.set_protect_from(len(p.head))
    ttft: list[float] = []
    # the first token comes from the last position: the lm head runs over it alone
    logits = loop.step(lm, cache, p.head + p.tail if query_aware else p.head, ttft, keep=int(query_aware))
    ref, stored, resident = cache.reference_bytes(), cache.nbytes(), cache.resident_bytes()
    if after_prefill is not None:
        after_prefill(cache, 0, start)
    if not query_aware:
        logits = loop.step(lm, cache, p.tail, ttft, keep=1)
    tpot: list[float] = []
    tokens = loop.greedy(lm, cache, logits[-1], p.max_new, tpot, p.done)
    end_ref, end = cache.reference_bytes(), cache.nbytes()
    resident = max(resident, cache.resident_bytes())
    return [Generated(tokens, b, sum(ttft), tpot, stored, ref, end, end_ref, resident)]


def _left_pad(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, width)`` ids and the mask of real tokens, each sequence right-aligned."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    real = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, seq in enumerate(seqs):
        if seq:
            ids[row, width - len(seq) :], real[row, width - len(seq) :] = torch.tensor(seq), True
    return ids, real


def _batch(lm, stack, group, b, start, query_aware, after_prefill) -> list[Generated]:
    n = len(group)
    cache = loop.new_cache(lm, stack, batch=n)
    protect = torch.tensor([len(p.head) for p in group])
    for store in cache.stores:
        store.set_protect_from(protect)
    ttft: list[float] = []
    first = [p.head + p.tail if query_aware else p.head for p in group]
    logits = loop.step_batch(lm, cache, *_left_pad(first), ttft, keep=int(query_aware))
    ref, stored, resident = cache.reference_bytes(), cache.nbytes(), cache.resident_bytes()
    if after_prefill is not None:
        for row in range(n):
            after_prefill(cache, row, start + row)
    if not query_aware:
        logits = loop.step_batch(lm, cache, *_left_pad([p.tail for p in group]), ttft, keep=1)
    tokens: list[list[int]] = [[int(t)] for t in logits[:, -1].argmax(-1)]
    steps: list[list[float]] = [[] for _ in group]
    while active := [r for r, p in enumerate(group) if not _finished(lm, p, tokens[r])]:
        real = torch.zeros(n, 1, dtype=torch.bool)
        real[active] = True
        ids = torch.tensor([[t[-1]] for t in tokens])
        times: list[float] = []
        logits = loop.step_batch(lm, cache, ids, real, times, decode=True)
        for r in active:
            tokens[r].append(int(logits[r, -1].argmax()))
            steps[r].append(times[0])
    end_ref, end = cache.reference_bytes(), cache.nbytes()
    resident = max(resident, cache.resident_bytes())
    return [
        Generated(tokens[r], b, sum(ttft), steps[r], stored, ref, end, end_ref, resident) for r in range(n)
    ]


def _finished(lm: LoadedModel, p: Prompt, tokens: list[int]) -> bool:
    return (
        len(tokens) >= p.max_new or tokens[-1] == lm.codec.eos_id or (p.done is not None and p.done(tokens))
    )


def recorded(examples: list[dict]) -> list[dict]:
    """The examples as a record keeps them: without their per-step times (their mean is a metric)."""
    return [{k: v for k, v in e.items() if k != "tpot"} for e in examples]


def cache_metrics(examples: list[dict]) -> dict:
    """Compression, stored MB, TTFT, TPOT and throughput over a cell's examples, summed per batch.

    Compression is all reference bytes over all stored bytes; stored MB is per example (the
    batches' bytes over the number of examples); the peak is the largest batch's.
    """
    batches = list({e["batch"]: e for e in examples}.values())
    total = lambda key: float(sum(e[key] for e in batches))  # noqa: E731
    tpot = [t for e in examples for t in e["tpot"]]
    # a batch takes as long as its longest example: every step ran for all its rows
    gen_time: dict[int, float] = {}
    for e in examples:
        gen_time[e["batch"]] = max(gen_time.get(e["batch"], 0.0), e["ttft"] + sum(e["tpot"]))
    return {
        "compression_prefill": total("reference_prefill") / total("bytes_prefill"),
        "compression_mean": total("reference_end") / total("bytes_end"),
        "kv_mem_mb_prefill": total("bytes_prefill") / len(examples) / 2**20,
        "kv_mem_mb_peak": max(max(e["bytes_prefill"], e["bytes_end"]) for e in batches) / 2**20,
        "kv_resident_mb_peak": max(e["resident_peak"] for e in batches) / 2**20,
        "ttft_s": float(np.mean([e["ttft"] for e in examples])),
        "tpot_s": float(np.mean(tpot)) if tpot else None,
        "throughput_tok_s": sum(len(e["tpot"]) + 1 for e in examples) / sum(gen_time.values()),
    }
