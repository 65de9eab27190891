"""Rank 0 waiting for a step's late masks: the plan socket's inbox (worker/inbox.py) and the
sequential step loop (run_plan) with the null executor, which honours masks."""

from __future__ import annotations

from collections import deque

import numpy as np

from nsaserve.protocol.arrays import I32, U32, U64
from nsaserve.protocol.builder import RequestSpec, build_plan
from nsaserve.protocol.messages import SHUTDOWN, LateMasks, encode_plan
from nsaserve.worker.executor import NullExecutor
from nsaserve.worker.inbox import PlanInbox, message_kind
from nsaserve.worker.main import late_masks_merger, run_plan
from nsaserve.worker.prev_step import PrevStep

PAGE = 4
VOCAB = 64


def masks(step: int, entries: dict[int, list[int]]) -> bytes:
    words = [w for ws in entries.values() for w in ws]
    start = np.cumsum([0] + [len(ws) for ws in entries.values()]).astype(I32)
    return LateMasks(step, np.array(list(entries), dtype=U64), start, np.array(words, dtype=U32)).encode()


def only(token: int) -> list[int]:
    words = [0] * (VOCAB // 32)
    words[token // 32] = 1 << (token % 32)
    return words


def inbox_of(messages: list[bytes]) -> tuple[PlanInbox, deque]:
    queue = deque(messages)
    return PlanInbox(queue.popleft, lambda: bool(queue)), queue


def test_message_kinds_are_read_from_the_first_bytes():
    plan = encode_plan(build_plan(1, PAGE, [RequestSpec(1, [3], 0, [0])]))
    assert message_kind(plan) == "plan"
    assert message_kind(SHUTDOWN) == "shutdown"
    assert message_kind(masks(3, {1: [1]})) == "masks"
    assert message_kind(b"\x00garbage") is None


def test_the_inbox_skips_masks_nobody_waits_for():
    p1, p2 = (encode_plan(build_plan(s, PAGE, [RequestSpec(1, [3], 0, [0])])) for s in (1, 2))
    inbox, queue = inbox_of([masks(1, {}), p1, masks(2, {}), masks(3, {}), p2])
    assert inbox.recv() == p1
    assert inbox.waiting() and inbox.recv() == p2  # the two stray masks are gone
    assert not inbox.waiting() and not queue


def test_masks_are_found_by_step_and_a_plan_first_is_held():
    plan = encode_plan(build_plan(5, PAGE, [RequestSpec(1, [3], 0, [0])]))
    inbox, _ = inbox_of([masks(3, {1: [1]}), masks(4, {1: [2]}), plan])
    got = inbox.masks_for(4)
    assert got.step == 4 and got.masks()[1].tolist() == [2]
    assert inbox.masks_for(5) is None  # the next plan came first: it waits for recv()
    assert inbox.recv() == plan


def late_plan(step: int, prev_row: int) -> bytes:
    return encode_plan(
        build_plan(step, PAGE, [RequestSpec(1, [-1], step - 1, [0, 1], input_prev_row=prev_row, mask_late=True)])
    )


def run_sequence(messages: list[bytes]) -> list:
    """run_plan over the messages, as rank 0's sequential loop does."""
    ex = NullExecutor(vocab_size=VOCAB, num_pages=16, page_size=PAGE, max_context=64)
    inbox, _ = inbox_of(messages)
    merge = late_masks_merger(inbox, VOCAB, True)
    prev = PrevStep(True)
    results = []
    while True:
        result, _ = run_plan(inbox.recv(), ex, True, prev, merge)
        if result is None:
            return results
        results.append(result)


def test_a_late_row_samples_under_the_mask_that_follows_its_plan():
    first = encode_plan(build_plan(1, PAGE, [RequestSpec(1, [3], 0, [0, 1])]))
    results = run_sequence([first, late_plan(2, 0), masks(2, {1: only(41)}), SHUTDOWN])
    assert [r.errors for r in results] == [[], []]
    assert results[1].sampled[0][:2] == (1, 41)


def test_a_late_row_left_out_samples_unmasked():
    first = encode_plan(build_plan(1, PAGE, [RequestSpec(1, [3], 0, [0, 1])]))
    unmasked = run_sequence(
        [first, encode_plan(build_plan(2, PAGE, [RequestSpec(1, [-1], 1, [0, 1], input_prev_row=0)])), SHUTDOWN]
    )
    late = run_sequence([first, late_plan(2, 0), masks(2, {}), SHUTDOWN])
    assert late[1].sampled == unmasked[1].sampled and late[1].errors == []


def test_masks_that_never_come_fail_only_the_late_rows():
    """A plan arriving while masks are awaited (a router that could not send them): the late
    request fails, its token is not sent, and the plan that came first still runs."""
    first = encode_plan(build_plan(1, PAGE, [RequestSpec(1, [3], 0, [0, 1]), RequestSpec(2, [4], 0, [2])]))
    second = encode_plan(
        build_plan(
            2,
            PAGE,
            [
                RequestSpec(1, [-1], 1, [0, 1], input_prev_row=0, mask_late=True),
                RequestSpec(2, [-1], 1, [2], input_prev_row=1),
            ],
        )
    )
    third = encode_plan(build_plan(3, PAGE, [RequestSpec(2, [-1], 2, [2], input_prev_row=1)]))
    results = run_sequence([first, second, third, SHUTDOWN])
    assert [r.step for r in results] == [1, 2, 3]
    assert [r for r, _ in results[1].errors] == [1] and "did not arrive" in results[1].errors[0][1]
    assert [e[0] for e in results[1].sampled] == [2]
    assert [e[0] for e in results[2].sampled] == [2]
