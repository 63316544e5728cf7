"""PyramidKV (arXiv:2406.02069): SnapKV with an arithmetic schedule of capacity across layers,
the lower layers keeping more than the mean and the top layer ``1 / beta`` of it.

Not to be confused with ``compressor=pyramid`` (KIVI with bits falling across layers,
:mod:`kvbench.compressors.pyramid`) or ``allocation=pyramid`` (the schedule itself, which any
allocated technique can take, :mod:`kvbench.allocation`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.compressors.snapkv import SnapKVCompressor
from kvbench.errors import ConfigError


@dataclass
class PyramidKVCompressor(SnapKVCompressor):
    """SnapKV with PyramidKV's arithmetic layer schedule; any other allocation is refused."""

    name: str = "pyramidkv"
    # 2: the decode step of issue 29; 3: a selection kept where the slots are out of position order
    # breaks ties by position, as its evictions do (CHANGELOG.md)
    # 4: its logits in the keys' dtype (bfloat16/float16 only, CHANGELOG.md)
    version = 4
    allocation: str = "pyramid"

    def check_knobs(self) -> None:
        if self.allocation != "pyramid":
            raise ConfigError(
                f"compressor.allocation={self.allocation}: pyramidkv is snapkv with allocation=pyramid; "
                "use compressor=snapkv for other allocations"
            )
