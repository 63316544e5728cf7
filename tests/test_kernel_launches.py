"""What a layer's decode attention launches on the Triton path (issue 30), counted under
``TRITON_INTERPRET=1`` (conftest sets it where there is no CUDA): each segment's kernel writes its
splits' softmax state into the device's workspace, one kernel merges them into the output, and
nothing else runs, however many splits, pages or segments the step reads. Counted by
:class:`kvbench.eval.stepcost.LaunchCounter`, which counts a Triton launch as one operation (and
not the torch operations its interpreter runs for it), inside the engine's read of the stored
tokens, on decode steps only."""

from __future__ import annotations

import pytest
import torch

from kvbench import config, models
from kvbench.cache import engine
from kvbench.eval import stepcost
from kvbench.kernels import attention as ka
from kvbench.kernels import dispatch

# Llama-3.1-8B's query group (4 query heads per KV head), at a size the interpreter runs quickly
MODEL = {
    **stepcost.LAUNCH_MODEL,
    "name": "launch_small",
    "config": {
        **stepcost.LAUNCH_MODEL["config"],
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
}
CONTEXT = 600  # several splits of the stored slots and some forty of Quest's pages per head-row
ALLOCATIONS = frozenset({"empty", "empty_strided", "new_empty"})  # no launch on a GPU


@pytest.fixture(scope="module")
def lm():
    config.register()
    return models.load(stepcost.model_config(MODEL), "cpu")


def attention_launches(lm, technique: str) -> list[dict[str, int]]:
    """Per layer's read of its stored tokens in two decode steps (the engine's
    :func:`engine._attend_decoded`, its parts alone (:func:`engine._attend_parts`), or the kernel's
    :func:`ka.attend` over the pages a read selector names): the operations it ran (Triton kernels
    as ``triton.<name>``), allocations left out. Quest selects pages in every layer
    (:data:`stepcost.MODEL_OVERRIDES`)."""
    stack = stepcost.technique_stack(lm, technique, 0.5)
    counter = stepcost.LaunchCounter()
    calls: list[dict[str, int]] = []
    depth = [0]

    def counting(read, by_store: bool):
        def counted(store_or_query, query_or_key, *args, **kwargs):
            query = query_or_key if by_store else store_or_query
            if query.shape[2] != 1 or depth[0]:  # the prefill, or a read inside one counted
                return read(store_or_query, query_or_key, *args, **kwargs)
            before = dict(counter.by_op)
            depth[0] += 1
            try:
                out = read(store_or_query, query_or_key, *args, **kwargs)
            finally:
                depth[0] -= 1
            ran = {k: n - before.get(k, 0) for k, n in counter.by_op.items() if n != before.get(k, 0)}
            if out is not None:  # None: a segment had no part (the step is then read as decoded)
                calls.append({k: n for k, n in ran.items() if k not in ALLOCATIONS})
            return out

        return counted

    reads = engine._attend_decoded, engine._attend_parts, ka.attend
    engine._attend_decoded, engine._attend_parts, ka.attend = (
        counting(reads[0], True),
        counting(reads[1], True),
        counting(reads[2], False),
    )
    try:
        with dispatch.using("triton"):
            stepcost.kvbench_run(lm, stack, [3 + i % 250 for i in range(CONTEXT)])(2, counter)
    finally:
        engine._attend_decoded, engine._attend_parts, ka.attend = reads
    return calls


@pytest.mark.parametrize(
    "technique, kernels",
    [
        # a read selector's pages: the grid covers those it names, some seven of forty
        ("scheduler/quest", ("triton._decode_kernel",)),
        # a position router's blocks: the grid covers the two of eight it names
        ("router/base", ("triton._decode_kernel",)),
        # a centroid router's experts, listed: the grid covers the routed slots at most
        ("router/topk_balanced", ("triton._decode_kernel",)),
        # ragged heads: each head-row read to its own length
        ("scheduler/adakv", ("triton._decode_kernel",)),
        # two segments: KIVI's codes and the full-precision window, each its own partials
        ("compressor/quantized", ("triton._kivi_decode_kernel", "triton._decode_kernel")),
    ],
)
def test_a_layers_decode_attention_is_its_partials_and_one_merge(lm, technique, kernels):
    calls = attention_launches(lm, technique)
    assert calls, f"{technique}: no decode step read its tokens through the engine"
    want = {name: kernels.count(name) for name in kernels} | {"triton._merge_kernel": 1}
    for ran in calls:
        assert ran == want, f"{technique}: {ran}"


def test_merged_segments_are_read_in_place_from_the_workspace():
    """Two segments' partials, taken one after the other, merge in one launch without a copy and
    give what attention over both gives; the merge gives their room back."""
    torch.manual_seed(0)
    q = torch.randn(1, 8, 1, 32)
    k1, v1, k2, v2 = (torch.randn(1, 2, n, 32) for n in (700, 700, 90, 90))
    room = ka.workspace(q.device, 32)
    used = room.used
    parts = [ka.partials(q, k1, v1, None, 0.2), ka.partials(q, k2, v2, None, 0.2)]
    assert parts[0].m.shape[0] > 1  # several splits
    whole = room.adjacent(parts)
    assert whole is not None and whole.m.data_ptr() == parts[0].m.data_ptr()
    counter = stepcost.LaunchCounter()
    with counter:
        out = ka.merge(parts, q, 2)
    assert counter.by_op.get("cat", 0) == 0 and counter.by_op["triton._merge_kernel"] == 1
    assert room.used == used
    want = ka.attend_reference(q, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2), None, 0.2)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-5)


def test_splits_follow_the_rows_and_the_length():
    """Enough splits to keep the device's programs busy at batch 1, fewer for more rows, none
    shorter than MIN_SPLIT slots."""
    one_row, per_split = ka.split_slots(32768, 8)
    assert (one_row + 1) * 8 >= ka.PROGRAMS and per_split >= ka.MIN_SPLIT  # splits of whole blocks
    assert ka.split_slots(32768, 64)[0] < one_row
    assert ka.split_slots(300, 8)[0] == 2 and ka.split_slots(100, 8)[0] == 1
