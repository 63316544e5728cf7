"""kvbench's own ``lora_plus_plus``: ``lora``'s calibrated latents with separate key and value
ranks, stored as int8 or int4 codes.

Each token leaving the full-precision window is projected on the calibrated per-head bases of
``lora`` (Palu, arXiv:2407.21118; the same artifact is reused), then each latent vector is
quantized along its own width with one float16 (zero, step) per token and packed: per token
``(rk + rv) · bits / 8`` bytes of codes plus 8 bytes of parameters; the bases count once per layer.
As in ``lora``, the tokens past the window leave it in whole groups of ``move_group`` (Palu's
quantized cache quantizes its full-precision residual in whole blocks too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.cache.surface import TechniqueStore
from kvbench.compressors.lowrank import LatentCache, check_rank
from kvbench.errors import ConfigError
from kvbench.roles import BindContext, Compressor, Flags

LATENT_BITS = (4, 8)


@dataclass
class LoraPlusPlusCompressor(Compressor):
    """Calibrated low-rank latents quantized to ``latent_bits``.

    Args:
        key_rank: latent width of pre-RoPE keys, 1 to head_dim (even for 4 bits).
        value_rank: latent width of values, 1 to head_dim (even for 4 bits).
        latent_bits: 8 or 4 bits per latent code.
        calibration_tokens: tokens of calibration text the bases are fitted on.
        move_group: the tokens past the full-precision window leave it in whole groups of this
            many (the window then holds up to ``move_group - 1`` tokens more); 1: each token as it
            leaves.
    """

    name: str = "lora_plus_plus"
    # 2: packed latents, resident bytes at the buffers' capacity; 3: a long decode step read as one
    # softmax over the latents and the full-precision rows (issue 29, CHANGELOG.md);
    # 4: a bare decode step decodes the layer without a view: resident bytes only (issue 29);
    # 5: the tokens past the window leave it in whole groups of ``move_group`` (issue 29)
    # 6: the window's logits in the keys' dtype (bfloat16/float16 only, CHANGELOG.md);
    # 7: float32 bases, the key basis also in the rotation's pairs order, held once a layer (not
    # converted or gathered at every step): resident bytes only
    version = 7
    key_rank: int = 16
    value_rank: int = 32
    latent_bits: int = 8
    calibration_tokens: int = 2048
    move_group: int = 16
    flags = Flags(changes_representation=True)
    cache: LatentCache = field(init=False, repr=False)  # the bases and the latents' accounting, once bound

    def check_knobs(self) -> None:
        if self.latent_bits not in LATENT_BITS:
            raise ConfigError(f"compressor.latent_bits={self.latent_bits}: allowed 4, 8")
        for key in ("key_rank", "value_rank"):
            rank = getattr(self, key)
            check_rank(f"compressor.{key}", rank)
            if rank * self.latent_bits % 8:
                raise ConfigError(f"compressor.{key}={rank}: must be even to pack 4-bit latents")
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
            bits=self.latent_bits,
            move_group=self.move_group,
        )

    def compress(self, layer: int, store: TechniqueStore) -> None:
        self.cache.compress(layer, store, self.budget)

    def metrics(self) -> dict[str, float | list[float] | None]:
        return self.cache.metrics() if hasattr(self, "cache") else {}
