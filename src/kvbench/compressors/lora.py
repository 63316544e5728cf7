"""Palu's data-aware low-rank latent cache: calibrated per-head bases for pre-RoPE keys and values
(arXiv:2407.21118).

Each token leaving the full-precision window is stored as latents ``K_pre · U_k`` ``(rk,)`` and
``V · U_v`` ``(rv,)``, where ``U_k``, ``U_v`` ``(D, r)`` are orthonormal bases per layer and KV head,
fitted once on calibration text (:mod:`kvbench.data.calibration`) as the top principal directions of
that text's pre-RoPE keys and values, saved on disk and reused. The tokens past the window leave it
in whole groups of ``move_group``, as Palu's quantized cache moves its full-precision residual out
in whole blocks. Reads rebuild
``K = rotate(latent_k · U_kᵀ)`` at each token's original position and ``V = latent_v · U_vᵀ``.

Differences from the paper: Palu replaces the key and value projections by low-rank factors
(``W ≈ A·B``) so the latent is computed from the hidden state; kvbench projects the cached keys,
which gives the same latent when ``A = W·U`` (the data-aware decomposition's optimum is the span of
the calibration activations' top directions). Ranks are one per layer (no Fisher rank search), the
decomposition is per KV head (Palu's M-LRD, not its grouped G-LRD), and latents are not quantized
here (see ``lora_plus_plus``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.cache.surface import TechniqueStore
from kvbench.compressors.lowrank import LatentCache, check_rank
from kvbench.errors import ConfigError
from kvbench.roles import BindContext, Compressor, Flags


@dataclass
class LoraCompressor(Compressor):
    """Calibrated low-rank latents of rank ``key_rank`` (keys) and ``value_rank`` (values).

    Args:
        key_rank: latent width of pre-RoPE keys, 1 to head_dim.
        value_rank: latent width of values, 1 to head_dim.
        calibration_tokens: tokens of calibration text the bases are fitted on.
        move_group: the tokens past the full-precision window leave it in whole groups of this
            many (the window then holds up to ``move_group - 1`` tokens more); 1: each token as it
            leaves.
    """

    name: str = "lora"
    # 2: packed latents, resident bytes at the buffers' capacity; 3: a long decode step read as one
    # softmax over the latents and the full-precision rows (issue 29, CHANGELOG.md);
    # 4: a bare decode step decodes the layer without a view: resident bytes only (issue 29);
    # 5: the tokens past the window leave it in whole groups of ``move_group`` (issue 29)
    # 6: the window's logits in the keys' dtype (bfloat16/float16 only, CHANGELOG.md);
    # 7: float32 bases, the key basis also in the rotation's pairs order, held once a layer (not
    # converted or gathered at every step): resident bytes only
    version = 7
    key_rank: int = 32
    value_rank: int = 32
    calibration_tokens: int = 2048
    move_group: int = 16
    flags = Flags(changes_representation=True)
    cache: LatentCache = field(init=False, repr=False)  # the bases and the latents' accounting, once bound

    def check_knobs(self) -> None:
        check_rank("compressor.key_rank", self.key_rank)
        check_rank("compressor.value_rank", self.value_rank)
        if self.calibration_tokens < 1:
            raise ConfigError(f"compressor.calibration_tokens={self.calibration_tokens}: must be >= 1")
        check_rank("compressor.move_group", self.move_group)

    def on_bind(self, ctx: BindContext) -> None:
        self.cache = LatentCache.bind(
            ctx,
            self.name,
            self.key_rank,
            self.value_rank,
            self.calibration_tokens,
            bits=None,
            move_group=self.move_group,
        )

    def compress(self, layer: int, store: TechniqueStore) -> None:
        self.cache.compress(layer, store, self.budget)

    def metrics(self) -> dict[str, float | list[float] | None]:
        return self.cache.metrics() if hasattr(self, "cache") else {}
