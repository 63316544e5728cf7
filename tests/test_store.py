"""The store's view across segments: kept up to date between steps, always what concatenating
every segment's rows (and its decoded keys and values) gives, whatever sequence of appends, moves
and evictions led there; any block of head-rows decodes to the same."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvbench.cache.segments import FPSegment, Segment
from kvbench.cache.store import LayerStore


@dataclass
class _Halved(Segment):
    """A representation for the test: keys and values stored at half their value (``tag`` tells
    layouts apart, so two of them can sit side by side); ``biased`` adds a per-token logit."""

    k: torch.Tensor = None  # type: ignore[assignment]
    v: torch.Tensor = None  # type: ignore[assignment]
    tag: int = 0
    biased: bool = False

    def data_fields(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v}

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.k * 0.5).to(dtype), (self.v * 0.5).to(dtype)

    def layout(self) -> tuple:
        return (self.tag,)

    def bias(self) -> torch.Tensor | None:
        return self.pos.float() / 100 if self.biased else None


def _decoded(seg) -> tuple[torch.Tensor, torch.Tensor]:
    """A segment's keys and values in its rows' slots: stored, or read whole and placed."""
    rows = seg.rows
    if isinstance(seg, FPSegment):
        return rows.get("k"), rows.get("v")
    out = []
    for flat in seg.read(torch.float32):
        slots = torch.zeros(rows.bh, rows.width, flat.shape[-1])
        slots[rows.valid()] = flat
        out.append(slots)
    return out[0], out[1]


def _reference(store: LayerStore) -> dict[str, torch.Tensor | None]:
    """The view as a plain concatenation of every segment's rows."""
    segs = store.segments
    cat = {"pos": torch.cat([s.rows.get("pos") for s in segs], dim=1)}
    decoded = [_decoded(s) for s in segs]
    cat["k"] = torch.cat([k for k, _ in decoded], dim=1)
    cat["v"] = torch.cat([v for _, v in decoded], dim=1)
    cat["valid"] = torch.cat([s.rows.valid() for s in segs], dim=1)
    cat["bias"] = None
    if any("bias" in s.rows for s in segs):
        cat["bias"] = torch.cat(
            [s.rows.get("bias") if "bias" in s.rows else torch.zeros(s.rows.bh, s.rows.width) for s in segs],
            dim=1,
        )
    return cat


def _check(store: LayerStore) -> None:
    view, ref = store.view(), _reference(store)
    b, h = store.batch, store.kv_heads
    assert view.widths == [s.rows.width for s in store.segments]
    assert view.dense == all(s.rows.uniform for s in store.segments)
    for name in ("k", "v", "pos", "valid"):
        got = getattr(view, name)
        assert torch.equal(got.reshape(b * h, *got.shape[2:]), ref[name]), name
    if ref["bias"] is None:
        assert view.bias is None
    else:
        assert view.bias is not None and torch.equal(view.bias.reshape(b * h, -1), ref["bias"])
    parts = [(r, r + 1) for r in range(b * h)] + [(s * h, (s + 1) * h) for s in range(b)]
    for lo, hi in parts:  # every head-row alone, every sequence whole
        k, v = store.decoded(lo, hi)
        assert torch.equal(k, ref["k"][lo:hi]) and torch.equal(v, ref["v"][lo:hi]), (lo, hi)
    store.release()
    assert view.kv is None


def _leaving(store: LayerStore, keep_first: int, keep_last: int) -> torch.Tensor:
    """The oldest full-precision tokens after ``keep_first`` (sinks), leaving ``keep_last`` (window)."""
    valid = store.fp_valid()
    rank = valid.long().cumsum(-1)
    return valid & (rank > keep_first) & (rank <= valid.sum(-1, keepdim=True) - keep_last)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_view_tracks_every_change(batch, seed):
    gen = torch.Generator().manual_seed(seed)
    h, d = 2, 4
    store = LayerStore(batch, h, d, torch.float32, torch.device("cpu"))

    def build(tag, biased):
        def make(k, v, pos, lens):
            return _Halved(lens=lens, pos=pos, k=k, v=v, tag=tag, biased=biased)

        return make

    for step in range(60):
        q = 8 if step == 0 else int(torch.randint(1, 3, (1,), generator=gen))
        k, v = torch.randn(batch, h, q, d, generator=gen), torch.randn(batch, h, q, d, generator=gen)
        real = None
        if batch > 1 and step % 7 == 3:  # a padded chunk: the sequences advance unevenly
            real = torch.rand(batch, q, generator=gen) > 0.3
        store.append(k, v, real)
        _check(store)
        op = int(torch.randint(0, 6, (1,), generator=gen))
        if op <= 2:  # a decode step's move: the oldest tokens past the sinks, into the newest segment
            store.move_out(_leaving(store, 2, 4), build(0, False))
        elif op == 3:  # into a second representation (with a bias), sometimes first in the list
            store.move_out(_leaving(store, 0, 6), build(1, True), first=bool(step % 2))
        elif op == 4:  # an eviction anywhere
            view = store.view()
            store.keep(torch.rand(view.valid.shape, generator=gen) > 0.15)
        _check(store)
        if step % 5 == 0:  # two changes between reads
            store.append(k, v, real)
            store.move_out(_leaving(store, 2, 4), build(0, False))
            _check(store)
    assert len(store.segments) > 1


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_keep_compacts_every_row_in_order(seed):
    """Rows.keep and compact against a row-by-row reference: kept slots to the front, in order,
    zeros past each row's length, for uniform and ragged results."""
    from kvbench.cache.rows import Rows, compact

    gen = torch.Generator().manual_seed(seed)
    bh, w = 4, 30
    rows = Rows(bh, torch.device("cpu"))
    rows.append({"k": torch.randn(bh, w, 3, generator=gen), "pos": torch.arange(w).expand(bh, w)})
    keep = torch.rand(bh, w, generator=gen) > 0.4
    if seed % 2:  # every row keeps the same number of slots
        keep = torch.zeros(bh, w, dtype=torch.bool)
        for r in range(bh):
            keep[r, torch.randperm(w, generator=gen)[:12]] = True
    before = {name: rows.get(name).clone() for name in rows.fields}
    rows.keep(keep)
    width = int(keep.sum(-1).max())
    assert rows.width == width and rows.lens.tolist() == keep.sum(-1).tolist()
    assert rows.uniform == (len(set(keep.sum(-1).tolist())) == 1)
    for name, old in before.items():
        want = torch.zeros(bh, width, *old.shape[2:], dtype=old.dtype)
        for r in range(bh):
            kept = old[r][keep[r]]
            want[r, : len(kept)] = kept
        assert torch.equal(rows.get(name), want), name
        assert torch.equal(compact(old, keep), want), name


@pytest.mark.parametrize("seed", range(6))
def test_ragged_rows_read_zeros_past_each_row_through_keeps_appends_and_filled_fields(seed):
    """Through keeps that leave rows of different lengths (a compaction clears the column the next
    append takes, which that append then leaves as it is), appends of one token and of ragged
    counts, a state field made with a fill, and rows emptied whole: every row holds its tokens in
    order and reads zeros past its length, in every field made with zeros, against a row-by-row
    reference; a field made with a fill holds it in the slots appended since."""
    from kvbench.cache.rows import Rows

    gen = torch.Generator().manual_seed(seed)
    bh = 3
    rows = Rows(bh, torch.device("cpu"))
    ref: list[list[float]] = [[] for _ in range(bh)]
    filled: list[list[bool]] = [[] for _ in range(bh)]  # per slot: appended since the filled field
    nxt = 0.0

    def take(n: list[int]) -> torch.Tensor:
        nonlocal nxt
        vals = torch.arange(nxt, nxt + sum(n))
        nxt += sum(n)
        return vals

    def check() -> None:
        lens = [len(r) for r in ref]
        assert rows.width == max(lens) and rows.lens.tolist() == lens
        k = rows.get("k")
        for r in range(bh):
            assert k[r, : lens[r], 0].tolist() == ref[r] and not k[r, lens[r] :].any()
        if "state" in rows:
            state = rows.get("state")
            for r in range(bh):
                for j, f in enumerate(filled[r]):
                    assert state[r, j] == (-1.0 if f else 0.0)

    for step in range(40):
        action = torch.randint(0, 5, (1,), generator=gen).item() if step > 1 else 0
        if action in (0, 1) and all(len(r) == len(ref[0]) for r in ref):  # one token or more in every row
            q = 1 + int(action == 0) * 3
            vals = take([q] * bh).view(bh, q, 1).float()
            rows.append({"k": vals})
            for r in range(bh):
                ref[r] += vals[r, :, 0].tolist()
                filled[r] += [True] * q
        elif action in (0, 1):  # rows of different lengths: one token at each row's end
            vals = take([1] * bh).view(bh, 1, 1).float()
            rows.append({"k": vals})
            for r in range(bh):
                ref[r].append(vals[r, 0, 0].item())
                filled[r].append(True)
        elif action == 2:  # ragged counts
            n = torch.randint(0, 3, (bh,), generator=gen).tolist()
            vals = take(n).float()
            rows.append_ragged({"k": vals[:, None]}, torch.tensor(n))
            at = 0
            for r in range(bh):
                ref[r] += vals[at : at + n[r]].tolist()
                filled[r] += [True] * n[r]
                at += n[r]
        elif action == 3 and rows.width:  # a keep: rows of different lengths, or emptied
            keep = torch.rand(bh, rows.width, generator=gen) > (0.3 if step % 7 else 1.0)
            keep &= rows.valid()
            rows.keep(keep)
            for r in range(bh):
                ref[r] = [x for x, k in zip(ref[r], keep[r].tolist()) if k]
                filled[r] = [x for x, k in zip(filled[r], keep[r].tolist()) if k]
        elif action == 4 and "state" not in rows:  # a state made with a fill, past rows compacted
            rows.ensure("state", (), torch.float32, -1.0)
            for r in range(bh):
                filled[r] = [True] * len(ref[r])
        check()


@pytest.mark.parametrize("seed", range(4))
def test_a_compaction_takes_its_zeros_from_a_zero_column_where_the_rows_hold_one(seed):
    """A compaction that leaves rows of different lengths, over rows that hold zeros past their
    width, points the slots past each row's tokens at that column in its one ``index_select``: the
    kept tokens and the zeros past them are those the masked path writes, with zeros to the end of
    each row (where the masked path leaves the columns past :meth:`zeroed_to` unset)."""
    from kvbench.cache.rows import _Compaction

    gen = torch.Generator().manual_seed(seed)
    bh, width, cap = 4, 9, 16
    values = torch.randn(bh, cap, 3, generator=gen)
    values[:, width:] = 0  # what ``Rows`` records as zeroed past the width
    keep = torch.rand(bh, width, generator=gen) > 0.4
    keep[0] = True  # one row keeps every token, the others fewer: rows end short
    for capacity in (width, cap, cap + 5):
        plan = _Compaction.of(keep)
        masked = plan.take(values, capacity)
        zeroed = _Compaction.of(keep).take(values, capacity, zero=width)
        stop = plan.zeroed_to(capacity)
        assert torch.equal(zeroed[:, :stop], masked[:, :stop])
        lens = keep.sum(-1)
        for r in range(bh):
            assert torch.equal(zeroed[r, : lens[r]], values[r, :width][keep[r]])
            assert not zeroed[r, lens[r] :].any()


def test_an_append_clears_its_new_column_in_a_field_made_with_a_fill_after_a_compaction():
    """A compaction leaves columns past the width zeroed for the next appends; a field made
    afterwards with a fill holds the fill there, so that append clears it (a shorter row's
    padding reads zeros, as before), and a keep of rows emptied whole makes empty rows."""
    from kvbench.cache.rows import Rows

    rows = Rows(2, torch.device("cpu"))
    rows.append({"k": torch.ones(2, 4, 1)})
    rows.keep(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool))
    rows.ensure("lrfu", (), torch.float32, float("-inf"))
    rows.append({"k": torch.ones(2, 1, 1)})
    assert rows.get("lrfu")[1].tolist() == [float("-inf")] * 3 + [0.0]
    rows.keep(torch.zeros(2, rows.width, dtype=torch.bool))
    assert rows.width == 0 and rows.get("k").shape == (2, 0, 1)
    rows.keep(torch.zeros(2, 0, dtype=torch.bool))  # rows already empty: nothing to take
    assert rows.width == 0 and rows.get("k").shape == (2, 0, 1)


def test_rows_know_their_lengths_on_the_host_while_they_can():
    """``lens_host`` is ``lens`` where the host knows it without a read: full rows, a compaction's
    counts, grown by later appends; None after an append of counts only the device holds. It holds
    no tensor of its own (what the rows hold stays what they held)."""
    from kvbench.cache import held
    from kvbench.cache.rows import Rows

    gen = torch.Generator().manual_seed(0)
    bh, w = 4, 20
    rows = Rows(bh, torch.device("cpu"))
    rows.append({"k": torch.randn(bh, w, 3, generator=gen)})
    assert rows.lens_host == [w] * bh
    keep = torch.rand(bh, w, generator=gen) > 0.5
    rows.keep(keep)
    assert not rows.uniform and rows.lens_host == rows.lens.tolist() == keep.sum(-1).tolist()
    rows.append({"k": torch.randn(bh, 1, 3, generator=gen)})
    assert rows.lens_host == rows.lens.tolist()
    resident = held.resident_bytes(rows)
    rows._lens_host = None
    assert held.resident_bytes(rows) == resident
    rows.keep(torch.ones(bh, rows.width, dtype=torch.bool))
    assert rows.lens_host == rows.lens.tolist()
    rows.append_ragged({"k": torch.randn(6, 3, generator=gen)}, torch.tensor([3, 0, 2, 1]))
    assert rows.uniform or rows.lens_host is None


def test_packed_rows_extend_in_place_and_read_flat_in_order():
    """A segment with packed fields: an extend of the same count in every head-row writes its own
    tokens into per-head-row buffers with room (no copy of the tokens stored: the buffers stay the
    same tensors until full, then grow by a quarter); bytes and size stay exact without unpacking;
    per-row reads are views of the buffers, parts are slices of them; a flat read unpacks, per
    head-row in order; a ragged extend and an eviction read flat."""
    from kvbench.cache.segments import RowCounts, packed_rows

    @packed_rows("k", "v")
    @dataclass
    class Packed(RowCounts, Segment):
        k: torch.Tensor = None  # type: ignore[assignment]
        v: torch.Tensor = None  # type: ignore[assignment]

        def data_fields(self) -> dict[str, torch.Tensor]:
            return {"k": self.k, "v": self.v}

    bh, d = 3, 4
    gen = torch.Generator().manual_seed(0)

    def make(n, start):
        k, v = torch.randn(bh * n, d, generator=gen), torch.randn(bh * n, 2 * d, generator=gen)
        pos = (torch.arange(n) + start).repeat(bh)
        return Packed(lens=torch.full((bh,), n), pos=pos, k=k, v=v)

    def rows_of(parts, name):
        return torch.cat([getattr(p, name).view(bh, -1, *getattr(p, name).shape[1:]) for p in parts], 1)

    parts = [make(5, 0), make(1, 5), make(2, 6), make(1, 8)]
    want = {name: rows_of(parts, name) for name in ("k", "v", "pos")}
    seg = parts[0]
    seg.extend(parts[1])
    buffers = {name: buf.data_ptr() for name, buf in seg.__dict__["_packed"].items()}
    for part in parts[2:]:
        seg.extend(part)
    assert {name: buf.data_ptr() for name, buf in seg.__dict__["_packed"].items()} == buffers  # in place
    assert seg.size == bh * 9 and seg.nbytes() == bh * 9 * (d + 2 * d) * 4
    for name in ("k", "v", "pos"):
        rows = seg.per_row_field(name)
        assert torch.equal(rows, want[name]) and rows.data_ptr() == buffers[name]  # a view, nothing copied
    part = seg.head_rows(1, 3)
    assert "_packed" in part.__dict__ and torch.equal(part.per_row_field("k"), want["k"][1:3])
    assert "_packed" in seg.__dict__  # counting bytes, reading per row and parts unpacked nothing
    assert torch.equal(seg.k, want["k"].reshape(bh * 9, d))  # a flat read unpacks
    assert "_packed" not in seg.__dict__
    assert torch.equal(seg.v, want["v"].reshape(bh * 9, 2 * d))
    assert torch.equal(seg.pos, want["pos"].reshape(-1))
    seg, parts = make(3, 0), []
    steps = 200
    for step in range(steps):  # grown by a quarter when full: a few buffers for 200 extends
        seg.extend(make(1, 3 + step))
        parts.append(seg.__dict__["_packed"]["k"].data_ptr())
    assert len(set(parts)) <= 6 and seg.size == bh * (3 + steps)
    assert torch.equal(seg.per_row_field("pos"), torch.arange(3 + steps).repeat(bh, 1))
    ragged = make(1, 3 + steps)
    ragged.lens = torch.tensor([1, 0, 2])  # head-rows of different counts: read flat, then ragged
    ragged.k, ragged.v, ragged.pos = ragged.k, ragged.v, torch.tensor([203, 203, 204])
    seg.extend(ragged)
    assert "_packed" not in seg.__dict__ and seg.lens.tolist() == [204, 203, 205]
    assert seg.pos.tolist()[:204][-2:] == [202, 203]
    seg = make(3, 0)
    seg.extend(make(1, 3))
    keep = torch.arange(bh * 4) % 3 != 0
    seg.keep(keep)  # an eviction reads flat, then keeps
    assert seg.size == int(keep.sum()) and seg.pos.shape[0] == seg.size


@pytest.mark.parametrize("seed", range(6))
def test_drop_moves_the_last_tokens_into_the_freed_slots(seed):
    """A drop keeps exactly the other tokens of each row, each with its fields side by side, writes
    only the freed slots, and sort_by puts the rows back in position order as a keep would leave them."""
    from kvbench.cache.rows import Rows

    gen = torch.Generator().manual_seed(seed)
    bh, w, e = 3, 24, 1 + seed % 4
    rows = Rows(bh, torch.device("cpu"))
    rows.append({"k": torch.randn(bh, w, 2, generator=gen), "pos": torch.arange(w).expand(bh, w)})
    before = {name: rows.get(name).clone() for name in rows.fields}
    cols = torch.stack([torch.randperm(w, generator=gen)[:e] for _ in range(bh)])
    if seed in (4, 5):  # the last slots themselves leave (one of them: it moves onto itself)
        cols[0] = torch.arange(w - e, w)
    keep = torch.ones(bh, w, dtype=torch.bool).scatter_(1, cols, False)
    assert rows.lens.tolist() == [w] * bh  # lengths read before: made again after
    rows.drop(cols)
    assert rows.width == w - e and rows.uniform and not rows.ordered and rows.lens.tolist() == [w - e] * bh
    for r in range(bh):
        got = {int(p): k for p, k in zip(rows.get("pos")[r], rows.get("k")[r])}
        assert sorted(got) == before["pos"][r][keep[r]].tolist()
        for p, k in got.items():
            assert torch.equal(k, before["k"][r, p])
        stayed = [c for c in range(w - e) if keep[r, c]]  # slots not freed keep their token
        assert rows.get("pos")[r, stayed].tolist() == stayed
    rows.sort_by("pos")
    assert rows.ordered
    for r in range(bh):
        assert torch.equal(rows.get("k")[r], before["k"][r][keep[r]])


def test_a_store_puts_dropped_rows_back_in_order_for_a_reader_of_the_oldest():
    """After a drop the rows are out of position order; ``fp_view`` (what a representation's
    ``move_out`` masks align with, the oldest first) puts them back."""
    store = LayerStore(1, 2, 4, torch.float32, torch.device("cpu"))
    store.append(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4))
    assert store.can_drop(8) and not store.can_drop(7)  # a quarter at most
    store.drop(torch.tensor([[[2], [5]]]))
    assert not store.in_position_order()
    assert store.view().pos[0, 0].tolist() == [0, 1, 9, 3, 4, 5, 6, 7, 8]
    assert store.fp_view("pos").tolist() == [[0, 1, 3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 6, 7, 8, 9]]
    assert store.in_position_order()


@pytest.mark.parametrize(
    "leaving", [[[1, 1]], [[3, 3]], [[2, 1]], [[4, 4]], [[5, 5]], [[2, 2], [2, 2]], [[1, 1], [1, 2]]]
)
def test_a_keep_of_a_few_drops_them_where_every_row_loses_as_many(leaving):
    """``keep(mask, few=True)`` keeps what a compaction keeps, each token with its key and value:
    where every head-row (of one sequence or two) loses the same few (at most a quarter of 16), by
    drops (the rows then out of position order); where they lose different numbers, or more, by
    the compaction (in order)."""
    batch = len(leaving)
    gen = torch.Generator().manual_seed(sum(map(sum, leaving)) + batch)
    k, v = torch.randn(batch, 2, 16, 4, generator=gen), torch.randn(batch, 2, 16, 4, generator=gen)
    mask = torch.ones(batch, 2, 16, dtype=torch.bool)
    for seq, heads in enumerate(leaving):
        for head, n in enumerate(heads):
            mask[seq, head, torch.randperm(16, generator=gen)[:n]] = False
    stores = []
    for few in (False, True):
        store = LayerStore(batch, 2, 4, torch.float32, torch.device("cpu"))
        store.append(k, v)
        store.keep(mask, few=few)
        stores.append(store)
    compacted, kept = stores
    counts = {n for heads in leaving for n in heads}
    assert kept.in_position_order() == (len(counts) > 1 or 4 * counts.pop() > 16)
    mine, theirs = kept.view(), compacted.view()
    for seq in range(batch):
        for head in range(2):
            live, other = mine.valid[seq, head], theirs.valid[seq, head]
            pos = mine.pos[seq, head][live]
            order = pos.argsort()
            assert torch.equal(pos[order], theirs.pos[seq, head][other])
            for name in ("k", "v"):
                exact = getattr(mine, name)[seq, head][live][order]
                assert torch.equal(exact, getattr(theirs, name)[seq, head][other])


@pytest.mark.parametrize(
    "start, moved, width", [(0, 1, 24), (4, 1, 24), (4, 9, 24), (2, 150, 200), (0, 24, 24)]
)
def test_taking_columns_is_taking_their_mask(start, moved, width):
    """Columns the host names (every row the same) leave as the mask of those columns does: the
    same tokens taken, flat and head-major, the same rows left at the same capacity (a move of most
    of the rows gives their memory back), in fewer operations (no count, no plan)."""
    from kvbench.cache.rows import Columns, Rows
    from kvbench.eval.stepcost import LaunchCounter

    gen = torch.Generator().manual_seed(start + moved + width)
    bh = 3
    both = [Rows(bh, torch.device("cpu")) for _ in range(2)]
    fields = {"k": torch.randn(bh, width, 2, generator=gen), "pos": torch.arange(width).expand(bh, width)}
    for rows in both:
        rows.append(fields)
    move = torch.zeros(bh, width, dtype=torch.bool)
    move[:, start : start + moved] = True
    with LaunchCounter() as by_mask:
        taken_mask = both[0].take_out(move, per_row=moved)
    with LaunchCounter() as by_columns:
        taken_cols = both[1].take_columns(Columns(start, start + moved))
    assert taken_mask is not None and taken_cols is not None
    assert taken_cols[2] == taken_mask[2] == moved and torch.equal(taken_cols[1], taken_mask[1])
    for name in fields:
        assert torch.equal(taken_cols[0][name], taken_mask[0][name]) and taken_cols[0][name].is_contiguous()
    a, b = both
    assert (a.width, a.capacity, a.uniform) == (b.width, b.capacity, b.uniform)
    for name in fields:
        assert torch.equal(a.get(name), b.get(name))
    assert by_columns.ops < by_mask.ops
    assert b.take_columns(Columns(1, 1)) is None  # nothing named, nothing taken


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fill", [float("-inf"), 0.0])
def test_a_state_holds_its_fill_until_set(batch, seed, fill):
    """A per-token state declared with a fill: a token stored before the state was made, or since
    it was last set, holds the fill; a set token keeps its value. Through appends (padded too),
    moves into another segment, evictions and drops, in every segment. (A fill of zero: a decode
    step's append writes none where the rows hold zeros past their width already.)"""
    from kvbench.cache.side import TokenState

    st = TokenState("t", fill=fill)
    gen = torch.Generator().manual_seed(seed)
    h, d = 2, 4
    store = LayerStore(batch, h, d, torch.float32, torch.device("cpu"))
    set_below = torch.zeros(batch, dtype=torch.long)  # positions below hold ``pos + 0.5``

    def moved(k, v, pos, lens):
        return _Halved(lens=lens, pos=pos, k=k, v=v)

    for step in range(50):
        q = 8 if step == 0 else int(torch.randint(1, 3, (1,), generator=gen))
        real = None
        if batch > 1 and step % 7 == 3:
            real = torch.rand(batch, q, generator=gen) > 0.3
        store.append(
            torch.randn(batch, h, q, d, generator=gen), torch.randn(batch, h, q, d, generator=gen), real
        )
        op = int(torch.randint(0, 6, (1,), generator=gen))
        if op == 0 and step > 10:
            store.move_out(_leaving(store, 2, 4), moved)
        elif op == 1:
            store.keep(torch.rand(store.view().valid.shape, generator=gen) > 0.15)
        elif op == 2 and step >= 5:  # the state made (at step 5 at the latest) or set
            view = store.view()  # padding slots given as zeros where the fill is 0 (Rows.set)
            values = view.pos.float() + 0.5
            store.set_state(st, values if fill else torch.where(view.valid, values, 0.0))
            set_below = torch.tensor(store.seen_host)
        elif op == 3 and store.can_drop(store.view().pos.shape[2] - 1):
            width = store.view().pos.shape[2]
            store.drop(torch.randint(0, width, (batch, h, 1), generator=gen))
        if step >= 5:
            view, got = store.view(), store.state(st)
            want = torch.where(view.pos < set_below[:, None, None], view.pos.float() + 0.5, fill)
            assert torch.equal(got[view.valid], want[view.valid]), step
    assert len(store.segments) > 1


@pytest.mark.parametrize("marked", [(True, False, True, False), (False, True, False, False), (True,) * 4])
@pytest.mark.parametrize("col", [0, 3])
def test_closing_a_column_is_keeping_the_rest(marked, col):
    """Rows.close_column against Rows.keep of the same slots, step after step (a token in, the
    column out): the same fields in every slot to the width (the zeros past a row's end included),
    the same lengths and capacity, written in place where the capacity stays."""
    from kvbench.cache.rows import Rows

    bh, stop, long = len(marked), 9, 20

    def filled() -> Rows:
        gen = torch.Generator().manual_seed(col)
        rows = Rows(bh, torch.device("cpu"))
        w = stop if all(marked) else long
        rows.append({"k": torch.randn(bh, w, 2, generator=gen), "pos": torch.arange(w).expand(bh, w)})
        if not all(marked):  # the marked rows hold ``stop`` tokens, the others all of theirs
            rows.keep(~torch.tensor(marked)[:, None] | (torch.arange(w) < stop)[None, :])
        return rows

    a, b = filled(), filled()
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        if step:  # a token in: the marked rows hold ``stop`` again
            new = {"k": torch.randn(bh, 1, 2, generator=gen), "pos": torch.full((bh, 1), 100 + step)}
            a.append(dict(new))
            b.append(dict(new))
        before, capacity = dict(a.fields), a.capacity
        keep = b.valid().clone()
        keep[torch.tensor(marked), col] = False
        a.close_column(col, stop, marked)
        b.keep(keep)
        assert a.width == b.width and a.uniform == b.uniform and a.lens.tolist() == b.lens.tolist()
        assert a.capacity == b.capacity  # what a keep leaves them holding
        for name, field in before.items():
            assert (a.fields[name] is field) == (a.capacity == capacity)  # in place unless resized
            assert torch.equal(a.fields[name][:, : a.width], b.fields[name][:, : b.width]), (step, name)


@pytest.mark.parametrize("protect", [None, 5, [4, 9]])
def test_protected_slots_from_host_figures_equal_those_from_the_device(protect):
    """Where the sequences share their length (and protected start), the budget compares positions
    with that one number; elsewhere with each sequence's on the device: the same slots."""
    from kvbench.roles import Budget

    gen = torch.Generator().manual_seed(0)
    store = LayerStore(2, 2, 4, torch.float32, torch.device("cpu"))
    budget = Budget(fraction=0.5, budget_tokens=None, sinks=2, window=3)
    store.set_protect_from(None if protect is None else torch.tensor(protect))
    for step in range(12):
        q = 6 if step == 0 else 1
        real = torch.tensor([[step % 4 != 2] * q, [step % 4 != 1] * q])  # one behind, then level
        store.append(torch.randn(2, 2, q, 4, generator=gen), torch.randn(2, 2, q, 4, generator=gen), real)
        seen, start = store.seen[:, None, None], store.protect_from
        view_pos, fp_pos = store.view().pos, store.fp_view("pos")
        want_view = (view_pos < 2) | (view_pos >= seen - 3)
        want_fp = (fp_pos < 2) | (fp_pos >= store.seen.repeat_interleave(2)[:, None] - 3)
        if start is not None:
            want_view = want_view | (view_pos >= start[:, None, None])
            want_fp = want_fp | (fp_pos >= start.repeat_interleave(2)[:, None])
        assert torch.equal(budget.protected_view(store), want_view)
        assert torch.equal(budget.protected_fp(store), want_fp)


def test_true_slots_are_nonzero_s_taken_at_the_known_count():
    """:func:`rows.true_slots`: the True slots of a mask row after row, as ``nonzero`` gives them,
    taken at the count the caller knows (no read of it from the device)."""
    from kvbench.cache.rows import true_slots

    gen = torch.Generator().manual_seed(3)
    for shape in [(1, 1), (3, 7), (8, 130), (16, 2)]:
        for p in (0.0, 0.3, 1.0):
            mask = torch.rand(shape, generator=gen) < p
            rows, cols = true_slots(mask, int(mask.sum()))
            want = mask.nonzero(as_tuple=True)
            assert torch.equal(rows, want[0]) and torch.equal(cols, want[1])


@pytest.mark.parametrize("seen", [[7], [7, 7, 7], [3, 9]])
def test_step_positions_make_the_lengths_after_from_the_positions(seen, monkeypatch):
    """A step's positions and the lengths after it, for one sequence, a batch at one length and
    ragged lengths: the lengths after are made from the last positions, not uploaded from a host
    list (on a GPU that upload waits for the stream)."""
    from kvbench.cache import positions

    monkeypatch.setattr(positions, "_STEP", {})
    qpos, after = positions.step_positions(torch.device("cpu"), seen, 3)
    assert qpos.tolist() == [[n, n + 1, n + 2] for n in seen]
    assert after.tolist() == [n + 3 for n in seen] and after.dtype == torch.long
    uploads = []
    made = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: uploads.append(a[0]) or made(*a, **k))
    positions.step_positions(torch.device("cpu"), [n + 3 for n in seen], 1)
    assert uploads == ([] if len(set(seen)) == 1 else [[n + 3 for n in seen]])  # ragged: the positions


def test_a_decode_append_clears_a_state_only_where_the_rows_hold_no_zeros_past_their_width():
    """A decode step's append to full rows gives keys, values and positions; a state of fill 0 is
    not given. Past a resize (zeros past the width) the appends write nothing to it, one launch
    fewer a step; past a compaction (slots past the width unset) the next append clears its
    column. The state reads 0 at every token appended since it was last set."""
    from kvbench.cache.side import TokenState
    from kvbench.eval.stepcost import LaunchCounter

    st = TokenState("t")
    gen = torch.Generator().manual_seed(0)
    store = LayerStore(1, 2, 4, torch.float32, torch.device("cpu"))

    def append() -> int:
        k, v = torch.randn(2, 1, 2, 1, 4, generator=gen)
        with LaunchCounter() as counter:
            store.append(k, v)
        return counter.by_op.get("fill_", 0)

    store.append(torch.randn(1, 2, 8, 4, generator=gen), torch.randn(1, 2, 8, 4, generator=gen))
    store.set_state(st, torch.ones(1, 2, 8))
    rows = store.segments[0].rows
    fills = [append() for _ in range(rows.capacity - rows.width + 3)]  # through a resize
    assert sum(fills) == 0
    store.keep(store.view().pos != 3)  # full rows compacted: nothing known past the width
    assert append() == 1
    got = store.state(st)[0, :, 8:]
    assert torch.equal(got, torch.zeros_like(got)), "appended tokens hold the fill"
    assert torch.equal(store.state(st)[0, :, :7], torch.ones(2, 7))


def test_a_tensor_memo_answers_by_identity_and_forgets_a_freed_tensor():
    """What :class:`devices.TensorMemo` remembers of a tensor is found for that tensor object alone
    (an equal tensor, or a view of it, is another key; no elementwise comparison is made) and
    is dropped when the tensor is freed, so a new tensor at its address is not taken for it."""
    import gc

    from kvbench.cache import devices, ragged

    memo = devices.TensorMemo()
    a, b = torch.tensor([3, 3]), torch.tensor([3, 3])
    memo[a] = 3
    assert a in memo and memo[a] == 3 and memo.get(a) == 3
    assert b not in memo and memo.get(b, "none") == "none" and a[:] not in memo
    with pytest.raises(KeyError):
        memo[b]
    memo[a] = None  # told again: the last value stands, and one entry is kept
    assert a in memo and memo[a] is None and len(memo) == 1
    del a
    gc.collect()
    assert len(memo) == 0
    lens = ragged.tell(torch.tensor([2, 5]), None)
    assert ragged.same_count(lens) is None and ragged.told(lens) is None
    assert ragged.same_count(torch.tensor([4, 4])) == 4


@pytest.mark.parametrize("batch", [1, 2])
def test_keys_and_values_read_without_a_view_are_the_views(batch):
    """``keys()`` and ``kv()`` give the view's keys and values, with its strides; over rows that
    every head fills (appends, drops) they make no view. ``changes`` counts every change to the
    stored tokens, appends included, and reading changes nothing."""
    gen = torch.Generator().manual_seed(batch)
    h, d = 2, 4
    store = LayerStore(batch, h, d, torch.float32, torch.device("cpu"))
    for step in range(12):
        q = 10 if step == 0 else 1
        before = store.changes
        store.append(torch.randn(batch, h, q, d, generator=gen), torch.randn(batch, h, q, d, generator=gen))
        if step % 3 == 2:  # an eviction of one token a head-row: the rows stay full, out of order
            store.drop(torch.randint(0, store.columns(), (batch, h, 1), generator=gen))
        assert store.changes > before
        changes = store.changes
        keys, (k, v) = store.keys(), store.kv()
        assert store._view is None  # dense rows: read as they are
        view = store.view()
        for got, want in ((keys, view.k), (k, view.k), (v, view.v)):
            assert torch.equal(got, want) and got.stride() == want.stride()
        assert store.keys() is view.k  # a view made: its own
        assert store.changes == changes
    store.keep(torch.rand(view.valid.shape, generator=gen) > 0.3)  # ragged rows: the view's
    keys, (k, v) = store.keys(), store.kv()
    view = store.view()
    assert keys is view.k and k is view.k and v is view.v


def test_a_decode_append_through_the_views_writes_what_the_general_append_writes(monkeypatch):
    """One sequence's decode appends (:meth:`Rows.append_kv`: keys and values through the 4-d views
    a read keeps, positions joining the pending run) leave every field, width and position as the
    general path does, across reads, chunks, growth of the capacity, a compaction, a drop and its
    sort back into order, and a state field; where they do not apply they write nothing and say so."""
    from kvbench.cache.rows import Rows

    gen = torch.Generator().manual_seed(0)
    h, d = 2, 4
    fast, slow = (LayerStore(1, h, d, torch.float32, torch.device("cpu")) for _ in range(2))
    taken = []
    plain_append_kv = Rows.append_kv

    def spy(self, *args):
        taken.append(plain_append_kv(self, *args))
        return taken[-1]

    for step in range(70):
        q = 9 if step == 0 else 3 if step == 21 else 1  # a chunk after reads, too
        k, v = torch.randn(1, h, q, d, generator=gen), torch.randn(1, h, q, d, generator=gen)
        monkeypatch.setattr(Rows, "append_kv", spy)
        fast.append(k, v)
        monkeypatch.setattr(Rows, "append_kv", lambda self, *args: False)
        slow.append(k, v)
        if step % 5 == 4:
            for s in (fast, slow):
                s.kv()  # a read: the views the next appends write through
        if step == 30:  # a compaction: new field tensors, the views kept of the old ones stale
            keep = torch.ones(1, h, fast.columns(), dtype=torch.bool)
            keep[..., 3:5] = False
            for s in (fast, slow):
                s.keep(keep)
        if step == 40:
            col = torch.randint(0, fast.columns(), (1, h, 1), generator=gen)
            for s in (fast, slow):
                s.drop(col)
        if step == 50:  # a reader of the oldest puts the dropped rows back in order, in place
            for s in (fast, slow):
                s._in_order()
        a, b = fast.view(), slow.view()
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.pos, b.pos)
        assert fast._fp.rows.width == slow._fp.rows.width and fast.seen_host == slow.seen_host
    assert any(taken) and not all(taken)  # it took most decode steps, and declined where it must
    fast._fp.rows.ensure("score", (), torch.float32)  # a state field: the general path only
    rows = fast._fp.rows
    before = (rows.width, {n: f.clone() for n, f in rows.fields.items()})
    assert not rows.append_kv(k, v, torch.tensor([[fast.seen_host[0]]]), fast.seen_host[0])
    assert rows.width == before[0] and all(torch.equal(f, before[1][n]) for n, f in rows.fields.items())


def test_a_layer_decoded_in_one_buffer_is_the_general_decode(tiny, monkeypatch):
    """Where every representation decodes both fields into its slots (KIVI on the torch path), a
    layer is decoded into one buffer without the general case's bookkeeping
    (:func:`kvbench.cache.view._decoded_in_one`): the same keys and values, bit for bit, for the
    whole layer and a block of its head-rows, as the general decode gives them."""
    from helpers import make_stack, run_chunks, tokens
    from kvbench.compressors.quantized import QuantizedCompressor, QuantSegment

    stack = make_stack(tiny, compressor=QuantizedCompressor(bits=2, group_size=8), window=8, sinks=2)
    _, cache = run_chunks(tiny, stack, tokens(60), [40, 8, 1, 1])
    from kvbench.cache import view

    taken = []
    in_one = view._decoded_in_one
    rows = cache.stores[0].batch * cache.stores[0].kv_heads
    for store in cache.stores:
        assert len(store.segments) == 2
        monkeypatch.setattr(view, "_decoded_in_one", lambda *a: taken.append(1) or in_one(*a))
        fast = [store.decoded(), store.decoded(1, rows)]
        monkeypatch.undo()
        monkeypatch.setattr(QuantSegment, "ZEROED", True)  # the general path (its buffer zeroed first)
        general = [store.decoded(), store.decoded(1, rows)]
        monkeypatch.undo()
        for (k, v), (k2, v2) in zip(fast, general):
            assert torch.equal(k, k2) and torch.equal(v, v2)
    assert len(taken) == 2 * len(cache.stores)


@pytest.mark.parametrize("scheduler", ["streaming_llm", "h2o", "lru"])
def test_one_sequence_of_one_kv_head_evicts_at_its_decode_steps(scheduler):
    """A model with one KV head (multi-query attention, as Gemma-2B's) and one sequence: a decode
    step's one-token eviction moves its last slot into the freed one though the two are slices
    of one row (index_copy_ refuses a source that overlaps the field). The step keeps the budget
    and gives the logits of the same sequence twice in a batch (two rows, where no row overlaps)."""
    from conftest import tiny_cfg
    from helpers import make_stack, tokens
    from kvbench import models
    from kvbench.eval import loop
    from kvbench.schedulers.h2o import H2OScheduler
    from kvbench.schedulers.lru import LRUScheduler
    from kvbench.schedulers.streaming_llm import StreamingLLMScheduler

    make = {"streaming_llm": StreamingLLMScheduler, "h2o": H2OScheduler, "lru": LRUScheduler}[scheduler]
    lm = models.load(tiny_cfg("llama", heads=6, num_key_value_heads=1), "cpu")
    ids = tokens(80)
    stack = make_stack(lm, scheduler=make(), budget=0.5, sinks=2, window=4)
    cache = loop.new_cache(lm, stack)
    solo = [loop.step(lm, cache, ids, keep=1)[-1]]
    for _ in range(4):
        solo.append(loop.step(lm, cache, [int(solo[-1].argmax())])[-1])
        seen = cache.stores[0].seen_host[0]
        assert all(s.stored_tokens() == (seen + 1) // 2 for s in cache.stores)  # the budget: one out
    stack = make_stack(lm, scheduler=make(), budget=0.5, sinks=2, window=4)
    cache = loop.new_cache(lm, stack, batch=2)
    chunk = torch.tensor([ids, ids])
    twice = []
    for _ in range(5):
        twice.append(loop.forward_batch(lm, cache, chunk, torch.ones_like(chunk, dtype=torch.bool))[:, -1])
        cache.after_forward()
        chunk = twice[-1].argmax(-1, keepdim=True)
    for row in range(2):
        torch.testing.assert_close(torch.stack(twice)[:, row], torch.stack(solo), rtol=0, atol=1e-5)
