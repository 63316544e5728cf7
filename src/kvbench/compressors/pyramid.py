"""kvbench's own ``pyramid``: KIVI with bits per layer falling from ``bits_max`` to ``bits_min``.

Layer ``l`` of ``L`` gets ``bits_max - (bits_max - bits_min) · l / (L - 1)`` bits, rounded down to a
supported width (2, 3, 4 or 8): the first layer keeps ``bits_max``, the last ``bits_min``. Each
layer is then KIVI (arXiv:2402.02750, :mod:`kvbench.compressors.quantized`) at its width: keys per
channel and values per token in groups of ``group_size``, real packed storage, sinks and the window
at full precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from kvbench.cache import quant
from kvbench.cache.surface import TechniqueStore
from kvbench.compressors.quantized import quantizer
from kvbench.errors import ConfigError
from kvbench.roles import BindContext, Compressor, Flags
from kvbench.select import leaving_groups, moving_per_row


def layer_bits(num_layers: int, bits_max: int, bits_min: int) -> list[int]:
    """Bits of each layer: linear from ``bits_max`` (first) to ``bits_min`` (last), rounded down."""
    out = []
    for layer in range(num_layers):
        exact = bits_max - (bits_max - bits_min) * Fraction(layer, max(num_layers - 1, 1))
        out.append(max(b for b in quant.SUPPORTED_BITS if b <= exact))
    return out


@dataclass
class PyramidCompressor(Compressor):
    """KIVI at ``bits_max`` bits in the first layer down to ``bits_min`` in the last.

    Args:
        bits_max: bits of the first layer (2, 3, 4 or 8).
        bits_min: bits of the last layer (2, 3, 4 or 8), at most ``bits_max``.
        group_size: KIVI's group of tokens (keys) and of channels (values).
    """

    name: str = "pyramid"
    # 2: a bare decode step decodes the layer without a view (its joined positions are not
    # kept up to date at every step): resident bytes only (issue 29, CHANGELOG.md)
    version = 2
    bits_max: int = 8
    bits_min: int = 2
    group_size: int = 32
    flags = Flags(changes_representation=True)
    bits: list[int] = field(default_factory=list, init=False)  # per layer, once bound

    def check_knobs(self) -> None:
        allowed = ", ".join(map(str, quant.SUPPORTED_BITS))
        for key in ("bits_max", "bits_min"):
            if getattr(self, key) not in quant.SUPPORTED_BITS:
                raise ConfigError(f"compressor.{key}={getattr(self, key)}: allowed {allowed}")
        if self.bits_min > self.bits_max:
            raise ConfigError(f"compressor.bits_min={self.bits_min}: must be <= bits_max={self.bits_max}")
        if self.group_size < 1:
            raise ConfigError(f"compressor.group_size={self.group_size}: must be >= 1")

    def on_bind(self, ctx: BindContext) -> None:
        self.bits = layer_bits(ctx.num_layers, self.bits_max, self.bits_min)

    def compress(self, layer: int, store: TechniqueStore) -> None:
        move = leaving_groups(store, self.budget, self.group_size)
        if move is not None:
            per_row = moving_per_row(store, self.budget, self.group_size)
            quantize = quantizer(self.bits[layer], self.bits[layer], self.group_size)
            store.move_out(move, quantize, per_row=per_row)
