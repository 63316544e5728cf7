"""Long-context figures of every technique on a CPU model with Llama-3.1-8B's attention shapes.

A random Llama with 32 query and 8 KV heads of head_dim 128 and Llama-3's 128,256-token vocabulary
(4 layers, hidden size 1024, float32): small enough for the CPU, shaped like the model users run.
Per technique, alone at --budget, as a cell builds it, after a --prefill-token prefill and
--decode greedy steps (the first discarded):

- largest allocation of the prefill (the model's and kvbench's, recorded through torch's dispatch
  hooks; the logits are one row, as the protocols ask);
- host synchronisations per layer per decode step (scalar reads, value-sized results, boolean
  indexing: tests/tracking.HostSyncs; on the CPU ``.tolist()`` and ``.cpu()`` are no operators and
  go uncounted, so the figure is a floor);
- stored bytes (the format's, ``cache.nbytes()``) and resident bytes (every tensor the cache holds,
  ``cache.resident_bytes()``) at the end.

    python scripts/long_context_figures.py [--prefill 1024] [--decode 5] [--only scheduler/h2o,...]
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch
from hydra import initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]

import bench_overhead as bo  # noqa: E402
from kvbench import config, models  # noqa: E402
from kvbench.cache import held  # noqa: E402
from kvbench.eval import loop  # noqa: E402
from tracking import Allocations, HostSyncs  # noqa: E402

SHAPED = {
    "name": "llama8b_shaped",
    "source": "tiny",
    "family": "llama",
    "seed": 0,
    "dtype": "float32",
    "device_map": None,
    "description": "Llama-3.1-8B's attention and vocabulary, 4 small layers",
    "config": {
        "vocab_size": 128256,
        "hidden_size": 1024,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
    },
}


def figures(lm, stack, ids: list[int], decode: int) -> dict[str, float]:
    cache = loop.new_cache(lm, stack)
    # the last row's logits, as the protocols ask (a kvbench without ``keep`` computes every row)
    keep = {"keep": 1} if "keep" in inspect.signature(loop.step).parameters else {}
    with Allocations() as seen:
        logits = loop.step(lm, cache, ids, **keep)
    tok = int(logits[-1].argmax())
    logits = loop.step(lm, cache, [tok])
    tok = int(logits[-1].argmax())
    with HostSyncs() as syncs:
        for _ in range(decode - 1):
            tok = int(loop.step(lm, cache, [tok])[-1].argmax())
    resident = held.resident_bytes([cache.stores, cache.shadow])  # cache.resident_bytes(), on any kvbench
    return {
        "largest_mb": seen.largest() / 2**20,
        "syncs": (syncs.count - (decode - 1)) / (lm.num_layers * (decode - 1)),  # less the argmax read
        "stored_mb": cache.nbytes() / 2**20,
        "resident_mb": resident / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--only", default="", help="comma-separated role/name (default: the whole catalog)")
    args = ap.parse_args()
    torch.manual_seed(0)
    lm = models.load(OmegaConf.create(SHAPED), "cpu")
    ids = torch.randint(0, SHAPED["config"]["vocab_size"], (args.prefill,)).tolist()
    names = [n for n in args.only.split(",") if n] or bo.catalog()
    config.register()
    head = ("technique", "largest MB", "syncs/layer/step", "stored MB", "resident MB")
    print(f"{head[0]:28s} {head[1]:>10s} {head[2]:>16s} {head[3]:>10s} {head[4]:>11s}")
    with initialize_config_dir(config_dir=str(bo.CONF), version_base="1.3"):
        for name in [None, *names]:
            row = figures(lm, bo.build_cell_stack(lm, name, args.budget), ids, args.decode)
            print(
                f"{name or 'full cache':28s} {row['largest_mb']:10.1f} {row['syncs']:16.1f} "
                f"{row['stored_mb']:10.2f} {row['resident_mb']:11.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
