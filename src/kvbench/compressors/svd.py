"""ShadowKV's low-rank pre-RoPE key cache: truncated SVD per block of tokens (arXiv:2410.21465).

Tokens leave the full-precision window in blocks of ``block_size`` per KV head (sinks and the
window stay). Per layer, KV head and block, the pre-RoPE keys ``K`` ``(n, D)`` are factored by a
truncated SVD, ``K ≈ A·Bᵀ`` with ``A = U_r S_r`` ``(n, r)`` stored per token and ``B = V_r``
``(D, r)`` per block; values likewise with their own rank, or kept at full precision
(``value_rank: null``). Reads rebuild ``K = rotate(A·Bᵀ)`` at each token's original position.
Evicting a token frees its row of ``A``; a block's ``B`` goes with its last token.

Differences from the paper: ShadowKV factors the whole prefill's pre-RoPE keys once, one SVD per
layer over all heads together, offloads values to the CPU instead of factoring them, and reads a
sparse set of chunks chosen through landmarks and outliers. kvbench (following docs/methods.md) factors
per KV head, block by block as tokens leave the window, also factors values (separately, at a
higher rank: they are far less low-rank), and reads every stored token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.cache import partials, ragged
from kvbench.cache.rotary import Rotary
from kvbench.cache.segments import GroupedSegment, as_float
from kvbench.cache.surface import TechniqueStore
from kvbench.compressors.lowrank import Residual, check_rank, pre_rope
from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.roles import BindContext, Compressor, Flags
from kvbench.select import leaving_groups, moving_per_row


@dataclass
class SVDSegment(GroupedSegment):
    """Factored blocks. Per token: ``ka`` ``(N, rk)``, ``va`` ``(N, rv)`` (or full values ``(N, D)``
    when ``vb`` is None). Per block: ``kb`` ``(M, D, rk)``, ``vb`` ``(M, D, rv)``, ``gcount`` ``(M,)``."""

    rotary: Any = None
    ka: torch.Tensor = None  # type: ignore[assignment]
    va: torch.Tensor = None  # type: ignore[assignment]
    kb: torch.Tensor = None  # type: ignore[assignment]
    vb: torch.Tensor | None = None

    def layout(self) -> tuple[Any, ...]:
        return (self.ka.shape[1:], self.va.shape[1:], None if self.vb is None else self.vb.shape[1:])

    def data_fields(self) -> dict[str, torch.Tensor]:
        return {"ka": self.ka, "va": self.va}

    def group_fields(self) -> dict[str, torch.Tensor]:
        return {"kb": self.kb} if self.vb is None else {"kb": self.kb, "vb": self.vb}

    def expand(self, a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """Per-token factors ``(N, r)`` times their block's ``(M, D, r)``: float32 ``(N, D)``.

        ``block``: every block holds that many tokens (as when factored), so no padding is needed.
        """
        if block is not None:
            return torch.bmm(as_float(a).view(-1, block, a.shape[-1]), as_float(b).transpose(1, 2)).flatten(
                0, 1
            )
        p, valid = ragged.to_padded(as_float(a), self.gcount.long())  # (M, n, r)
        return ragged.from_padded(torch.bmm(p, as_float(b).transpose(1, 2)), valid)

    def torch_partials(self) -> bool:
        return self.rows.width >= partials.PARTIAL_MIN_SLOTS  # (a head-row holds at most width)

    def attend_partials(self, query: torch.Tensor, scaling: float, batch: int) -> Any:
        """For head-rows of the same length in full blocks. On the Triton path, the fused kernel
        (:mod:`kvbench.kernels.svd_decode`: keys rebuilt from the factors and rotated in registers,
        values summed in factor space and expanded once per block). On the torch path (at least
        :data:`kvbench.cache.partials.PARTIAL_MIN_SLOTS` tokens a head-row): keys rebuilt and
        rotated as :meth:`read` does; values kept factored, the output summed per block in factor
        space and expanded once per block (:func:`kvbench.cache.partials.partial`). None otherwise
        (the step is decoded)."""
        block, n = self.full_groups(), self.row_count()
        if block is None or not n or n % block:
            return None
        kernel = dispatch.kernels("svd_decode", batch, n)
        if kernel is not None:
            heads = self.lens.numel() // batch
            return kernel.partials(
                query, self.ka, self.va, self.pos, self.kb, self.vb, self.rotary, heads, block, scaling
            )
        if n < partials.PARTIAL_MIN_SLOTS:
            return None
        if dispatch.kernels("attention", batch, n) is not None:
            return None
        k = self._keys(block, n)
        shape = (batch, self.lens.numel() // batch, n, -1)
        basis = None if self.vb is None else self.vb.view(*shape[:2], n // block, *self.vb.shape[1:])
        return partials.partial(query, k.view(shape), self.va.view(shape), scaling, basis=basis)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.full_groups()
        k = self._keys(block, self.row_count())
        v = self.va if self.vb is None else self.expand(self.va, self.vb, block)
        return k.to(dtype), v.to(dtype)

    def _keys(self, block: int | None, per_row: int | None) -> torch.Tensor:
        """Keys ``(N, D)`` float32 rebuilt from the factors and rotated at the stored positions
        (``block``, ``per_row``: as :meth:`expand` and :meth:`Rotary.rotate_rows` take them), by
        :meth:`Rotary.rotate_rebuilt` (its gather of the blocks' ``M·D·r`` values is a quarter of a
        key a token at the default block and rank)."""
        return self.rotary.rotate_rebuilt(
            lambda kb: self.expand(self.ka, kb, block), self.kb, self.pos, per_row
        )


def factor_blocks(x: torch.Tensor, block: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of consecutive blocks of ``block`` rows of ``x`` ``(N, D)``.

    Returns:
        ``A = U_r S_r`` ``(N, rank)`` and ``B = V_r`` ``(N / block, D, rank)``.
    """
    u, s, vh = torch.linalg.svd(x.view(-1, block, x.shape[-1]), full_matrices=False)
    a = u[..., :rank] * s[:, None, :rank]
    return a.reshape(-1, rank), vh[:, :rank].transpose(1, 2).contiguous()


@dataclass
class SVDCompressor(Compressor):
    """Blockwise truncated SVD of pre-RoPE keys (rank ``key_rank``) and values (``value_rank``).

    Args:
        key_rank: kept singular directions of each key block, at most min(head_dim, block_size).
        value_rank: the same for values; null keeps values at full precision.
        block_size: tokens per factored block (per KV head).
    """

    name: str = "svd"
    # 2: a long decode step read as one softmax over the factored blocks and the full-precision rows
    # (issue 29, CHANGELOG.md); 3: a bare decode step decodes the layer without a view: resident
    # bytes only (issue 29)
    # 4: the window's logits in the keys' dtype (bfloat16/float16 only, CHANGELOG.md)
    version = 4
    key_rank: int = 16
    value_rank: int | None = 32
    block_size: int = 64
    flags = Flags(changes_representation=True)
    rotary: Rotary = field(init=False, repr=False)  # the model's, once bound
    residuals: tuple[Residual, Residual] = field(init=False, repr=False)  # keys', values' factoring error

    def check_knobs(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"compressor.block_size={self.block_size}: must be >= 1")
        check_rank("compressor.key_rank", self.key_rank, self.block_size, "block_size")
        check_rank("compressor.value_rank", self.value_rank, self.block_size, "block_size", nullable=True)

    def on_bind(self, ctx: BindContext) -> None:
        self.rotary = ctx.rotary()
        check_rank("compressor.key_rank", self.key_rank, ctx.head_dim, "head_dim")
        check_rank("compressor.value_rank", self.value_rank, ctx.head_dim, "head_dim", nullable=True)
        self.residuals = (Residual(), Residual())

    def compress(self, layer: int, store: TechniqueStore) -> None:
        move = leaving_groups(store, self.budget, self.block_size)
        if move is not None:
            store.move_out(move, self._factor, per_row=moving_per_row(store, self.budget, self.block_size))

    def _factor(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor) -> SVDSegment:
        n, dtype = self.block_size, k.dtype
        kpre = pre_rope(self.rotary, k, pos)
        ka, kb = factor_blocks(kpre, n, self.key_rank)
        if self.value_rank is None:
            va, vb = v, None
        else:
            va, vb = factor_blocks(as_float(v), n, self.value_rank)
            vb = vb.to(dtype)
        seg = SVDSegment(
            lens=lens,
            pos=pos,
            rotary=self.rotary,
            ka=ka.to(dtype),
            va=va.to(dtype),
            kb=kb.to(dtype),
            vb=vb,
            gcount=ragged.tell(torch.full((kb.shape[0],), n, dtype=torch.int16, device=k.device), n),
            glens=ragged.groups_of(lens, n),
        )
        # What is stored, rebuilt for the residuals.
        krebuilt = seg.expand(seg.ka, seg.kb, n)
        self.residuals[0].add(kpre, krebuilt)
        vrebuilt = seg.va
        if seg.vb is not None:
            vrebuilt = seg.expand(seg.va, seg.vb, n)
            self.residuals[1].add(v, vrebuilt)
        return seg

    def metrics(self) -> dict[str, float | list[float] | None]:
        """Relative squared error of the pre-RoPE keys and values factored so far (values: None at
        full precision)."""
        if not hasattr(self, "residuals"):
            return {}
        return {"key_residual": self.residuals[0].value(), "value_residual": self.residuals[1].value()}
