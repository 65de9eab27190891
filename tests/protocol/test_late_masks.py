"""Late masks (the `masks` message) on the worker side: decoding, merging into the plan rows
marked `mask_late`, and the plan checks on those rows."""

from __future__ import annotations

import numpy as np
import pytest

from nsaserve.protocol.arrays import I32, U32, U64, ProtocolError
from nsaserve.protocol.builder import RequestSpec, build_plan
from nsaserve.protocol.late_masks import apply_late_masks, late_rows
from nsaserve.protocol.messages import LateMasks, late_masks_from_msg, unpack
from nsaserve.protocol.validate import validate_plan

PAGE = 4


def masks(step: int, entries: dict[int, list[int]]) -> LateMasks:
    words = [w for ws in entries.values() for w in ws]
    start = np.cumsum([0] + [len(ws) for ws in entries.values()]).astype(I32)
    return LateMasks(step, np.array(list(entries), dtype=U64), start, np.array(words, dtype=U32))


def plan_with_late_rows():
    return build_plan(
        7,
        PAGE,
        [
            RequestSpec(1, [-1], 3, [0], input_prev_row=0, mask_late=True),
            RequestSpec(2, [5], 2, [1], allowed_tokens=[4]),  # its mask is in the plan
            RequestSpec(3, [-1], 5, [2, 3], input_prev_row=1, mask_late=True),
            RequestSpec(4, [6], 1, [4]),
        ],
    )


def mask_of(plan, i: int) -> list[int]:
    return plan.mask_words[plan.mask_start[i] : plan.mask_start[i + 1]].tolist()


def test_the_message_round_trips():
    m = masks(9, {5: [1, 2], 2**40: [3]})
    back = late_masks_from_msg(unpack(m.encode()))
    assert back.step == 9 and {k: v.tolist() for k, v in back.masks().items()} == {5: [1, 2], 2**40: [3]}
    bad = unpack(m.encode())
    bad["mask_start"] = np.array([0, 5, 3], dtype=I32).tobytes()
    with pytest.raises(ProtocolError, match="mask_start"):
        late_masks_from_msg(bad)


def test_late_rows_get_their_masks_and_the_rest_keep_theirs():
    plan = plan_with_late_rows()
    assert late_rows(plan).tolist() == [0, 2]
    merged, errors = apply_late_masks(plan, masks(7, {3: [0, 1 << 5], 1: [1 << 9]}), vocab_size=64)
    assert errors == []
    assert [mask_of(merged, i) for i in range(4)] == [[1 << 9], [4], [0, 1 << 5], []]
    assert not merged.mask_late.any()
    runnable, faults = validate_plan(merged, num_pages=8, vocab_size=64)
    assert faults == [] and runnable.num_reqs == 4


def test_rows_left_out_sample_unmasked_and_strangers_are_ignored():
    plan = plan_with_late_rows()
    # Request 3 ended meanwhile (left out); 2 is not a late row and 99 not in the plan: ignored.
    merged, errors = apply_late_masks(plan, masks(7, {1: [2], 2: [8], 99: [1]}), vocab_size=64)
    assert errors == []
    assert [mask_of(merged, i) for i in range(4)] == [[2], [4], [], []]
    # Another step's masks fit no row of this one.
    merged, _ = apply_late_masks(plan, masks(6, {1: [2]}), vocab_size=64)
    assert [mask_of(merged, i) for i in range(4)] == [[], [4], [], []]


def test_a_mask_allowing_no_token_of_the_vocabulary_fails_its_request():
    plan = plan_with_late_rows()
    # Token 40 is past a 40-token vocabulary: request 1's mask allows nothing it could sample.
    merged, errors = apply_late_masks(plan, masks(7, {1: [0, 1 << 8], 3: [1]}), vocab_size=40)
    assert [r for r, _ in errors] == [1] and "allows no token" in errors[0][1]
    assert mask_of(merged, 0) == [] and mask_of(merged, 2) == [1]


def test_mask_late_needs_a_sampling_row_without_a_mask():
    reqs = [
        RequestSpec(1, [1, 2], 0, [0], sample=False, mask_late=True),
        RequestSpec(2, [3], 1, [1], allowed_tokens=[1], mask_late=True),
        RequestSpec(3, [-1], 1, [2], input_prev_row=0, mask_late=True),
    ]
    runnable, errors = validate_plan(build_plan(2, PAGE, reqs), num_pages=8)
    assert [r for r, _ in errors] == [1, 2] and all("mask_late" in why for _, why in errors)
    assert runnable.req_ids.tolist() == [3]
