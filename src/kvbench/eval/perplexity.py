"""Perplexity under compression (docs/methods.md): prefill P tokens, apply the stack, then score the
next tokens in chunks of C against the compressed cache, re-applying the stack after each chunk.
With the stack ``none`` this equals one full forward pass to numerical precision.

``dataset.batch_size`` windows run at once (:func:`score_windows`). Every window has the same
length, so a batch is a ``(B, L)`` tensor with no padding, every row at the same positions. Bytes
are the batch's (the store's side data cannot be split by sequence): each window of a batch gets
an even share, so compression and mean stored MB over a cell are the same at any batch size; the
peak is the largest batch's, not one window's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from kvbench import metrics
from kvbench.cache.engine import HitProbe, KVCache
from kvbench.data import corpus
from kvbench.errors import ConfigError
from kvbench.eval import loop
from kvbench.eval.protocol import Dataset, Evaluation, Metrics, Score, load_corpus
from kvbench.models import LoadedModel
from kvbench.stack import Stack


@dataclass
class WindowResult:
    """What one window measured. ``logprobs`` is kept only for the baseline (fidelity reference)."""

    nll: torch.Tensor  # (n_scored,)
    chunk_nll: list[float]
    logprobs: torch.Tensor | None
    ttft: float
    tpot: list[float]
    bytes_prefill: float  # in a batch: the batch's bytes / B (see the module docstring)
    reference_prefill: float  # the same tokens in 16-bit K and V
    bytes_peak: int  # in a batch: the batch's peak
    per_layer_prefill: list[int]
    compression_prefill: float
    compression_chunks: list[float]
    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    resident_peak: int = 0  # bytes the cache held (in a batch: the batch's), max after prefill or a chunk


def window_length(cfg) -> int:
    return cfg.prefill + cfg.chunk * cfg.chunks_per_window + 1


def windows(ids: list[int], cfg) -> list[list[int]]:
    """``cfg.windows`` windows spread evenly over the token stream (deterministic)."""
    length = window_length(cfg)
    if len(ids) < length:
        raise ConfigError(f"dataset {cfg.name!r}: {len(ids)} tokens, fewer than one window ({length})")
    check_windows(cfg, len(ids), exact=True)
    starts = np.linspace(0, len(ids) - length, cfg.windows).round().astype(int)
    return [ids[s : s + length] for s in starts]


def check_windows(cfg, tokens: int, exact: bool) -> None:
    """``cfg.windows`` windows must fit side by side in the corpus's ``tokens`` tokens: more would
    overlap and score the same tokens again. ``exact``: ``tokens`` is the tokenized corpus's
    length; otherwise an upper bound known before the tokenizer is (one token per UTF-8 byte)."""
    length = window_length(cfg)
    fit = tokens // length
    at_most = "" if exact else "at most "
    count = f"{tokens} tokens" if exact else f"{tokens} UTF-8 bytes, so at most {tokens} tokens"
    if fit < 1:
        raise ConfigError(
            f"dataset {cfg.name!r}: {at_most}{tokens} tokens, fewer than one window ({length}); "
            "lower dataset.prefill, dataset.chunk or dataset.chunks_per_window"
        )
    if cfg.windows > fit:
        allowed = f"1..{fit}" if exact else f"at most {fit} (the model's tokenizer gives the exact number)"
        raise ConfigError(
            f"dataset.windows={cfg.windows}: corpus {cfg.name!r} ({count}) holds {at_most}{fit} windows "
            f"of {length} tokens; more would overlap and score the same tokens again; allowed {allowed}"
        )


def score_window(
    lm: LoadedModel,
    stack: Stack,
    ids: list[int],
    cfg,
    reference: torch.Tensor | None,
    probe: HitProbe | None,
    keep_logprobs: bool,
) -> WindowResult:
    """Run the protocol on one window of ``prefill + chunk * chunks_per_window + 1`` tokens."""
    cache = loop.new_cache(lm, stack, shadow=probe is not None and probe.shadowed())
    ttft: list[float] = []
    loop.step(lm, cache, ids[: cfg.prefill], ttft, keep=0)  # the prefill's logits are not scored
    ref_bytes = cache.reference_bytes()
    out = WindowResult(
        nll=torch.empty(0),
        chunk_nll=[],
        logprobs=None,
        ttft=ttft[0],
        tpot=[],
        bytes_prefill=cache.nbytes(),
        reference_prefill=ref_bytes,
        bytes_peak=cache.nbytes(),
        resident_peak=cache.resident_bytes(),
        per_layer_prefill=cache.per_layer_bytes(),
        compression_prefill=ref_bytes / cache.nbytes(),
        compression_chunks=[],
    )
    cache.probe = probe
    nlls, lps = [], []
    for j in range(cfg.chunks_per_window):
        a = cfg.prefill + j * cfg.chunk
        logprobs = torch.log_softmax(loop.step(lm, cache, ids[a : a + cfg.chunk]), dim=-1)
        target = torch.as_tensor(ids[a + 1 : a + cfg.chunk + 1], device=logprobs.device)
        nll = -logprobs.gather(-1, target[:, None])[:, 0]
        nlls.append(nll.cpu())
        out.chunk_nll.append(float(nll.mean()))
        out.bytes_peak = max(out.bytes_peak, cache.nbytes())
        out.resident_peak = max(out.resident_peak, cache.resident_bytes())
        out.compression_chunks.append(cache.reference_bytes() / cache.nbytes())
        if reference is not None:
            kl, agree = metrics.kl_and_top1(
                reference[j * cfg.chunk : (j + 1) * cfg.chunk].to(logprobs.device), logprobs
            )
            out.kl.extend(kl.tolist())
            out.top1.extend(agree.float().tolist())
        if keep_logprobs:
            lps.append(logprobs.half().cpu())
    out.nll = torch.cat(nlls)
    out.logprobs = torch.cat(lps) if keep_logprobs else None
    cache.probe, cache.shadow = None, None  # the shadow stays out of timed passes
    if cfg.decode_steps:
        loop.greedy(lm, cache, logprobs[-1], cfg.decode_steps + 1, out.tpot)
    return out


def score_windows(
    lm: LoadedModel,
    stack: Stack,
    group: list[list[int]],
    cfg,
    references: list[torch.Tensor | None],
    probe: HitProbe | None,
    keep_logprobs: bool,
) -> list[WindowResult]:
    """:func:`score_window` for B windows at once, one ``(B, L)`` batch; one result per window.

    Each window gets the batch's TTFT and compression and an even share of its bytes; the peak is
    the batch's (so ``kv_mem_mb_peak`` grows with B). A chunk's compression is the batch's ratio,
    equal to each window's own when the windows store equal bytes (fixed budgets). Decoding feeds
    each row its own greedy token, finished rows as padding.
    """
    n = len(group)
    ids = torch.tensor(group)  # (B, L)
    cache = loop.new_cache(lm, stack, shadow=probe is not None and probe.shadowed(), batch=n)
    ttft: list[float] = []
    _step_rows(lm, cache, ids[:, : cfg.prefill], ttft, keep=0)  # the prefill's logits are not scored
    ref_bytes, stored = cache.reference_bytes(), cache.nbytes()
    outs = [
        WindowResult(
            nll=torch.empty(0),
            chunk_nll=[],
            logprobs=None,
            ttft=ttft[0],
            tpot=[],
            bytes_prefill=stored / n,
            reference_prefill=ref_bytes / n,
            bytes_peak=stored,
            resident_peak=cache.resident_bytes(),
            per_layer_prefill=[round(b / n) for b in cache.per_layer_bytes()],
            compression_prefill=ref_bytes / stored,
            compression_chunks=[],
        )
        for _ in group
    ]
    cache.probe = probe
    nlls: list[list[torch.Tensor]] = [[] for _ in group]
    lps: list[list[torch.Tensor]] = [[] for _ in group]
    for j in range(cfg.chunks_per_window):
        a = cfg.prefill + j * cfg.chunk
        logprobs = torch.log_softmax(_step_rows(lm, cache, ids[:, a : a + cfg.chunk]), dim=-1)  # (B, C, V)
        target = ids[:, a + 1 : a + cfg.chunk + 1].to(logprobs.device)
        nll = -logprobs.gather(-1, target[..., None])[..., 0]  # (B, C)
        peak, ratio = cache.nbytes(), cache.reference_bytes() / cache.nbytes()
        resident = cache.resident_bytes()
        for r, (out, ref) in enumerate(zip(outs, references)):
            nlls[r].append(nll[r].cpu())
            out.chunk_nll.append(float(nll[r].mean()))
            out.bytes_peak = max(out.bytes_peak, peak)
            out.resident_peak = max(out.resident_peak, resident)
            out.compression_chunks.append(ratio)
            if ref is not None:
                _fidelity(out, ref[j * cfg.chunk : (j + 1) * cfg.chunk], logprobs[r])
            if keep_logprobs:
                lps[r].append(logprobs[r].half().cpu())
    for out, nll_r, lps_r in zip(outs, nlls, lps):
        out.nll = torch.cat(nll_r)
        out.logprobs = torch.cat(lps_r) if keep_logprobs else None
    cache.probe, cache.shadow = None, None  # the shadow stays out of timed passes
    if cfg.decode_steps:
        _greedy_rows(lm, cache, logprobs[:, -1], cfg.decode_steps + 1, [o.tpot for o in outs])
    return outs


def _fidelity(out: WindowResult, reference: torch.Tensor, logprobs: torch.Tensor) -> None:
    """Add KL and top-1 agreement of one chunk, ``(C, V)`` each, to ``out``."""
    kl, agree = metrics.kl_and_top1(reference.to(logprobs.device), logprobs)
    out.kl.extend(kl.tolist())
    out.top1.extend(agree.float().tolist())


def _step_rows(
    lm: LoadedModel,
    cache: KVCache,
    ids: torch.Tensor,
    times: list[float] | None = None,
    keep: int | None = None,
) -> torch.Tensor:
    """One chunk ``(B, q)`` of a batch with no padding; logits ``(B, q, V)`` (the last ``keep``
    columns' only, if given); timed into ``times``."""
    return loop.step_batch(
        lm, cache, ids, torch.ones_like(ids, dtype=torch.bool), [] if times is None else times, keep
    )


def _greedy_rows(
    lm: LoadedModel, cache: KVCache, first: torch.Tensor, max_new: int, tpot: list[list[float]]
) -> None:
    """:func:`loop.greedy` for each row of ``first`` ``(B, V)``; each row's steps timed into ``tpot[row]``.

    A row stops at EOS or after ``max_new`` tokens; from then on it is fed as padding.
    """
    tokens = [[int(t)] for t in first.argmax(-1)]
    while active := [r for r, t in enumerate(tokens) if len(t) < max_new and t[-1] != lm.codec.eos_id]:
        real = torch.zeros(len(tokens), 1, dtype=torch.bool)
        real[active] = True
        times: list[float] = []
        ids = torch.tensor([[t[-1]] for t in tokens])
        logits = loop.step_batch(lm, cache, ids, real, times, decode=True)
        for r in active:
            tokens[r].append(int(logits[r, -1].argmax()))
            tpot[r].append(times[0])


def check_probe(ds) -> None:
    """The KV-hit probe's settings (before any model loads; a layer index past the model's last
    is refused once it has loaded)."""
    if not isinstance(ds.get("kv_hit", True), bool):
        raise ConfigError(f"dataset.kv_hit={ds.kv_hit!r}: must be true or false")
    queries = ds.get("kv_hit_queries", 4)
    if not isinstance(queries, int) or isinstance(queries, bool) or queries < 1:
        raise ConfigError(f"dataset.kv_hit_queries={queries!r}: must be an integer >= 1")
    layers = ds.get("kv_hit_layers")
    if layers is not None and (
        not OmegaConf.is_list(layers)
        or not len(layers)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
    ):
        raise ConfigError(
            f"dataset.kv_hit_layers={layers!r}: must be null (every layer) or a list of layer indices >= 0"
        )


def make_probe(lm: LoadedModel, stack: Stack, cfg) -> HitProbe | None:
    """The cell's KV-hit probe: none for the baseline or with ``kv_hit: false``."""
    if not stack.order or not cfg.get("kv_hit", True):
        return None
    layers = cfg.get("kv_hit_layers")
    if layers is not None and max(layers) >= lm.num_layers:
        raise ConfigError(
            f"dataset.kv_hit_layers={list(layers)}: {max(layers)} is past the model's last layer "
            f"({lm.num_layers - 1})"
        )
    return HitProbe(
        queries_per_chunk=int(cfg.get("kv_hit_queries", 4)),
        layers=None if layers is None else frozenset(int(i) for i in layers),
    )


def evaluate(
    lm: LoadedModel,
    stack: Stack,
    ids: list[int],
    cfg,
    baseline: list[WindowResult] | None,
    keep_logprobs: bool = False,
) -> tuple[Metrics, list[WindowResult]]:
    """All windows of one cell; returns (metrics, per-window results)."""
    probe = make_probe(lm, stack, cfg)
    size = int(cfg.get("batch_size", 1))
    wins = windows(ids, cfg)
    results: list[WindowResult] = []
    bar = tqdm(total=len(wins), desc="perplexity windows", leave=False, disable=None)
    for start in range(0, len(wins), size):
        group = wins[start : start + size]
        refs = [
            baseline[w].logprobs if baseline is not None else None for w in range(start, start + len(group))
        ]
        if size == 1:  # the unbatched path, unchanged
            results.append(score_window(lm, stack, group[0], cfg, refs[0], probe, keep_logprobs))
        else:
            results.extend(score_windows(lm, stack, group, cfg, refs, probe, keep_logprobs))
        bar.update(len(group))
    bar.close()
    return summarize(results, baseline, probe), results


def _total(results: list[WindowResult], name: str) -> float:
    return float(sum(getattr(r, name) for r in results))


def summarize(
    results: list[WindowResult], baseline: list[WindowResult] | None, probe: HitProbe | None
) -> Metrics:
    nll = torch.cat([r.nll for r in results])
    tpot = [t for r in results for t in r.tpot]
    m = Metrics(
        score=Score("perplexity", float(nll.mean().exp()), higher_is_better=False),
        n_examples=len(results),
        # all reference bytes over all stored bytes: x the mean stored MB, the mean reference MB
        compression_prefill=_total(results, "reference_prefill") / _total(results, "bytes_prefill"),
        compression_mean=float(np.mean([c for r in results for c in r.compression_chunks])),
        kv_mem_mb_prefill=float(np.mean([r.bytes_prefill for r in results])) / 2**20,
        kv_mem_mb_peak=max(r.bytes_peak for r in results) / 2**20,
        kv_resident_mb_peak=max(r.resident_peak for r in results) / 2**20,
        ttft_s=float(np.mean([r.ttft for r in results])),
        tpot_s=float(np.mean(tpot)) if tpot else None,
        throughput_tok_s=len(tpot) / float(np.sum(tpot)) if tpot else None,
        extra={"nll": float(nll.mean()), "n_scored_tokens": int(nll.numel())},
    )
    if probe is not None:
        m.kv_hit, m.kv_hit_excl = probe.result()
    if baseline is not None:
        base = [c for r in baseline for c in r.chunk_nll]
        mine = [c for r in results for c in r.chunk_nll]
        m.accuracy_drop, m.delta_nll = metrics.perplexity_drop(base, mine)
        m.kl = float(np.mean([k for r in results for k in r.kl]))
        m.top1_agreement = float(np.mean([a for r in results for a in r.top1]))
    return m


class Perplexity:
    """``dataset.task: perplexity`` over a corpus (``pydoc``, ``wikitext2``, ``pg19``, ``c4``, files)."""

    task = "perplexity"

    def validate(self, cfg, order: int) -> None:
        ds = cfg.dataset
        for key in ("prefill", "chunk", "chunks_per_window", "windows"):
            if int(ds[key]) < 1:
                raise ConfigError(f"dataset.{key}={ds[key]}: must be >= 1")
        if ds.decode_steps < 0:
            raise ConfigError(f"dataset.decode_steps={ds.decode_steps}: must be >= 0")
        check_probe(ds)
        if ds.chunk > cfg.window and order:
            raise ConfigError(
                f"dataset.chunk={ds.chunk}: must be <= window ({cfg.window}) (docs/methods.md: C <= window)"
            )
        corpus.validate(ds)
        size = corpus.size_bound(ds)
        if size is not None:  # the exact check waits for the tokenizer (windows())
            check_windows(ds, size, exact=False)

    def load(self, ds) -> Dataset:
        return load_corpus(ds)

    def evaluate(self, lm: LoadedModel, stack: Stack, text: str, ds, baseline) -> Evaluation:
        m, wins = evaluate(lm, stack, lm.codec.encode(text), ds, baseline, keep_logprobs=not stack.order)
        examples = [
            {"window": i, "nll": float(w.nll.mean()), "chunk_nll": w.chunk_nll} for i, w in enumerate(wins)
        ]
        return Evaluation(m, examples, baseline=wins, per_layer_bytes=wins[-1].per_layer_prefill)


PROTOCOL = Perplexity()
