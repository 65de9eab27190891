"""Plan validation and fuzzing: a malformed plan never crashes the worker's decoder and fails only
the requests it got wrong."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import numpy as np
import pytest
import torch

from nsaserve.protocol.arrays import ProtocolError
from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.protocol.messages import encode_plan, plan_from_msg, unpack
from nsaserve.protocol.validate import validate_plan
from nsaserve.worker.batch import build_forward_batch

PS = 4
POOL = 32


def good_plan():
    return build_plan(
        5,
        PS,
        [
            RequestSpec(1, [1, 2, 3], 4, [0, 1]),  # cached prefix + prefill continuation
            RequestSpec(2, [9, 9, 9, 9, 9], 0, [2, 3]),  # fresh prefill
            RequestSpec(3, [7], 6, [4, 5]),  # decode
        ],
    )


def decode_and_validate(data: bytes):
    return validate_plan(plan_from_msg(unpack(data)), POOL)


def test_a_good_plan_passes_whole():
    plan, errors = decode_and_validate(encode_plan(good_plan()))
    assert errors == [] and plan.num_reqs == 3 and plan.mode == "mixed"


def test_page_outside_pool_fails_only_that_request():
    plan = good_plan()
    pt = plan.page_table.copy()
    pt[plan.page_start[1]] = POOL + 5  # request 2's first page
    plan = replace(plan, page_table=pt)
    runnable, errors = validate_plan(plan, POOL)
    assert [e[0] for e in errors] == [2] and "outside the pool" in errors[0][1]
    assert list(runnable.req_ids) == [1, 3]
    assert runnable.mode == "mixed" and list(runnable.query_start) == [0, 3, 4]
    # the survivors' slots and pages are intact
    # request 1 writes positions 4..6 into page 1, request 3 position 6 into page 5
    assert list(runnable.out_slots) == [1 * PS + 0, 1 * PS + 1, 1 * PS + 2, 5 * PS + 2]


def test_aliasing_slots_fail_both_writers():
    plan = build_plan(
        1, PS, [RequestSpec(1, [1, 2], 0, [3]), RequestSpec(2, [5, 6], 0, [3]), RequestSpec(3, [4], 2, [6])]
    )
    runnable, errors = validate_plan(plan, POOL)
    assert sorted(e[0] for e in errors) == [1, 2]
    assert all("another token" in m for _, m in errors)
    assert list(runnable.req_ids) == [3] and runnable.mode == "decode"


def test_slot_disagreeing_with_page_table_fails_that_request():
    plan = build_plan(1, PS, [RequestSpec(1, [1, 2], 0, [3], out_slots=[12, 14]), RequestSpec(2, [4], 2, [6])])
    runnable, errors = validate_plan(plan, POOL)
    assert [e[0] for e in errors] == [1] and "page table" in errors[0][1]
    assert list(runnable.req_ids) == [2]


def test_too_few_pages_fails_that_request():
    plan = build_plan(1, PS, [RequestSpec(1, [1, 2, 3], 3, [3], out_slots=[15, 16, 17]), RequestSpec(2, [4], 2, [6])])
    runnable, errors = validate_plan(plan, POOL)
    assert [e[0] for e in errors] == [1] and "cannot hold" in errors[0][1]


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("mode", "decode", "contradicts"),
        ("query_start", np.array([0, 3, 9, 8], dtype="<i4"), "monotonic"),
        ("cached_lens", np.array([4, 0], dtype="<i4"), "entries for 3 requests"),
        ("positions", np.arange(3, dtype="<i4"), "entries for 9 tokens"),
        ("page_size", 0, "page_size"),
    ],
)
def test_structural_damage_fails_the_whole_plan(field, value, needle):
    plan = replace(good_plan(), **{field: value})
    with pytest.raises(ProtocolError, match=needle):
        validate_plan(plan, POOL)


def test_missing_field_and_wrong_types_are_protocol_errors():
    msg = unpack(encode_plan(good_plan()))
    for key in ("cached_lens", "page_table", "mode", "version"):
        broken = dict(msg)
        del broken[key]
        with pytest.raises(ProtocolError):
            plan_from_msg(broken)
    broken = dict(msg, input_ids=[1, 2, 3])
    with pytest.raises(ProtocolError, match="must be bin"):
        plan_from_msg(broken)
    broken = dict(msg, version=99)
    with pytest.raises(ProtocolError, match="version 99"):
        plan_from_msg(broken)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """Random damage: truncation, byte flips, or a field replaced by garbage."""
    choice = rng.randrange(4)
    if choice == 0:
        return data[: rng.randrange(len(data))]
    if choice == 1:
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    msg = msgpack.unpackb(data, raw=False)
    key = rng.choice(list(msg))
    garbage = [None, -1, 2**63, "x", b"\x00" * rng.randrange(13), [1, 2], {"a": 1}, 1.5]
    if choice == 2:
        msg[key] = rng.choice(garbage)
    else:
        # Same field, plausible but wrong contents: random int32s of a random length.
        msg[key] = np.array([rng.randint(-3, 40) for _ in range(rng.randrange(12))], dtype="<i4").tobytes()
    return msgpack.packb(msg, use_bin_type=True)


def test_fuzzed_plans_never_crash_the_decoder():
    """Every mutation either validates (and then every kept request is consistent) or raises
    ProtocolError; nothing else escapes."""
    rng = random.Random(1234)
    base = encode_plan(good_plan())
    outcomes = {"ok": 0, "partial": 0, "rejected": 0}
    for _ in range(3000):
        data = mutate(base, rng)
        try:
            plan, errors = decode_and_validate(data)
        except ProtocolError:
            outcomes["rejected"] += 1
            continue
        outcomes["partial" if errors else "ok"] += 1
        # Whatever survived is runnable: re-validating it finds nothing wrong, and the worker
        # can expand it into device tensors.
        again, errors2 = validate_plan(plan, POOL)
        assert errors2 == [] and again.num_reqs == plan.num_reqs
        batch = build_forward_batch(plan, torch.device("cpu"))
        assert batch.kv_slots.numel() == 0 or int(batch.kv_slots.max()) < POOL * PS
    assert outcomes["rejected"] > 100 and outcomes["partial"] + outcomes["ok"] > 100, outcomes


def test_token_ids_outside_the_vocabulary_fail_only_their_request():
    plan = build_plan(
        1,
        PS,
        [
            RequestSpec(1, [1, 700, 3], 0, [0]),  # prompt token beyond a 640-token vocabulary
            RequestSpec(2, [5], 2, [1], history=[4, -1], history_prompt_len=1),  # history token below 0
            RequestSpec(3, [1, 2], 0, [2], next_prompt_token=640),  # the next chunk's first token
            RequestSpec(4, [7], 6, [4, 5]),
        ],
    )
    runnable, errors = validate_plan(plan, POOL, vocab_size=640)
    assert [e[0] for e in errors] == [1, 2, 3] and all("vocabulary" in m for _, m in errors)
    assert list(runnable.req_ids) == [4]
    # Without a vocabulary size (the router's own check) token ids are not looked at.
    assert validate_plan(plan, POOL)[1] == []


def test_bad_logit_bias_fails_only_its_request():
    def req(i, bias):
        return RequestSpec(i, [7], 6, [2 * i, 2 * i + 1], sampling=SamplingSpec(logit_bias=bias))

    plan = build_plan(
        1,
        PS,
        [
            req(0, [(3, 1.0), (9, -2.0)]),  # fine
            req(1, [(9, 1.0), (3, 2.0)]),  # not ascending
            req(2, [(3, 1.0), (3, 2.0)]),  # a token twice
            req(3, [(3, float("nan"))]),  # not finite
            req(4, [(700, 1.0)]),  # beyond a 640-token vocabulary
            req(5, []),
        ],
    )
    runnable, errors = validate_plan(plan, POOL, vocab_size=640)
    assert [e[0] for e in errors] == [1, 2, 3, 4] and all("logit_bias" in m for _, m in errors), errors
    assert list(runnable.req_ids) == [0, 5]
    assert runnable.bias_token.tolist() == [3, 9] and runnable.bias_value.tolist() == [1.0, -2.0]
    assert runnable.bias_start.tolist() == [0, 2, 2]
    # Through the wire and back: the arrays survive encoding.
    again = plan_from_msg(unpack(encode_plan(plan)))
    assert again.bias_token.tolist() == plan.bias_token.tolist()


def test_bad_allowed_token_masks_fail_only_their_request():
    def req(i, words, sample=True):
        return RequestSpec(i, [7], 6, [2 * i, 2 * i + 1], sample=sample, allowed_tokens=words)

    high = [0] * 21 + [1 << 31]  # allows only token 703
    plan = build_plan(
        1,
        PS,
        [
            req(0, [0, 1 << 5]),  # fine: token 37
            req(1, [0, 0]),  # allows nothing
            req(2, high),  # allows only a token beyond a 640-token vocabulary
            req(3, [1], sample=False),  # a mask on a row that samples nothing
            req(4, None),
            req(5, [0xFFFFFFFF] * 3),  # fine: the sign bit of a word is a token too
        ],
    )
    runnable, errors = validate_plan(plan, POOL, vocab_size=640)
    assert [e[0] for e in errors] == [1, 2, 3] and all("mask" in m for _, m in errors), errors
    assert list(runnable.req_ids) == [0, 4, 5]
    assert runnable.mask_start.tolist() == [0, 2, 2, 5]
    assert runnable.mask_words.tolist() == [0, 32, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF]
    # Without a known vocabulary, token 703 is a token.
    _, errors = validate_plan(plan, POOL)
    assert [e[0] for e in errors] == [1, 3], errors
    again = plan_from_msg(unpack(encode_plan(plan)))
    assert again.mask_words.tolist() == plan.mask_words.tolist()


def test_dp_attention_fails_only_a_request_straddling_ranks():
    """Data-parallel attention over 2 ranks of POOL pages each: page ids span 2 * POOL; a request
    whose pages or out_slots leave its rank's pool fails alone, the rest runs (on any rank)."""
    plan = build_plan(
        5,
        PS,
        [
            RequestSpec(1, [1, 2, 3], 4, [POOL + 0, POOL + 1]),  # on rank 1
            RequestSpec(2, [9, 9, 9, 9, 9], 0, [2, POOL + 3]),  # straddles ranks 0 and 1
            RequestSpec(3, [7], 6, [4, 5]),  # on rank 0
            RequestSpec(4, [8], 2, [6], out_slots=[POOL * PS + 2]),  # its page on rank 0, its slot on rank 1
        ],
    )
    runnable, errors = validate_plan(plan, POOL, dp_size=2)
    assert [e[0] for e in errors] == [2, 4]
    assert "span more than one rank" in errors[0][1] and "outside its rank's pool" in errors[1][1]
    assert list(runnable.req_ids) == [1, 3]
    # Without data-parallel attention the rank-1 page ids are outside the pool.
    _, errors = validate_plan(plan, POOL)
    assert {e[0] for e in errors} == {1, 2, 4}
    # Past the last rank's pool is outside the pool.
    _, errors = validate_plan(build_plan(1, PS, [RequestSpec(1, [1], 0, [2 * POOL])]), POOL, dp_size=2)
    assert "outside the pool of 64 pages" in errors[0][1]


def test_history_fields_fail_only_their_request_and_released_ids_survive_selection():
    plan = build_plan(
        3,
        PS,
        [
            RequestSpec(1, [7], 6, [0, 1], history=[4, 5], history_prompt_len=9, history_reset=False),  # a delta: fine
            RequestSpec(2, [7], 6, [2, 3], history=[4, 5], history_prompt_len=3, history_reset=True),  # beyond the whole history
            RequestSpec(3, [7], 6, [4, 5], history=[4], history_prompt_len=1),
            RequestSpec(4, [7], 6, [6, 7], history_prompt_len=-1, history_reset=False),
        ],
        released=[11, 2**40],
    )
    reset = plan.history_reset.copy()
    reset[2] = 2  # neither 0 nor 1
    plan = replace(plan, history_reset=reset)
    runnable, errors = validate_plan(plan_from_msg(unpack(encode_plan(plan))), POOL)
    assert [e[0] for e in errors] == [2, 3, 4], errors
    assert "history_reset" in dict(errors)[3] and "history_prompt_len" in dict(errors)[2]
    assert list(runnable.req_ids) == [1] and runnable.history.tolist() == [4, 5]
    assert runnable.released.tolist() == [11, 2**40]
