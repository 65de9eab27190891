"""The benchmark step log (worker/step_log.py): one JSON line per step with the sums the decode
roofline reads, the indexer's scored contexts among them."""

import json
import time

import pytest
import torch

from nsaserve.protocol.builder import RequestSpec, build_plan
from nsaserve.worker.step_log import DeviceMarks, StepLog


def line_for(tmp_path, contexts: list[int], index_topk: int = 8) -> dict:
    """One decode step of requests whose contexts after the step are `contexts`."""
    reqs = [RequestSpec(i, [1], c - 1, list(range(i * 8, i * 8 + 8))) for i, c in enumerate(contexts)]
    path = tmp_path / "steps.jsonl"
    log = StepLog(str(path), index_topk)
    log.record(build_plan(7, 4, reqs), step_ms=2.5, graph=True)
    return json.loads(path.read_text().splitlines()[-1])


def test_a_line_holds_the_roofline_sums(tmp_path):
    line = line_for(tmp_path, [5, 12, 20])
    assert (line["step"], line["mode"], line["reqs"], line["tokens"]) == (7, "decode", 3, 3)
    assert (line["ctx"], line["sel"], line["ms"], line["graph"]) == (37, 5 + 8 + 8, 2.5, True)
    assert line["idx"] == 37  # a context past the top-k: the indexer scores every context


def test_contexts_within_the_top_k_are_not_scored(tmp_path):
    line = line_for(tmp_path, [5, 8, 3])
    assert line["ctx"] == line["sel"] == 16 and line["idx"] == 0


def test_a_line_says_whether_the_step_attended_densely(tmp_path):
    """The model's own choice (dense_prefill.dense_requests) repeated: a whole prompt within the
    top-k with the switch on is dense; the same step with the switch off, or a decode step, is not."""
    path = tmp_path / "steps.jsonl"
    prompt = build_plan(3, 4, [RequestSpec(0, list(range(1, 101)), 0, list(range(26)))])
    decode = build_plan(4, 4, [RequestSpec(0, [5], 100, list(range(26)))])
    for switch in (True, False):
        log = StepLog(str(path), index_topk=2048, dense_prefill=switch)
        log.record(prompt, step_ms=9.0)
        log.record(decode, step_ms=1.0, graph=True)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["dense"] for x in lines] == [1, 0, 0, 0]
    assert "mallocs" not in lines[0]  # allocator counters: CUDA only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events")
def test_device_times_split_the_work_from_the_idle_time_before_it(tmp_path):
    """Two steps queued back to back: the second's gap is ~0; a host pause before the third
    shows as the third's gap, not as its work."""
    path = tmp_path / "steps.jsonl"
    log = StepLog(str(path), index_topk=8, device=torch.device("cuda"))
    plan = build_plan(1, 4, [RequestSpec(0, [5], 10, list(range(3)))])
    a = torch.randn(4096, 4096, device="cuda")
    marks = []
    for pause in (0.0, 0.0, 0.2):
        time.sleep(pause)
        m = DeviceMarks()
        m.forward_queued()
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        m.end_queued()
        marks.append(m)
    for m in marks:
        log.record(plan, step_ms=1.0, marks=m)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert "gap_ms" not in lines[0] and all(x["gpu_ms"] > 0 for x in lines)
    assert lines[1]["gap_ms"] < 5.0 < lines[2]["gap_ms"]
    assert all(0 <= x["host_prep_ms"] <= x["host_launch_ms"] for x in lines)
