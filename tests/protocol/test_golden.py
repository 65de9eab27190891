"""The golden vectors from the Python side (router/tests/golden_vectors.rs does the Rust side)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).parent.parent / "golden"
sys.path.insert(0, str(GOLDEN))

from golden_codec import build_message, plan_from_json, unpack  # noqa: E402

from nsaserve.protocol.messages import plan_from_msg  # noqa: E402
from nsaserve.protocol.validate import validate_plan  # noqa: E402

NAMES = sorted(p.stem for p in GOLDEN.glob("*.json"))


def test_every_vector_has_both_files():
    assert len(NAMES) >= 9
    for name in NAMES:
        assert (GOLDEN / f"{name}.msgpack").exists(), name


@pytest.mark.parametrize("name", NAMES)
def test_encoder_reproduces_the_golden_bytes(name):
    content = json.loads((GOLDEN / f"{name}.json").read_text())
    assert build_message(content) == (GOLDEN / f"{name}.msgpack").read_bytes()


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("plan_")])
def test_plans_decode_to_their_content(name):
    content = json.loads((GOLDEN / f"{name}.json").read_text())
    plan = plan_from_msg(unpack((GOLDEN / f"{name}.msgpack").read_bytes()))
    expected = plan_from_json(content)
    for field in expected.__dataclass_fields__:
        a, b = getattr(plan, field), getattr(expected, field)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), field
        else:
            assert a == b, field
    runnable, errors = validate_plan(plan, num_pages=16)
    assert errors == [] and runnable.num_reqs == len(content["requests"])


def test_plan_arrays_are_views_not_copies():
    data = (GOLDEN / "plan_mixed.msgpack").read_bytes()
    plan = plan_from_msg(unpack(data))
    assert not plan.input_ids.flags.owndata and not plan.input_ids.flags.writeable
