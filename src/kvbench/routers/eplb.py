"""Expert-parallel load balancing of a sharded KV cache (DeepSeek EPLB,
github.com/deepseek-ai/EPLB): nearest-centroid experts placed on ``num_devices`` logical
devices, the hottest experts replicated into ``replicas`` extra slots so per-device read load
balances.

Write: as ``topk_balanced`` without capacity (nearest running centroid, online mean). Then, per
layer, a plan from the read load each expert has received so far: (1) replication: one extra slot
at a time goes to the expert with the highest load per replica (at most one replica per device);
(2) packing: slots by decreasing load per replica, each to the least-loaded device that has fewer
than ⌈slots / devices⌉ slots and no replica of that expert yet. The replicas are real: copies of
the replicated experts' keys and values (at the cache's dtype, as attention reads them) live in
the layer's side data (:class:`Placement`) and are counted in the cache's bytes, as are the
centroids, the loads and the plan. Read: top-k experts by q · centroid; a replicated expert's
reads go to its least-loaded replica's device (read by read, so they fill the replicas' devices
from the least-loaded up).

On one machine the devices are logical: attention still reads the primary copy, and the
per-device figures (reads, max/mean imbalance, with and without replication — the latter by
the same packing of unreplicated experts) are plan metrics. Differences from DeepSeek EPLB: it
plans once from a measured load window and packs whole expert groups onto nodes first
(hierarchical); here the plan is refreshed after every forward chunk from the loads so far, on
one level, and the loads of a padded batch's sequences are pooled (devices are shared).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.cache.side import SideData
from kvbench.cache.surface import TechniqueStore, every_query_real
from kvbench.errors import ConfigError
from kvbench.routers.centroids import Assigned, CentroidExperts, held_experts
from kvbench.routers.expert import ExpertRouter, top_k_choice


@dataclass
class Placement(SideData):
    """One layer's plan: read load per expert ``(E,)`` and per device when it last changed, the
    expert and device of every slot, the devices without replication, and the replicas' keys and
    values ``(n, D)``."""

    load: torch.Tensor
    device_load: torch.Tensor
    slot_expert: torch.Tensor | None = None
    slot_device: torch.Tensor | None = None
    base_device: torch.Tensor | None = None
    replica_k: torch.Tensor | None = None
    replica_v: torch.Tensor | None = None
    replica_key: tuple[Any, ...] | None = None  # (store edits, slot experts) the replicas were made under
    # the same plan on the host, where it is made and served (the tensors above are what the
    # layer stores and counts): loads per expert and device, each slot's expert and device, the
    # devices without replication, the extra copies of each expert
    host: dict[str, list] = field(default_factory=dict, repr=False)
    # not counted (the layer's bytes are the replicas and the plan above): the buffers the
    # replicas are views of, with rows past them to grow into ("k", "v"), the plan's extra
    # copies of each expert, its slots less one ("extra"), and which head-row each copy of a
    # decode step's column is of, sent with a changed plan and taken by the same write ("rows")
    room: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)


def replicate(load: list[float], devices: int, replicas: int) -> list[int]:
    """Copies of each expert: each extra slot to the highest load per copy (≤ ``devices`` copies;
    ties to the lower expert)."""
    reps = [1] * len(load)
    # each expert's load per copy while it may take one more (-1: it may not)
    per_copy = [x if x > 0 and devices > 1 else -1.0 for x in load]
    for _ in range(replicas if per_copy else 0):
        best = max(range(len(per_copy)), key=per_copy.__getitem__)  # the first of equal ones
        if per_copy[best] < 0:
            break
        reps[best] += 1
        per_copy[best] = load[best] / reps[best] if reps[best] < devices else -1.0
    return reps


def eplb_plan(load: torch.Tensor, devices: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replicate the hottest experts, then pack the slots onto devices.

    Args:
        load: ``(E,)`` reads each expert has received.

    Returns:
        ``slot_expert`` ``(S,)`` and ``slot_device`` ``(S,)`` long (CPU), slots grouped by expert.
    """
    slot_expert, slot_device = plan_slots([float(x) for x in load.tolist()], devices, replicas)
    return torch.tensor(slot_expert, dtype=torch.long), torch.tensor(slot_device, dtype=torch.long)


def plan_slots(loads: list[float], devices: int, replicas: int) -> tuple[list[int], list[int]]:
    """:func:`eplb_plan` on the host, each slot to the device least loaded, then holding the fewest
    slots, then first, among those without a copy of its expert yet and with room (fewer than
    ⌈slots / devices⌉ slots), else among those without a copy."""
    reps = replicate(loads, devices, replicas)
    slot_expert = [e for e, r in enumerate(reps) for _ in range(r)]
    per_slot = [loads[e] / reps[e] for e in slot_expert]
    room = -(-len(slot_expert) // devices)
    dev_load, dev_slots = [0.0] * devices, [0] * devices
    holds = [0] * len(reps)  # per expert: the devices holding a copy, as bits
    slot_device = [0] * len(slot_expert)
    for s in sorted(range(len(per_slot)), key=per_slot.__getitem__, reverse=True):  # stable
        e = slot_expert[s]
        best, spare, held = -1, False, holds[e]  # the device so far, whether it has room
        for d in range(devices):
            if held >> d & 1:
                continue
            n = dev_slots[d]
            fits = n < room
            if best < 0 or fits != spare:
                if best < 0 or fits:
                    best, spare, low, fewest = d, fits, dev_load[d], n
            elif dev_load[d] < low or (dev_load[d] == low and n < fewest):
                best, low, fewest = d, dev_load[d], n
        if best < 0:  # every device holds a copy (not with at most ``devices`` copies)
            best = min(range(devices), key=lambda d: (dev_load[d], dev_slots[d], d))
        slot_device[s] = best
        dev_load[best] += per_slot[s]
        dev_slots[best] += 1
        holds[e] |= 1 << best
    return slot_expert, slot_device


def water_fill(loads: torch.Tensor, n: float) -> torch.Tensor:
    """Split ``n`` reads over devices with ``loads`` ``(r,)``, each read to the least-loaded one."""
    return torch.tensor(fill_levels(loads.tolist(), n), dtype=loads.dtype, device=loads.device)


def fill_levels(loads: list[float], n: float) -> list[float]:
    """:func:`water_fill` on the host. Loads and reads are whole numbers, so every sum is exact."""
    srt = sorted(loads)
    r = len(srt)
    level = srt[0] + n
    for j in range(1, r + 1):
        level = (sum(srt[:j]) + n) / j
        if j == r or level <= srt[j]:
            break
    add = [float(math.floor(max(level - x, 0.0))) for x in loads]
    left = int(round(n - sum(add)))
    for i in sorted(range(r), key=lambda i: loads[i] + add[i])[:left]:  # stable: ties by index
        add[i] += 1
    return add


def device_reads(
    reads: torch.Tensor, slot_expert: torch.Tensor, slot_device: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """Reads ``(D,)`` each device serves for ``reads`` ``(E,)`` per expert under a plan.

    A single-copy expert's reads go to its device; a replicated expert's go, read by read, to its
    least-loaded replica given the devices' load ``start`` ``(D,)`` plus what this call routed.
    """
    out = serve(reads.tolist(), slot_expert.tolist(), slot_device.tolist(), start.tolist())
    return torch.tensor(out, dtype=start.dtype, device=start.device)


def serve(
    reads: list[float], slot_expert: list[int], slot_device: list[int], start: list[float]
) -> list[float]:
    """:func:`device_reads` on the host (a plan has a few dozen slots: lists beat small tensors)."""
    devices: dict[int, list[int]] = {}
    for e, d in zip(slot_expert, slot_device):
        devices.setdefault(e, []).append(d)
    out = [0.0] * len(start)
    replicated = []
    for e, devs in devices.items():
        if len(devs) == 1:
            out[devs[0]] += reads[e]
        elif reads[e]:  # no reads: nothing to fill
            replicated.append(e)
    for e in sorted(replicated, key=lambda e: -reads[e]):  # stable: ties by expert
        devs = devices[e]
        add = fill_levels([start[d] + out[d] for d in devs], reads[e])
        for d, a in zip(devs, add):
            out[d] += a
    return out


def _room(buf: torch.Tensor | None, kept: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """``buf`` with room for ``n`` rows after its first ``kept``, or a buffer a quarter larger than
    needed holding those ``kept`` rows (of ``like``'s last dimension, dtype and device): appending
    a step's replicas costs their rows, not a copy of every replica so far."""
    need = kept + n
    if buf is None or buf.shape[0] < need:
        grown = like.new_empty(need + max(64, need // 4), like.shape[-1])
        if kept:
            grown[:kept] = buf[:kept]  # type: ignore[index]
        buf = grown
    return buf


def copied_rows(copies: list[int]) -> list[int]:
    """Each head-row ``i`` once per copy ``copies[i]``, in order (a ``repeat_interleave`` on the host)."""
    return [i for i, n in enumerate(copies) for _ in range(n)]


# A decode step's choice of at most this many elements (batch x KV heads x (experts + 1)) is read
# as it is and summed on the host (:func:`read_counts`), saving a launch; a larger one, where the
# host's sum would cost more than the launch, is summed on the device.
HOST_SUMMED = 1024


def read_counts(
    reads: list[torch.Tensor], extra: list[torch.Tensor], experts: int
) -> tuple[list[list[float]], list[float]]:
    """One host read of the reads kept per call and of ``extra``: each call's reads per expert,
    from its sums ``(E,)`` float64 or from a decode step's padded choice ``(B, H, 1, E + 1)`` bool
    (:func:`~kvbench.routers.expert.no_choice`; its column ``E``, always read, left out), summed
    here (whole numbers: exact either way); and the values of ``extra`` after them."""
    parts = [r.flatten() for r in reads] + extra  # views: the choice is contiguous
    values = torch.cat(parts).tolist() if parts else []  # whole numbers, exact in any dtype here
    counts, at = [], 0
    for r in reads:
        n, width = r.numel(), r.shape[-1]
        counts.append([float(sum(values[at + i : at + n : width])) for i in range(experts)])
        at += n
    return counts, values[at:]


def imbalance(per_device: torch.Tensor) -> float | None:
    mean = float(per_device.mean())
    return float(per_device.max()) / mean if mean else None


@dataclass
class EPLBRouter(CentroidExperts, ExpertRouter):
    """Nearest-centroid experts on logical devices, hot experts replicated (DeepSeek EPLB).

    A read keeps its reads per expert on the device; the next write of the layer reads them (with
    what it assigned, one host read) into the plan's loads, before it refreshes the plan.
    """

    # 2: the decode step's one-token distance and update; 3: a changed plan carries the rows of the
    # column's copies, in its buffer (resident bytes); 4: a write after drops seeds from its
    # earliest new tokens (issue 29, CHANGELOG.md)
    version = 4
    name: str = "eplb"
    num_experts: int = 8
    top_k: int = 2
    num_devices: int = 4
    replicas: int = 4
    # per layer: reads per device with and without replication, summed (whole numbers: exact)
    after: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False)
    before: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False)
    # per layer: its store and the reads of the calls not yet in the plan's loads: per expert
    # ``(E,)`` float64, or a decode step's padded choice ``(B, H, 1, E + 1)`` bool (:func:`read_counts`)
    _reads: dict[int, tuple[TechniqueStore, list[torch.Tensor]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def check_knobs(self) -> None:
        self.check_experts()
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"router.top_k={self.top_k}: must be in 1..num_experts ({self.num_experts})")
        if not 1 <= self.num_devices <= self.num_experts:
            raise ConfigError(
                f"router.num_devices={self.num_devices}: must be in 1..num_experts ({self.num_experts})"
            )
        most = self.num_experts * (self.num_devices - 1)
        if not 0 <= self.replicas <= most:
            raise ConfigError(
                f"router.replicas={self.replicas}: must be in 0..num_experts*(num_devices-1) ({most})"
            )

    def write(self, layer: int, store: TechniqueStore) -> None:
        self.forget(layer)
        assigned = self.assign_new(layer, store)
        self._held.pop(layer, None)
        side = self.placement(store)
        # one host read: the reads kept since the last write, and the experts of a column assigned now
        reads = self._reads.pop(layer, (store, []))[1]
        expert = assigned.expert
        counts, rest = read_counts(reads, [] if expert is None else [expert.flatten()], self.num_experts)
        for call in counts:
            self.serve_reads(layer, side, call)
        placed = [int(x) for x in rest] if expert is not None else None
        side = self.plan(store, placed)
        assert side.slot_expert is not None
        key = (store.edits, tuple(side.host["slot_expert"]))
        grow = side.replica_key == key  # set with the replicas
        rows = side.room.pop("rows", None)  # sent with a changed plan: the column's copies
        if grow and assigned.column is not None and expert is not None and placed is not None:
            self._grow_column(store, side, assigned.column, expert, placed, rows)
        elif not grow or assigned.held is not None:
            self._copy_replicas(store, side, assigned, grow)
        side.replica_key = key

    def _copy_replicas(self, store: TechniqueStore, side: Placement, assigned: Assigned, grow: bool) -> None:
        """Replicas of the tokens assigned now (``grow``: the same plan over the same stored tokens,
        appends aside), else of every assigned token, made anew."""
        held, new = assigned.held, assigned.new
        if held is None or new is None:  # a column known on the host: made anew (not ``grow``)
            held = held_experts(store, self.num_experts)
        extra_of = side.room["extra"]  # extra copies of each expert in the plan
        keys, values = store.kv()
        # The same plan over the same stored tokens (appends aside): the replicas so far stay and
        # the tokens assigned now add theirs (replicas are counted, not read: order is free).
        copied = (new & (held >= 0)) if grow and new is not None else held >= 0
        # a copy per extra replica of each token's expert (0: none), in storage order
        extra = torch.where(copied, extra_of[held.clamp(min=0)], 0)
        flat = torch.repeat_interleave(extra.flatten())  # the one read: how many copies
        t = extra.shape[-1]
        at = (flat // t, flat % t)  # head-row and column
        k, v = (x.flatten(0, 1)[at] for x in (keys, values))
        self._append_replicas(side, k, v, grow)

    def _grow_column(
        self,
        store: TechniqueStore,
        side: Placement,
        col: int,
        expert: torch.Tensor,
        placed: list[int],
        rows: torch.Tensor | None = None,
    ) -> None:
        """:meth:`_copy_replicas` of the one column assigned now in every head-row, its experts
        ``expert`` ``(B, H, 1)`` also read on the host (``placed``): the copies are counted there,
        the rows copied on the device, head-row by head-row as in storage order. ``rows``: which
        head-row each copy is of, sent with the plan (:func:`copied_rows`), else made here."""
        copies = [side.host["extra"][x] for x in placed]
        total = sum(copies)
        if not total:
            return
        keys, values = store.kv()
        if rows is None:
            extra = side.room["extra"][expert.flatten()]  # (B * H,)
            rows = torch.repeat_interleave(extra, output_size=total)  # each head-row, once per copy
        d = keys.shape[-1]
        k, v = (x[:, :, col].reshape(-1, d) for x in (keys, values))
        self._append_replicas(side, k, v, True, rows)

    @staticmethod
    def _append_replicas(
        side: Placement, k: torch.Tensor, v: torch.Tensor, grow: bool, rows: torch.Tensor | None = None
    ) -> None:
        """Append the rows ``k`` and ``v`` ``(n, D)`` to the replicas (``grow``), or start them over;
        with ``rows``, the rows of ``k`` and ``v`` at ``rows``, gathered straight into the buffers."""
        # the replicas are views of their buffers (only this method sets them): keep or start over
        kept = side.replica_k.shape[0] if grow and side.replica_k is not None else 0
        n = k.shape[0] if rows is None else rows.shape[0]
        for name, new in (("k", k), ("v", v)):
            side.room[name] = buf = _room(side.room.get(name) if kept else None, kept, n, new)
            if rows is None:
                buf[kept : kept + n] = new
            else:
                torch.index_select(new, 0, rows, out=buf[kept : kept + n])
            setattr(side, f"replica_{name}", buf[: kept + n])

    def placement(self, store: TechniqueStore) -> Placement:
        """The layer's plan, made from the loads so far where it has none yet."""
        side = store.side(Placement)
        return side if side is not None and side.slot_expert is not None else self.plan(store)

    def plan(self, store: TechniqueStore, placed: list[int] | None = None) -> Placement:
        """Refresh the placement from the loads so far (created empty on first use), on the host.

        The plan's tensors (slots' experts and devices, the unreplicated placement, the extra copies
        of each expert; the loads per expert and device it changed at, as the bits of their float64
        values) are views of one buffer, sent to the device when the plan changes: the host serves
        the reads from its own figures, so a step that keeps the plan sends nothing.

        ``placed``: the experts of a column assigned now, one per head-row. A changed plan also
        sends which head-row each of their copies under it is of (``room["rows"]``,
        :func:`copied_rows`), so growing the replicas by that column launches nothing to find them."""
        side = store.side(Placement)
        if side is None:
            side = Placement(
                torch.zeros(self.num_experts, dtype=torch.float64, device=store.device),
                torch.zeros(self.num_devices, dtype=torch.float64, device=store.device),
            )
            side.host = {"load": [0.0] * self.num_experts, "device_load": [0.0] * self.num_devices}
            store.set_side(side)
        host = side.host
        slot_expert, slot_device = plan_slots(host["load"], self.num_devices, self.replicas)
        base_device = plan_slots(host["load"], self.num_devices, 0)[1]
        same = (slot_expert, slot_device, base_device) == tuple(
            host.get(name) for name in ("slot_expert", "slot_device", "base_device")
        )
        if side.slot_expert is not None and same:
            return side  # the same plan: its tensors stand
        host["slot_expert"], host["slot_device"], host["base_device"] = slot_expert, slot_device, base_device
        extra = host["extra"] = [slot_expert.count(e) - 1 for e in range(self.num_experts)]
        loads = [struct.unpack("<q", struct.pack("<d", x))[0] for x in host["load"] + host["device_load"]]
        rows = [] if placed is None else copied_rows([extra[e] for e in placed])
        parts = [slot_expert, slot_device, base_device, extra, loads, rows]
        flat = torch.tensor([x for part in parts for x in part], dtype=torch.long, device=store.device)
        *plan, bits, sent = flat.split([len(part) for part in parts])
        side.slot_expert, side.slot_device, side.base_device, side.room["extra"] = plan
        if rows:
            side.room["rows"] = sent
        side.load, side.device_load = bits.view(torch.float64).split([self.num_experts, self.num_devices])
        return side

    def choose(
        self, layer: int, store: TechniqueStore, score: torch.Tensor, count: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        padded = top_k_choice(score, self.top_k, self.all_held(store, count), pad=True)
        chosen = padded[..., : self.num_experts]
        self.placement(store)  # the plan the reads go to
        whole = every_query_real(store, qpos)
        if whole and qpos.shape[1] == 1 and padded.numel() <= HOST_SUMMED:
            reads = padded  # a decode step's choice, summed on the host when read (read_counts)
        elif whole:
            reads = chosen.sum((0, 1, 2), dtype=torch.float64)
        else:
            reads = (chosen & (qpos >= 0)[:, None, :, None]).sum((0, 1, 2)).double()
        self._reads.setdefault(layer, (store, []))[1].append(reads)  # read at the layer's next write
        return padded

    def _serve_pending(self) -> None:
        """Put the reads kept since each layer's last write on its plan (one host read)."""
        pending, self._reads = self._reads, {}
        items = [(layer, store, r) for layer, (store, reads) in pending.items() for r in reads]
        if not items:
            return
        counts, _ = read_counts([r.cpu() for _, _, r in items], [], self.num_experts)
        for (layer, store, _), call in zip(items, counts):
            self.serve_reads(layer, self.placement(store), call)

    def serve_reads(self, layer: int, side: Placement, counts: list[float]) -> None:
        """Put one call's reads per expert on the plan's loads and its devices (on the host)."""
        host = side.host
        host["load"] = [a + b for a, b in zip(host["load"], counts)]  # whole numbers: exact
        served = serve(counts, host["slot_expert"], host["slot_device"], host["device_load"])
        unreplicated = [0.0] * self.num_devices
        for e, d in enumerate(host["base_device"]):
            unreplicated[d] += counts[e]
        host["device_load"] = [x + y for x, y in zip(host["device_load"], served)]
        for per, add in ((self.after, served), (self.before, unreplicated)):
            per[layer] = [x + y for x, y in zip(per.get(layer, [0.0] * self.num_devices), add)]

    def metrics(self) -> dict[str, float | list[float] | None]:
        self._serve_pending()
        out = super().metrics()
        if not out or not self.after:
            return out
        layers = sorted(self.after)
        after = {i: torch.tensor(self.after[i], dtype=torch.float64) for i in layers}
        before = {i: torch.tensor(self.before[i], dtype=torch.float64) for i in layers}

        def mean_imbalance(per: dict[int, torch.Tensor]) -> float | None:
            vals = [imbalance(per[i]) for i in layers]
            vals_f = [v for v in vals if v is not None]
            return sum(vals_f) / len(vals_f) if vals_f else None

        out["device_reads"] = sum((after[i] for i in layers), torch.zeros(self.num_devices)).tolist()
        out["device_reads_no_replication"] = sum(
            (before[i] for i in layers), torch.zeros(self.num_devices)
        ).tolist()
        out["device_load_imbalance"] = mean_imbalance(after)
        out["device_load_imbalance_no_replication"] = mean_imbalance(before)
        return out
