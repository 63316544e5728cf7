"""What every router shares (:class:`ExpertRouter`): which tokens are routable, expert centroids
and sizes, per-KV-head scores summed over the query group, the token read mask built from the
chosen experts, and the measured read figures; and :class:`PositionExperts`, experts as
contiguous position blocks (``base``, ``adaptive``, ``hierarchical``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F

from kvbench.cache import attention as att
from kvbench.cache import devices
from kvbench.cache.reads import ReadCount, ReadMeter, count_reads, one_step
from kvbench.cache.surface import TechniqueStore, chunk_start, every_query_real, protected_from
from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.roles import Flags, Router

T = TypeVar("T")


def expert_ids(experts: int, like: torch.Tensor) -> torch.Tensor:
    """``arange(experts)`` on ``like``'s device (read-only: :func:`kvbench.cache.devices.arange`)."""
    return devices.arange(experts, like)


_SCALAR: dict[object, tuple[float, torch.Tensor]] = {}


# Whole numbers below this are exact in float32, as an element of an arange of float32.
EXACT_F32 = 1 << 24


def host_scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d float32 tensor of ``value`` on ``like``'s device; read-only. A whole number below
    :data:`EXACT_F32` is an element of the device's held float32 arange (a view: no launch; the
    arange, kept for the process, grows to twice the largest value asked, 8 bytes a routed token),
    any other value made once while it is the last one asked for there."""
    if float(value).is_integer() and 0 <= value < EXACT_F32:
        return devices.whole(int(value), like, torch.float32)
    key = devices.device_of(like)
    held = _SCALAR.get(key)
    if held is None or held[0] != value:
        held = _SCALAR[key] = (value, torch.full((), value, dtype=torch.float32, device=like.device))
    return held[1]


def routable_tokens(budget, store: TechniqueStore, qpos: torch.Tensor) -> torch.Tensor:
    """``(B, H, T)``: the stored tokens a router routes, every valid one but those always read (the
    sinks, the window before the chunk, protected positions and the chunk itself).

    ``qpos`` ``(B, q)``: the chunk of each sequence starts at its first real query; the chunk lies
    after the window before it, so ``pos < start - window`` excludes both.
    """
    view = store.view()
    pos = view.pos
    start = chunk_start(store, qpos)[:, None, None]
    out = view.valid & (pos >= budget.sinks) & (pos < start - budget.window)
    protect_from = protected_from(store)
    return out if protect_from is None else out & (pos < protect_from)


def unprotected_columns(budget, store: TechniqueStore, seen: int) -> tuple[int, int] | None:
    """The columns ``lo .. hi - 1`` of every head-row that hold the unprotected tokens of a store
    whose slots each hold their own position, for protection at ``seen`` tokens (sinks, the window
    before ``seen``, one protected start): host figures; None where sequences protect from
    different starts."""
    protect = store.protect_from_host
    if protect is not None and len(set(protect)) > 1:
        return None
    hi = seen - budget.window
    if protect is not None:
        hi = min(hi, protect[0])
    return budget.sinks, max(hi, budget.sinks)


def routable_columns(budget, store: TechniqueStore, qpos: torch.Tensor) -> tuple[int, int] | None:
    """:func:`routable_tokens` as host figures where every slot holds its own position and ``qpos``
    is the whole last chunk (:meth:`LayerStore.position_key`) with one protected start: the
    routable tokens are then the columns ``lo .. hi - 1`` of every head-row. None elsewhere."""
    if store.position_key(qpos) is None:
        return None
    return unprotected_columns(budget, store, store.seen_max - qpos.shape[1])  # the chunk starts at seen - q


def routable_mask(budget, store: TechniqueStore, qpos: torch.Tensor) -> torch.Tensor:
    """:func:`routable_tokens`, made from the host's columns where they are known
    (:func:`routable_columns`): one row, viewed as every head-row's."""
    cols = routable_columns(budget, store, qpos)
    if cols is None:
        return routable_tokens(budget, store, qpos)
    width = store.columns()
    row = torch.zeros(width, dtype=torch.bool, device=store.device)
    row[cols[0] : cols[1]] = True
    return row.expand(store.batch, store.kv_heads, width)


def paged_columns(
    budget, store: TechniqueStore, qpos: torch.Tensor, k: int, experts: int
) -> tuple[int, int] | None:
    """The routed columns of a step a router hands by pages (``read_pages``): a one-token step
    whose routed columns are host figures (:func:`routable_columns`), where a query reads fewer
    than all ``experts`` (at most ``k``); None elsewhere (the engine then asks ``read_mask``)."""
    if k >= experts or not one_step(store, qpos):
        return None
    return routable_columns(budget, store, qpos)


def first_chosen(chosen: torch.Tensor, k: int, then: int | None = None) -> torch.Tensor:
    """The experts each query reads, in order, from ``chosen`` ``(B, H, q, E)`` (at most ``k`` a
    query): ``(B, H, q, k)``, -1 after the last; with ``then``, one more column holding it."""
    experts = chosen.shape[-1]
    first = torch.where(chosen, expert_ids(experts, chosen), experts)
    first = first.topk(k if then is None else k + 1, largest=False).values
    head = first[..., :k]
    head.masked_fill_(head == experts, -1)
    if then is not None:
        first[..., k] = then
    return first


def position_blocks(
    pos: torch.Tensor, routable: torch.Tensor, experts: int, ordered: bool = False
) -> torch.Tensor:
    """Expert id of each routable token: ``experts`` contiguous position blocks per head-row.

    Args:
        pos: ``(B, H, T)`` positions; routable: ``(B, H, T)`` bool.
        ordered: positions increase along T (:meth:`LayerStore.in_position_order`), so a token's
            rank is a running count instead of two sorts.

    Returns:
        ``(B, H, T)`` long, -1 where not routable.
    """
    if ordered:
        rank = routable.long().cumsum(-1)  # 1 + rank of each routable token
        n = rank[..., -1:].clamp(min=1)
        rank = rank - 1
    else:
        key = torch.where(routable, pos, torch.full_like(pos, torch.iinfo(pos.dtype).max))
        rank = key.argsort(-1).argsort(-1)
        n = routable.sum(-1, keepdim=True).clamp(min=1)
    eid = rank * experts // n
    return torch.where(routable, eid, -1)


def expert_onehot(eid: torch.Tensor, member: torch.Tensor | None, experts: int) -> torch.Tensor:
    """``(B, H, T, E)`` float: 1 where token ``t`` is a ``member`` of expert ``eid`` (a member's
    ``eid`` is an expert, ``>= 0``); ``member`` None: every token whose ``eid`` is not -1."""
    onehot = eid[..., None] == expert_ids(experts, eid)
    return (onehot if member is None else onehot & member[..., None]).float()


def expert_counts(eid: torch.Tensor, experts: int) -> torch.Tensor:
    """``(B, H, E)`` float: tokens routed to each expert (``eid`` -1 or ``experts``: none)."""
    return (eid[..., None] == expert_ids(experts, eid)).sum(-2, dtype=torch.float32)


def expert_sums(onehot: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Sum of each expert's keys ``(B, H, E, D)``; ``onehot`` ``(B, H, T, E)``, keys ``(B, H, T, D)``."""
    return onehot.transpose(-1, -2) @ keys.float()


def weighted_keys(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``(B, H, E, D)``: the keys ``(B, H, T, D)`` summed per expert with ``weights`` ``(B, H, T,
    E)`` of the keys' dtype, one product taken in that dtype (float32 sums, rounded to it once in
    a bfloat16 or float16 model): no float32 copy of the keys, which a decode step would write at
    every layer, as large as the keys (issue 29)."""
    return weights.transpose(-1, -2) @ keys


def block_means(keys: torch.Tensor, eid: torch.Tensor, member: torch.Tensor, experts: int) -> torch.Tensor:
    """Mean key of each expert's members ``(B, H, E, D)`` fp32 (zero for an empty expert)."""
    onehot = expert_onehot(eid, member, experts)
    return expert_sums(onehot, keys) / onehot.sum(2).clamp(min=1)[..., None]


_NO_CHOICE: dict[tuple[Any, ...], torch.Tensor] = {}


def no_choice(like: torch.Tensor, pad: bool = False) -> torch.Tensor:
    """``(..., E)`` bool, no expert chosen; with ``pad``, ``(..., E + 1)`` with column ``E`` True:
    a choice that carries the always-read column of :attr:`Routing.mask`. Read-only: made once per
    shape, device and padding (a few shapes, a decode step's and a chunk's); :func:`choice_at`
    makes a choice from it."""
    key = (like.shape, devices.device_of(like), pad)
    empty = _NO_CHOICE.get(key)
    if empty is None:
        if len(_NO_CHOICE) >= 64:  # prefills of many lengths: start over rather than grow
            _NO_CHOICE.clear()
        experts = like.shape[-1]
        with torch.inference_mode(False):  # a plain tensor, also when first asked inside a forward
            if pad:
                ids = expert_ids(experts + 1, like)
                empty = ids.expand(*like.shape[:-1], experts + 1) >= experts
            else:
                empty = torch.zeros_like(like, dtype=torch.bool)
        _NO_CHOICE[key] = empty
    return empty


def choice_at(
    like: torch.Tensor, index: torch.Tensor, chosen: torch.Tensor | None = None, pad: bool = False
) -> torch.Tensor:
    """:func:`no_choice` with the experts at ``index`` ``(..., k)`` chosen where ``chosen`` (bool,
    as ``index``; None: all of them): one out-of-place scatter into the held empty choice, not a
    copy of it and a scatter in place."""
    if chosen is None:
        chosen = devices.true_like(index)
    return no_choice(like, pad).scatter(-1, index, chosen)


def pad_choice(chosen: torch.Tensor) -> torch.Tensor:
    """``chosen`` ``(..., E)`` with column ``E`` True, as :func:`no_choice`'s ``pad`` gives it (the
    operation ``F.pad`` calls, without its Python checks)."""
    return torch.constant_pad_nd(chosen, (0, 1), True)


def top_k_choice(score: torch.Tensor, k: int, finite: bool = False, pad: bool = False) -> torch.Tensor:
    """``(..., E)`` bool: the ``k`` best-scored experts; non-finite (empty) experts never chosen.

    ``finite``: known on the host that the ``k`` best scores are finite (every expert holds a
    token), so each is chosen without looking. ``pad``: as :func:`no_choice`'s."""
    best = score.topk(min(k, score.shape[-1]), dim=-1)
    return choice_at(score, best.indices, None if finite else best.values.isfinite(), pad)


def fill_by_preference(
    order: torch.Tensor, allowed: torch.Tensor, need: torch.Tensor, room: torch.Tensor
) -> torch.Tensor:
    """Greedy capacity-limited choice: each item takes its preferred experts that still have room.

    Round ``r`` offers every item still short of ``need`` its ``r``-th preferred expert; an expert
    accepts offers in item order while it has ``room`` (Switch Transformer's overflow to the next
    best expert). An item ends short of ``need`` only when every expert left on its list is full.

    Args:
        order: ``(..., N, E)`` long, experts by preference for each of N items.
        allowed: ``(..., N, E)`` bool (indexed by expert), experts an item may take.
        need: ``(..., N)`` long, experts each item wants (0 for items that want none).
        room: ``(..., E)`` long, items each expert may still accept.

    Returns:
        ``(..., N, E)`` bool, the experts each item took.
    """
    experts = order.shape[-1]
    if order.shape[-2] == 1:  # one item (a decode step): every expert gets one offer at most, so
        # the item takes its first ``need`` allowed experts with room, in its order of preference
        ok = allowed.gather(-1, order) & (room[..., None, :].gather(-1, order) > 0)
        took = ok & (ok.long().cumsum(-1) <= need[..., None])
        return torch.zeros_like(allowed).scatter(-1, order, took)
    chosen = torch.zeros_like(allowed)
    got = torch.zeros_like(need)
    room = room.clone()
    for r in range(experts):
        pick = order[..., r]
        want = (got < need) & allowed.gather(-1, pick[..., None]).squeeze(-1)
        offer = F.one_hot(pick, experts).bool() & want[..., None]
        accept = offer & (offer.long().cumsum(-2) <= room[..., None, :])
        chosen |= accept
        got = got + accept.sum(-1)
        room = room - accept.sum(-2)
    return chosen


class Experts:
    """The experts of the stored tokens at one read, and what derives from them alone, each made
    once when first needed (position blocks: once per step, shared by its layers).

    Attributes:
        column: ``(B, H, 1, T)`` long, the expert of each routed token and ``E`` for the tokens
            always read: the column of :meth:`Routing.mask`'s padded choice each token reads.
        count: ``(B, H, E)`` float, routed tokens per expert.
        none_empty: known on the host that every expert of every head-row holds a token.
        routed_host: the routed tokens of every head-row, where the host knows them.
    """

    def __init__(
        self,
        count: torch.Tensor,
        eid: torch.Tensor | None = None,
        column: torch.Tensor | None = None,
        none_empty: bool = False,
        routed_host: int | None = None,
    ):
        self.count, self.none_empty, self.routed_host = count, none_empty, routed_host
        self._eid, self._column = eid, column  # either given; the other made from it when asked
        self._seen: torch.Tensor | None = None  # :meth:`column_seen`

    @classmethod
    def of(cls, eid: torch.Tensor, experts: int) -> Experts:
        """The experts ``eid`` ``(B, H, T)`` (-1: always read) assigns."""
        return cls(expert_counts(eid, experts), eid=eid)

    @property
    def eid(self) -> torch.Tensor:
        """``(B, H, T)`` long: the expert of each routed token, -1 where always read."""
        if self._eid is None:
            column = self.column[:, :, 0]
            self._eid = column.masked_fill(column == self.count.shape[-1], -1)
        return self._eid

    @property
    def column(self) -> torch.Tensor:
        if self._column is None:
            eid = self.eid
            self._column = torch.where(eid < 0, self.count.shape[-1], eid)[:, :, None, :]
        return self._column

    def column_seen(self, groups: int, q: int) -> torch.Tensor:
        """:attr:`column` seen by ``groups`` query heads a KV head and ``q`` queries (a view,
        :func:`kvbench.cache.attention.group_index`), kept: the layers of a step that share these
        experts share it."""
        seen = self._seen
        if seen is None or seen.shape[2:4] != (groups, q):
            seen = self._seen = att.group_index(self.column, groups, q)
        return seen

    @cached_property
    def empty(self) -> torch.Tensor | None:
        """``(B, H, 1, E)`` bool, the experts without a token; None where none is (known on the host)."""
        return None if self.none_empty else (self.count == 0)[:, :, None, :]

    @cached_property
    def size(self) -> torch.Tensor:
        """``(B, H, E, 1)``: the divisor of a mean over each expert's tokens (1 for an empty one)."""
        return (self.count if self.none_empty else self.count.clamp(min=1))[..., None]

    @cached_property
    def routed(self) -> torch.Tensor:
        """``(B, H, 1)``: routed tokens of each head-row (1 where none), the divisor of a read
        fraction (one value for all where the host knows it)."""
        if self.routed_host is not None:
            return host_scalar(float(max(self.routed_host, 1)), self.count)
        return self.count.sum(-1, keepdim=True).clamp(min=1)


@dataclass
class Routing:
    """One routed read.

    Attributes:
        experts: the stored tokens' experts (:class:`Experts`).
        chosen: ``(B, H, q, E)`` experts each query reads. :meth:`ExpertRouter.choose` may give
            them padded, ``(B, H, q, E + 1)`` with column ``E`` True (:func:`no_choice`): they are
            then its first ``E`` columns, and the padded choice is the mask's, made with the
            choice and not by a pad of its own.
        padded: the padded choice, where ``choose`` gave one.
    """

    experts: Experts
    chosen: torch.Tensor
    padded: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        experts = self.experts.count.shape[-1]
        if self.chosen.shape[-1] == experts + 1:
            self.padded, self.chosen = self.chosen, self.chosen[..., :experts]

    @property
    def eid(self) -> torch.Tensor:
        """``(B, H, T)`` expert of each stored token, -1 where not routed (always read)."""
        return self.experts.eid

    @property
    def count(self) -> torch.Tensor:
        """``(B, H, E)`` routed tokens per expert."""
        return self.experts.count

    @cached_property
    def mask(self) -> torch.Tensor:
        """``(B, H, q, T)``: a routed token is read iff its expert is chosen; the rest always.

        Built once per routing: the read figures and attention both use it."""
        padded, column = self._padded(), self.experts.column
        q = padded.shape[2]
        if column.shape[2] != q:
            column = column.expand(*column.shape[:2], q, column.shape[-1])
        return padded.gather(-1, column)

    def head_mask(self, groups: int) -> torch.Tensor:
        """:attr:`mask` per query head, ``(B, H · groups, q, T)`` for ``groups`` query heads a KV
        head (each its KV head's rows): one gather from the choice seen ``groups`` times, not the
        mask made and then repeated. Not kept: a read asks once."""
        if groups == 1:
            return self.mask
        padded = self._padded()
        return att.gather_per_head(padded, self.experts.column_seen(groups, padded.shape[2]))

    def _padded(self) -> torch.Tensor:
        """The choice with column ``E`` (always read) True: ``(B, H, q, E + 1)``."""
        if self.padded is not None:
            return self.padded
        return pad_choice(self.chosen)


def f32_quotient(a: float, b: float) -> float:
    """``a / b`` of two float32 values rounded to float32, as a float32 division on a device gives
    it: the float64 quotient rounded again is the correctly rounded one (53 >= 2 x 24 bits)."""
    return struct.unpack("f", struct.pack("f", a / b))[0]


@dataclass
class StepReads:
    """A decode step's reads over full rows of one segment, every stored token visible: a query
    reads the tokens always read (those not routed) and the routed ones of its chosen experts,
    each costing the same bytes. Counted when settled, many steps at once.

    Attributes:
        per_token: stored bytes of a token.
        read: ``(B, H, q)`` routed tokens each query reads.
        count: ``(B, H, E)`` routed tokens per expert.
        visible: tokens visible, summed over the queries and head-rows (``B · H · q · T``).
        queries: real queries (``B · q``).
    """

    per_token: int
    read: torch.Tensor | None  # None until its call is settled (:func:`_fill_reads`)
    count: torch.Tensor
    visible: int
    queries: int

    def resolve(self, read: float, routed: float) -> tuple[float, float, float]:
        """:meth:`ReadCount.resolve` from the sums of ``read`` and ``count``."""
        assert self.read is not None
        n_read = int(self.visible - self.read.shape[-1] * routed + read)
        return float(self.per_token * n_read) / max(self.queries, 1), float(n_read), float(self.visible)


def exact_sums(tensors: list[torch.Tensor]) -> list[float]:
    """The sum of each of ``tensors`` (whole numbers below 2**53: exact in any order), those of
    one shape at once, one read a shape."""
    out = [0.0] * len(tensors)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.shape, t.device), []).append(i)
    for idx in groups.values():
        sums = torch.stack([tensors[i] for i in idx]).flatten(1).sum(-1, dtype=torch.float64)
        for i, x in zip(idx, sums.tolist()):
            out[i] = x
    return out


@dataclass
class _Call:
    """One call's read figures, as tensors until :meth:`ExpertRouter._settle`.

    Attributes:
        chosen: ``(B, H, q, E)`` the experts read by real queries.
        reads: the reads (:class:`ReadCount`, or :class:`StepReads` for a decode step).
        fraction, total: the routable read fractions summed over the real (query, head-row)
            pairs, and their number (a tensor, or a host figure). ``fraction`` is None until
            settled where every query is real: :func:`_fill_reads` makes it, and the routed
            tokens each query reads, from ``count`` and ``routed``, many calls at once.
        count: ``(B, H, E)`` routed tokens per expert; routed: :attr:`Experts.routed`.
    """

    layer: int
    chosen: torch.Tensor
    reads: ReadCount | StepReads
    fraction: torch.Tensor | None
    total: torch.Tensor | float
    count: torch.Tensor | None = None
    routed: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor | float]:
        """The 0-d tensors to read (or host figures), in the order :meth:`resolve` takes their
        values."""
        reads = self.reads.tensors() if isinstance(self.reads, ReadCount) else []
        total = [self.total] if isinstance(self.total, torch.Tensor) else []
        assert self.fraction is not None, "settled before read (_fill_reads)"
        return [*reads, self.fraction, *total]

    def resolve(
        self, values: list[float], step: tuple[float, float] | None
    ) -> tuple[tuple[float, float, float], float | None]:
        """The reads' (bytes per real query, tokens read, tokens visible) and the mean routable
        read fraction (None without a real query) from the values of :meth:`tensors` (and, for
        a decode step's reads, the sums of its ``read`` and ``count``)."""
        if isinstance(self.reads, ReadCount):
            n = len(self.reads.tensors())
            reads = self.reads.resolve(values[:n])
        else:
            assert step is not None
            n = 0
            reads = self.reads.resolve(*step)
        total = values[n + 1] if isinstance(self.total, torch.Tensor) else self.total
        return reads, f32_quotient(values[n], total) if total else None


@dataclass
class ExpertRouter(Router):
    """What every router shares: routable tokens, scores, the read mask and the read figures.

    A subclass defines :meth:`experts` (write routing as seen at read time), optionally
    :meth:`summarize` (default: the mean key of each expert's routed tokens, as MoBA), and
    :meth:`choose` (read routing).

    The read figures of a call are kept as tensors (no device synchronisation per layer) and
    turned into floats, in call order, by :meth:`metrics`, or between chunks once
    ``SETTLE_EVERY`` calls wait (:meth:`settle`).
    """

    name: str = ""
    num_experts: int = 8
    flags = Flags(selects_reads=True)
    reads: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)  # per layer
    read_tokens: list[float] = field(default_factory=list, init=False, repr=False)
    # per layer: bytes read per real query at each call; tokens read and visible, summed
    read_bytes: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False)
    read_counts: list[float] = field(default_factory=lambda: [0.0, 0.0], init=False, repr=False)
    # per layer: (store, its change count, qpos, query, routing) of the last call
    _last: dict[int, tuple[Any, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)
    # the reads of its calls, as _Call records until settled
    meter: ReadMeter = field(default_factory=ReadMeter, init=False, repr=False, compare=False)
    # what the layers of one step share (:meth:`step_shared`): (key, values by name)
    _step: tuple[Any, dict[str, Any]] | None = field(default=None, init=False, repr=False, compare=False)
    # the mixins' state: per layer, the experts held and the view they were read from
    # (:class:`~kvbench.routers.centroids.CentroidExperts`); the last blocks derived
    # (:class:`PositionExperts`)
    _held: dict[int, tuple[Any, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # per layer: the centroids (a weak reference) and the columns kept beside them
    # (:meth:`~kvbench.routers.centroids.CentroidExperts.kept_columns`)
    _columns: dict[int, tuple[Any, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _blocks: _Blocks | None = field(default=None, init=False, repr=False, compare=False)

    def check_experts(self) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"router.num_experts={self.num_experts}: must be >= 1")

    def step_shared(self, store: TechniqueStore, qpos: torch.Tensor, name: str, make: Callable[[], T]) -> T:
        """``make()``, made once for the layers of a step where whatever derives from positions
        alone is the same (:meth:`LayerStore.position_key`), else at every call."""
        key = store.position_key(qpos)
        if key is None:
            return make()
        key = (*key, self.budget)
        if self._step is None or self._step[0] != key:
            self._step = key, {}
        values = self._step[1]
        if name not in values:
            values[name] = make()
        return values[name]

    def experts(self, layer: int, store: TechniqueStore, routable: torch.Tensor) -> torch.Tensor:
        """``(B, H, T)`` expert of each routed token, -1 elsewhere (every token not ``routable``)."""
        raise NotImplementedError

    def route_experts(self, layer: int, store: TechniqueStore, qpos: torch.Tensor) -> Experts:
        """The :meth:`experts` of the tokens routable for the queries at ``qpos`` (those derived
        once per step where the layers share them, :meth:`step_shared`)."""
        routable = self.step_shared(store, qpos, "routable", lambda: routable_mask(self.budget, store, qpos))
        return Experts.of(self.experts(layer, store, routable), self.num_experts)

    def summarize(self, layer: int, store: TechniqueStore, experts: Experts) -> torch.Tensor:
        """The experts' centroids ``(B, H, E, D)`` fp32.

        Default: the mean key of each expert's routed tokens (zero for an empty expert).
        """
        return expert_sums(self.membership(experts), store.keys()) / experts.size

    def membership(self, experts: Experts) -> torch.Tensor:
        """One-hot ``(B, H, T, E)`` float of each routed token's expert."""
        return expert_onehot(experts.eid, None, self.num_experts)

    def choose(
        self, layer: int, store: TechniqueStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        """``(B, H, q, E)`` bool from ``score`` ``(B, H, q, E)`` (-inf for empty experts, which are
        never chosen: nor is any expert whose score is not finite), or padded with a column ``E``
        of True, ``(B, H, q, E + 1)`` (:class:`Routing`)."""
        raise NotImplementedError

    def read_mask(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        return self.route(layer, store, query, qpos).mask

    def read_head_mask(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`read_mask` per query head ``(B, H_q, q, T)`` (:meth:`Routing.head_mask`), for a
        torch read that would repeat the mask over each KV head's query group."""
        return self.route(layer, store, query, qpos).head_mask(query.shape[1] // store.kv_heads)

    def route(self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor) -> Routing:
        """Route a block of queries ``(B, Hq, q, D)``.

        A repeated call for the same block (the engine's KV-hit probe: the same store, unchanged
        since (:attr:`LayerStore.changes`), and the same ``query`` and ``qpos`` tensors, or views of
        the same memory) returns the same routing
        without counting its reads again or advancing router state. The inputs are not modified in
        place between the two calls, so their addresses stand for their values.
        """
        changes = store.changes
        last = self._last.get(layer)
        if (
            last is not None
            and last[0] is store
            and last[1] == changes
            and _same(last[2], qpos)
            and _same(last[3], query)
        ):
            return last[4]
        experts = self.route_experts(layer, store, qpos)
        centroid = self.summarize(layer, store, experts)
        scoring = dispatch.kernels("scoring", query.shape[0], store.columns())  # the cell's path
        score = (scoring or att).group_scores(query, centroid)
        if experts.empty is not None:
            score = score.masked_fill(experts.empty, float("-inf"))
        routing = Routing(experts, self.choose(layer, store, score, experts.count, qpos))
        self._account(layer, store, routing, qpos)
        self._last[layer] = (store, changes, qpos, query, routing)  # held: their memory is not reused
        return routing

    def forget(self, layer: int) -> None:
        """Drop the remembered routing of ``layer`` (router state is about to change)."""
        self._last.pop(layer, None)

    def write(self, layer: int, store: TechniqueStore) -> None:
        self.forget(layer)

    def _account(self, layer: int, store: TechniqueStore, routing: Routing, qpos: torch.Tensor) -> None:
        """Keep the reads of one call: the experts read, the routable fraction, bytes and tokens.

        Where every query is real (the whole last chunk, unpadded), the counts of queries and
        head-rows are host figures; a decode step over full rows also reads its visible tokens
        (all of them) on the host.
        """
        chosen = routing.chosen
        b, h, q, _ = chosen.shape
        if q == 1 and len(store.segments) == 1 and one_step(store, qpos):
            # a decode step over full rows of one segment: every query real, every stored token
            # visible and costing the same bytes; its figures made when settled, many at once
            fp, count = store.fp, routing.count
            reads = StepReads(fp.token_nbytes(), None, count, b * h * fp.rows.width, b)
            if self.meter.add(_Call(layer, chosen, reads, None, float(b * h), count, routing.experts.routed)):
                self._settle()
            return
        whole = every_query_real(store, qpos)
        read: torch.Tensor | None = None
        fraction: torch.Tensor | None = None
        total: torch.Tensor | float
        if whole:  # the read figures made when settled, those of many calls at once
            total = float(b * h * q)
        else:
            chosen = chosen & (qpos >= 0)[:, None, :, None]
            read = (chosen * routing.count[:, :, None, :]).sum(-1)  # routed tokens read per query
            frac = read / routing.experts.routed
            weight = (qpos >= 0)[:, None, :].expand_as(frac).float()
            fraction, total = (frac * weight).sum(), weight.sum()
        counted = count_reads(store, routing.mask, qpos)
        if fraction is None:
            call = _Call(layer, chosen, counted, None, total, routing.count, routing.experts.routed)
        else:
            call = _Call(layer, chosen, counted, fraction, total)
        if self.meter.add(call):
            self._settle()

    def _settle(self) -> None:
        """Fold the pending read records into ``reads``, ``read_tokens``, ``read_bytes`` and
        ``read_counts`` (one read of them all per device; the experts read summed per layer)."""
        _fill_reads(self.meter.pending)
        settled = self.meter.settle()
        if not settled:
            return
        steps = [c.reads for c, _ in settled if isinstance(c.reads, StepReads)]
        reads = [cast(torch.Tensor, r.read) for r in steps]
        step_sums = iter(zip(exact_sums(reads), exact_sums([r.count for r in steps])))
        per_layer: dict[int, list[torch.Tensor]] = {}
        for call, values in settled:
            step = next(step_sums) if isinstance(call.reads, StepReads) else None
            (nbytes, n_read, n_visible), fraction = call.resolve(values, step)
            if fraction is not None:
                self.read_tokens.append(fraction)
            self.read_bytes.setdefault(call.layer, []).append(nbytes)
            self.read_counts[0] += n_read
            self.read_counts[1] += n_visible
            per_layer.setdefault(call.layer, []).append(call.chosen.reshape(-1, call.chosen.shape[-1]))
        for layer, chosen in per_layer.items():  # whole numbers: summed in any order, exactly
            per_expert = torch.cat(chosen).sum(0).float()
            before = self.reads.get(layer)  # per layer: each on its layer's device
            self.reads[layer] = per_expert if before is None else before + per_expert

    def settle(self) -> None:
        if self.meter.due():
            self._settle()

    def metrics(self) -> dict[str, float | list[float] | None]:
        self._settle()
        if not self.reads:
            return {}
        reads = torch.stack([r.cpu() for r in self.reads.values()]).sum(0)  # whole numbers: exact
        mean = float(reads.mean())
        return {
            "reads_per_expert": reads.tolist(),
            "load_imbalance": float(reads.max()) / mean if mean else None,
            "routable_read_fraction": sum(self.read_tokens) / len(self.read_tokens)
            if self.read_tokens
            else None,
            # a step is one query through every layer: the layers' mean bytes per query, summed
            "bytes_read_per_step": sum(sum(b) / len(b) for b in self.read_bytes.values()),
            "read_fraction": self.read_counts[0] / self.read_counts[1] if self.read_counts[1] else None,
        }


def _fill_reads(pending: list[_Call]) -> None:
    """Make the read figures of the ``pending`` calls whose every query was real (``fraction``
    None): the routed tokens each query read, ``(chosen · count).sum(-1)``, and their routable
    fractions ``read / routed`` summed, those of one shape at once.

    The counts are whole numbers and each fraction one division, so they are the values one call's
    own operations give. Each call's fractions are summed alone, in the order one call sums them:
    from a slice of the batch where its offset keeps the layout a tensor of its own has (at most
    128 of them, which a GPU does not sum by vectors, or a multiple of 32), else from a quotient
    of its own.
    """
    groups: dict[tuple[Any, ...], list[_Call]] = {}
    for call in pending:
        if call.fraction is None:
            assert call.count is not None and call.routed is not None
            key = (
                call.chosen.shape,
                call.count.shape,
                call.routed.shape,
                call.count.dtype,
                call.routed.dtype,
                call.chosen.device,
            )
            groups.setdefault(key, []).append(call)
    for (shape, _, routed_shape, *_), calls in groups.items():
        n = shape[:-1].numel()  # fractions of one call
        sliced = n <= 128 or n % 32 == 0
        step = max(1, (1 << 22) // max(shape.numel(), 1))
        for at in range(0, len(calls), step):
            part = calls[at : at + step]
            count = torch.stack([cast(torch.Tensor, c.count) for c in part])[:, :, :, None, :]
            read = (torch.stack([c.chosen for c in part]) * count).sum(-1)  # (N, B, H, q)
            if sliced:
                routed = torch.stack([cast(torch.Tensor, c.routed) for c in part])
                frac = read / routed.reshape(len(part), *[1] * (3 - len(routed_shape)), *routed_shape)
            for i, call in enumerate(part):
                call.fraction = (frac[i] if sliced else read[i] / cast(torch.Tensor, call.routed)).sum()
                if isinstance(call.reads, StepReads):
                    call.reads.read = read[i]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same tensor, or views of the same memory with the same layout."""
    return a is b or (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


@dataclass(eq=False)
class _Blocks:
    """Position blocks shared by the layers of one step (:meth:`PositionExperts.route_experts`)."""

    key: tuple[Any, ...] | None  # None: the blocks of one call
    experts: Experts
    member: torch.Tensor  # (B, H, T, E) bool: each routed token's block
    weights: torch.Tensor | None = None  # :meth:`PositionExperts.mean_weights`, made when first asked


class PositionExperts:
    """Mixin: write = contiguous position blocks over the routed tokens, derived at read time
    (a token's block follows from its rank, so nothing is stored and ``write`` keeps nothing).

    Where every stored slot holds its own position
    (:func:`kvbench.cache.surface.every_position`), the blocks depend on the positions alone, so
    they are the same in every layer of a step: the first layer derives them (and their membership
    and sizes) and the others reuse those very tensors.
    The routed tokens are then a range of columns known on the host (:func:`routable_columns`),
    and so is the block of each.
    """

    num_experts: int
    budget: Any
    _blocks: _Blocks | None  # declared by ExpertRouter

    def experts(self, layer: int, store: TechniqueStore, routable: torch.Tensor) -> torch.Tensor:
        return position_blocks(store.view().pos, routable, self.num_experts, store.in_position_order())

    def route_experts(self, layer: int, store: TechniqueStore, qpos: torch.Tensor) -> Experts:
        key = store.position_key(qpos)
        if key is not None:
            key = (*key, self.budget, self.num_experts)
            cached = self._blocks
            if cached is not None and cached.key == key:
                return cached.experts
        cols = None if key is None else routable_columns(self.budget, store, qpos)
        if cols is None:
            eid = self.experts(layer, store, routable_tokens(self.budget, store, qpos))
            member = eid[..., None] == expert_ids(self.num_experts, eid)
            experts = Experts(member.sum(2, dtype=torch.float32), eid=eid)
        else:
            column, none_empty = self.column_blocks(store, *cols)
            member = column[:, :, 0, :, None] == expert_ids(self.num_experts, column)
            experts = Experts(
                member.sum(2, dtype=torch.float32),
                column=column,
                none_empty=none_empty,
                routed_host=cols[1] - cols[0],
            )
        # kept for :meth:`mean_weights` (and, with a key, for the other layers of the step)
        self._blocks = _Blocks(key, experts, member)
        return experts

    def column_blocks(self, store: TechniqueStore, lo: int, hi: int) -> tuple[torch.Tensor, bool]:
        """The blocks of the routed columns ``lo .. hi - 1`` of every head-row (:func:`routable_columns`):
        column ``t`` holds the token of rank ``t - lo``, in block ``(t - lo) · E // n``.

        Returns:
            :attr:`Experts.column` ``(B, H, 1, T)`` (a view of one row), and whether every block
            holds a token (``n >= E``).
        """
        n, experts = hi - lo, self.num_experts
        width = store.columns()
        # ranks times E (held: no launch), over n; E at either side
        ranks = devices.arange(n, store.last_qpos, step=experts)
        column = torch.constant_pad_nd(torch.floor_divide(ranks, n), (lo, width - hi), experts)
        return column.expand(store.batch, store.kv_heads, 1, width), n >= experts

    def most_read(self) -> int:
        """The most experts a query reads (a host bound from the knobs): :meth:`read_pages` hands
        that many blocks at most."""
        return self.num_experts

    def read_pages(
        self, layer: int, store: TechniqueStore, query: torch.Tensor, qpos: torch.Tensor
    ) -> att.Pages | None:
        """:meth:`read_mask` as the blocks each query reads (:class:`att.Pages`: ``E`` blocks
        splitting the routed columns), for a kernel whose grid covers those blocks and the columns
        always read only. Where the routed columns are known on the host (:func:`routable_columns`),
        in a one-token step, and a query reads fewer than ``E`` blocks (:meth:`most_read`); None
        elsewhere (the engine then asks :meth:`read_mask`). The same tokens are read, and counted,
        as the mask reads."""
        k, experts = self.most_read(), self.num_experts
        cols = paged_columns(self.budget, store, qpos, k, experts)
        if cols is None:
            return None
        chosen = self.route(layer, store, query, qpos).chosen  # type: ignore[attr-defined]
        lo, hi = cols
        return att.Pages(first_chosen(chosen, k), hi - lo, lo, hi, start=lo, parts=experts)

    def summarize(self, layer: int, store: TechniqueStore, experts: Experts) -> torch.Tensor:
        """Each block's mean key (zero for an empty block), as its tokens' keys weighted by one over
        its size: one product a layer, the weights made once for the step's layers that share
        the blocks (version 2; version 1 summed each block's keys and divided the sums, one
        operation more a layer), in the keys' dtype (:func:`weighted_keys`, version 3)."""
        return self.scaled_means(store, experts)

    def scaled_means(
        self, store: TechniqueStore, experts: Experts, scale: float | None = None
    ) -> torch.Tensor:
        """Each block's mean key times ``scale`` (None: 1): the stored keys weighted by
        :meth:`mean_weights` in their dtype, one product (:func:`weighted_keys`)."""
        keys = store.keys()
        return weighted_keys(self.mean_weights(experts, scale, keys.dtype), keys)

    def mean_weights(
        self, experts: Experts, scale: float | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``(B, H, T, E)`` of ``dtype``: each routed token's one-hot over its block's size (an empty
        block's weights are zeros): one over the size where the token is a member, made from the
        membership (no float one-hot) and kept with the step's shared blocks. ``scale``: times
        that factor (a router's score scale, the same for every layer of the step). Made in
        float32, rounded to ``dtype`` once (the keys' dtype: :func:`weighted_keys`)."""
        cached = self._blocks
        if cached is not None and cached.experts is experts:
            if cached.weights is None or cached.weights.dtype != dtype:
                cached.weights = torch.where(cached.member, self._one_over_size(experts, scale, dtype), 0.0)
            return cached.weights
        member = experts.eid[..., None] == expert_ids(self.num_experts, experts.eid)
        return torch.where(member, self._one_over_size(experts, scale, dtype), 0.0)

    @staticmethod
    def _one_over_size(experts: Experts, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
        """``(B, H, 1, E)`` of ``dtype``: one over each block's size, times ``scale`` where given
        (in float32, then rounded once)."""
        weight = experts.size.transpose(-1, -2).reciprocal()
        return (weight if scale is None else weight * scale).to(dtype)

    def none_empty(self, count: torch.Tensor) -> bool:
        """Every expert of every head-row holds a token, known on the host: ``count`` is that of
        blocks over routed columns known on the host, with at least one token a block."""
        cached = self._blocks
        return cached is not None and cached.experts.count is count and cached.experts.none_empty
