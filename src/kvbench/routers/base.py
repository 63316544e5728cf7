"""MoBA-style block routing: contiguous position blocks, each query reads the top-k blocks by
q · mean(K_block) (arXiv:2502.13189). Sinks, the window and the current chunk are always read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.cache.store import LayerStore
from kvbench.errors import ConfigError
from kvbench.roles import Flags, Router


def always_read(budget, store: LayerStore, qpos: torch.Tensor) -> torch.Tensor:
    """``(B, H, T)``: sinks, the window before the chunk, protected positions and the chunk itself.

    ``qpos`` ``(B, q)``: the chunk of each sequence starts at its first real query.
    """
    view = store.view()
    real = qpos >= 0
    first = torch.where(real, qpos, torch.full_like(qpos, torch.iinfo(qpos.dtype).max)).amin(-1)
    chunk_start = torch.where(real.any(-1), first, store.seen)[:, None, None]
    return budget.protected(view.pos, chunk_start, store.view_protect_from()) | (view.pos >= chunk_start)


def position_blocks(pos: torch.Tensor, routable: torch.Tensor, experts: int) -> torch.Tensor:
    """Expert id of each routable token: ``experts`` contiguous position blocks per head-row.

    Args:
        pos: ``(B, H, T)`` positions; routable: ``(B, H, T)`` bool.

    Returns:
        ``(B, H, T)`` long, -1 where not routable.
    """
    key = torch.where(routable, pos, torch.full_like(pos, torch.iinfo(pos.dtype).max))
    rank = key.argsort(-1).argsort(-1)
    n = routable.sum(-1, keepdim=True).clamp(min=1)
    eid = rank * experts // n
    return torch.where(routable, eid, torch.full_like(eid, -1))


@dataclass
class BaseRouter(Router):
    """Splits each layer's stored tokens into ``num_experts`` position blocks; reads ``top_k``."""

    name: str = "base"
    num_experts: int = 8
    top_k: int = 2
    flags = Flags(selects_reads=True)
    reads: torch.Tensor | None = field(default=None, repr=False)
    read_tokens: list[float] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"router.num_experts={self.num_experts}: must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"router.top_k={self.top_k}: must be in 1..num_experts ({self.num_experts})")

    def read_mask(
        self, layer: int, store: LayerStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        view = store.view()
        routable = view.valid & ~always_read(self.budget_cfg, store, qpos)
        eid = position_blocks(view.pos, routable, self.num_experts)
        b, h, t, d = view.k.shape
        onehot = torch.zeros(b, h, t, self.num_experts, device=view.k.device)
        onehot.scatter_(-1, eid.clamp(min=0)[..., None], routable[..., None].float())
        count = onehot.sum(2)  # (B, H, E)
        centroid = torch.einsum("bhte,bhtd->bhed", onehot, view.k.float()) / count.clamp(min=1)[..., None]
        grouped = query.float().view(b, h, -1, query.shape[2], d)
        score = torch.einsum("bhgqd,bhed->bhqe", grouped, centroid)
        score = score.masked_fill(count[:, :, None, :] == 0, float("-inf"))
        k = min(self.top_k, self.num_experts)
        chosen = torch.zeros_like(score, dtype=torch.bool).scatter(-1, score.topk(k, dim=-1).indices, True)
        chosen &= count[:, :, None, :] > 0
        self._account(chosen, routable, eid)
        token_read = torch.gather(
            chosen, -1, eid.clamp(min=0)[:, :, None, :].expand(-1, -1, query.shape[2], -1)
        )
        return token_read | ~routable[:, :, None, :]

    def _account(self, chosen: torch.Tensor, routable: torch.Tensor, eid: torch.Tensor) -> None:
        per_expert = chosen.sum((0, 1, 2)).float().cpu()
        self.reads = per_expert if self.reads is None else self.reads + per_expert
        size = torch.zeros(*eid.shape[:2], self.num_experts, device=eid.device)
        size.scatter_add_(-1, eid.clamp(min=0), routable.float())
        read = (chosen.float() * size[:, :, None, :]).sum(-1)  # routable tokens read per query
        self.read_tokens.append(float((read / routable.sum(-1, keepdim=True).clamp(min=1)).mean()))

    def metrics(self) -> dict[str, float | list[float] | None]:
        if self.reads is None:
            return {}
        mean = float(self.reads.mean())
        return {
            "reads_per_expert": self.reads.tolist(),
            "load_imbalance": float(self.reads.max()) / mean if mean else None,
            "routable_read_fraction": sum(self.read_tokens) / len(self.read_tokens),
        }
