"""Pipelined steps (worker/pipeline.py, --worker-pipeline) on a tiny GLM-5 model on CPU: the loop
launches step N+1 before it finishes step N whenever N+1's plan is already there, resolves overlap
references from the device tokens, and sends exactly what the sequential loop (run_plan with the
host-side PrevStep) sends, bad references and prompt logprobs included."""

from __future__ import annotations

import argparse
from collections import deque

import msgpack
import numpy as np
import pytest
import torch
from model_helpers import make_checkpoint

from nsaserve.model.runner import ModelRunner
from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.protocol.messages import SHUTDOWN, encode_plan, unpack
from nsaserve.worker.batch import InputPatch
from nsaserve.worker.main import run_plan, serve_pipelined
from nsaserve.worker.model_executor import ModelExecutor
from nsaserve.worker.pipeline import DeviceRefs
from nsaserve.worker.prev_step import PrevStep

PAGE = 4


CUDA = torch.cuda.is_available()


@pytest.fixture(
    scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))]
)
def executor(request, tmp_path_factory):
    """On CUDA with decode graphs and the Triton kernels: there the tokens really are on the device
    when the next step is launched (the pinned copy, the graph's static input patched in place)."""
    path = str(tmp_path_factory.mktemp("glm5"))
    cuda = request.param == "cuda"
    dims = {"qk_rope_head_dim": 16} if cuda else {}  # the Triton kernels' smallest rope width
    make_checkpoint("glm_moe_dsa", path, seed=3, confident_embedding=4.0, **dims)
    runner = ModelRunner(path, device=torch.device(request.param), dtype=torch.float32, kv_cache_dtype="auto",
                         num_pages=128, page_size=PAGE, show_progress=False)  # fmt: skip
    if not cuda:
        return ModelExecutor(runner, runner.device)
    from nsaserve.worker.model_executor import decode_graphs

    for kind in ("attention", "indexer", "rmsnorm", "rope", "kv_store", "index_key_store"):
        runner.set_backend(kind, "triton")
    runner.set_backend("moe_experts", "torch_dense")  # graph-safe
    ex = ModelExecutor(
        runner, runner.device, decode_graphs(runner, argparse.Namespace(disable_cuda_graph=False, cuda_graph_max_bs=4))
    )
    assert ex.graphs is not None
    return ex


def pages(i: int) -> list[int]:
    return [8 * i + p for p in range(8)]


def plans(pages=pages) -> list[bytes]:
    """A prompt step, then decode steps whose inputs reference the previous step's rows (rows
    reordered every step), with a bad reference, a request asking for logprobs and a prompt
    joining midway; each run writes the same pages, so the two loops start from equal caches.
    pages(i): request i's pages."""
    prompts = {1: [5, 6, 7], 2: [9, 8], 3: [1, 2, 3, 4, 5]}
    out = [build_plan(1, PAGE, [RequestSpec(i, p, 0, pages(i)) for i, p in prompts.items()])]
    lens = {i: len(p) for i, p in prompts.items()}
    prev_ids = list(prompts)
    for step in range(2, 7):
        ids = sorted(lens, key=lambda i: (i * step) % 5)
        reqs = []
        for i in ids:
            row = prev_ids.index(i)
            if step == 4 and i == 2:
                row = (row + 1) % len(prev_ids)  # names another request's row: fails request 2 alone
            sampling = SamplingSpec(top_logprobs=2) if (step, i) == (3, 3) else SamplingSpec()
            reqs.append(RequestSpec(i, [-1], lens[i], pages(i), input_prev_row=row, sampling=sampling))
        if step == 5:
            reqs.append(RequestSpec(4, [11, 12, 13], 0, pages(4)))
        out.append(build_plan(step, PAGE, reqs))
        for r in reqs:
            lens[r.id] = lens.get(r.id, 0) + len(r.input_ids)
        if step == 4:
            del lens[2]  # failed: the router drops it
        prev_ids = [r.id for r in reqs]  # rows of the plan as sent, the failed one included
    return [encode_plan(p) for p in out]


def summary(data: bytes):
    """A sent result as (step, sorted (request, token, logprob)), sorted errors)."""
    msg = msgpack.unpackb(data, raw=False)
    ids = np.frombuffer(msg["req_ids"], dtype=np.uint64).tolist()
    toks = np.frombuffer(msg["tokens"], dtype=np.int32).tolist()
    lps = [None if np.isnan(v) else round(float(v), 4) for v in np.frombuffer(msg["logprobs"], dtype=np.float32)]
    return msg["step"], sorted(zip(ids, toks, lps)), sorted(tuple(e) for e in msg["errors"])


def sequential(executor, is_rank0=True, pages=pages) -> list:
    prev = PrevStep(is_rank0=is_rank0)
    return [summary(run_plan(data, executor, is_rank0, prev)[0].encode()) for data in plans(pages)]


class CountingExecutor:
    """The executor with a log of launch / finish calls."""

    def __init__(self, inner, quick=lambda plan: True):
        self.inner, self.calls, self.quick = inner, [], quick

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, plan, is_rank0, patch=None, after_forward=None, late_masks=None):
        self.calls.append(("launch", plan.step))
        return self.inner.launch(plan, is_rank0, patch, after_forward, late_masks)

    def finish(self, step):
        self.calls.append(("finish", step.plan.step))
        return self.inner.finish(step)

    def launch_is_quick(self, plan):
        return self.quick(plan)  # default: every step launched ahead (a CPU launch is not quick)


def pipelined(executor, plans_first: bool, quick=lambda plan: True, is_rank0=True, pages=pages) -> tuple[list, list]:
    """plans_first: every plan is waiting from the start (a router far ahead); else the next plan
    comes only after the previous result (a router without overlap). quick: which plans launch
    ahead of finishing the previous step. A rank other than 0 sends nothing (its list stays empty)."""
    counting = CountingExecutor(executor, quick)
    queue = deque(plans(pages) + [SHUTDOWN])
    given = deque() if plans_first else deque([queue.popleft()])
    sent = []

    def recv():
        if plans_first:
            return queue.popleft()
        assert given, "the loop waited for a plan the router only sends after a result"
        return given.popleft()

    def waiting():
        return bool(queue) if plans_first else bool(given)

    def send(data):
        sent.append(summary(data))
        if not plans_first and queue:
            given.append(queue.popleft())

    serve_pipelined(recv, waiting, send, counting, is_rank0, [0])
    return sent, counting.calls


def test_pipelined_loop_sends_what_the_sequential_loop_sends(executor):
    want = sequential(executor)
    assert any(err for _, _, err in want), "the bad reference must fail its request"
    assert any(lp is not None for _, toks, _ in want for _, _, lp in toks), "logprobs must be asked for"
    for plans_first in (True, False):
        replays = executor.graphs.replays if executor.graphs is not None else 0
        got, calls = pipelined(executor, plans_first)
        assert got == want, f"plans_first={plans_first}"
        if executor.graphs is not None:
            assert executor.graphs.replays > replays  # decode steps replayed graphs, patched inputs included
        if plans_first:  # step N+1 is launched before step N is finished
            assert calls[:4] == [("launch", 1), ("launch", 2), ("finish", 1), ("launch", 3)]
        else:  # no plan waiting: each step is finished before the next arrives
            assert calls[:4] == [("launch", 1), ("finish", 1), ("launch", 2), ("finish", 2)]


def test_a_slow_launch_waits_for_the_previous_step_to_finish(executor):
    """A step whose launch is not quick (here: any step with a prompt; in serving, any step on the
    CPU, where a launch runs the step) is launched only after the step before it is finished and
    sent; the others still go ahead."""
    want = sequential(executor)
    got, calls = pipelined(executor, True, quick=lambda plan: bool((np.diff(plan.query_start) == 1).all()))
    assert got == want
    assert calls[:4] == [("launch", 1), ("launch", 2), ("finish", 1), ("launch", 3)]
    at = calls.index(("launch", 5))  # step 5: a prompt joins
    assert calls[at - 1] == ("finish", 4) and ("finish", 5) in calls[at + 1 :]


def test_a_decode_launch_does_not_wait_for_the_device(executor):
    """The pipeline's premise: launching step N+1 queues it behind step N without waiting for N's
    kernels. A spinning kernel is queued first; it must still be running when launch returns (a
    host-to-device copy from pageable memory, an .item() or a blocking copy would have waited for
    it), with a device input patch and every sampling stage that builds device tensors; and a step
    with logprobs copies them back at launch, so it too can be finished after the next launch."""
    if executor.device.type != "cuda":
        pytest.skip("on the CPU a launch runs the step")
    executor.run(build_plan(1, PAGE, [RequestSpec(1, [5, 6, 7], 0, pages(1)), RequestSpec(2, [9, 8], 0, pages(2))]), True)
    random_row = SamplingSpec(temperature=0.7, top_p=0.9, top_k=5, min_p=0.01, repetition_penalty=1.1, seed=7,
                              top_logprobs=3)
    decode = build_plan(2, PAGE, [RequestSpec(1, [-1], 3, pages(1), input_prev_row=0, sampling=random_row),
                                  RequestSpec(2, [4], 2, pages(2), sampling=SamplingSpec(temperature=0.0))])  # fmt: skip
    patch = InputPatch(np.array([0]), torch.tensor([8], device=executor.device))
    executor.finish(executor.launch(decode, True, patch))  # first-call work (allocations) aside
    replays = executor.graphs.replays
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of spinning at H200 clocks
    busy = torch.cuda.Event()
    busy.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = executor.launch(decode, True, patch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    still_busy = not busy.query()
    result = executor.finish(step)
    assert still_busy, "launch waited for the kernels queued before it"
    assert step.can_wait, "a step with logprobs must not need finishing before the next launch"
    assert executor.graphs.replays == replays + 1 and len(result.sampled) == 2
    lps = {req: lp for req, _, lp in result.sampled}
    assert lps[2] is None and len(lps[1].top) == 3


def test_references_fetch_rank0_tokens_on_other_ranks():
    """A rank other than 0 samples nothing: the broadcast gives it rank 0's tokens."""
    rank0_tokens = torch.tensor([40, 41, -1])
    seen = []

    def broadcast(mine, n, is_rank0, device):
        seen.append((mine.tolist(), n, is_rank0))
        return rank0_tokens

    refs = DeviceRefs(is_rank0=False, device=torch.device("cpu"), broadcast=broadcast)
    prev = build_plan(1, PAGE, [RequestSpec(i, [3, 4], 0, pages(i), sample=i != 3) for i in (1, 2, 3)])
    refs.record(prev, prev, _launched(prev))
    nxt = build_plan(2, PAGE, [RequestSpec(2, [-1], 2, pages(2), input_prev_row=1),
                               RequestSpec(1, [-1], 2, pages(1), input_prev_row=0),
                               RequestSpec(3, [-1], 2, pages(3), input_prev_row=2)])  # fmt: skip
    plan, patch, errors = refs.resolve(nxt, nxt)
    assert seen == [([-1, -1, -1], 3, False)]
    assert list(plan.req_ids) == [2, 1] and [rid for rid, _ in errors] == [3]  # row 2 sampled nothing
    assert patch.token_index.tolist() == [0, 1] and patch.tokens.tolist() == [41, 40]


def _launched(plan):
    """What a rank other than 0 records after launching `plan`: no tokens of its own."""
    from nsaserve.worker.pipeline import LaunchedStep

    return LaunchedStep(plan=plan, is_rank0=False, t0=0.0, graph=False, sb=None)


def test_a_failed_launch_fails_its_references_next_step():
    refs = DeviceRefs(is_rank0=True, device=torch.device("cpu"))
    prev = build_plan(1, PAGE, [RequestSpec(1, [3, 4], 0, pages(1))])
    refs.record(prev, prev, None)  # the launch raised: nothing of step 1 may be referenced
    nxt = build_plan(2, PAGE, [RequestSpec(1, [-1], 2, pages(1), input_prev_row=0)])
    plan, patch, errors = refs.resolve(nxt, nxt)
    assert plan.num_reqs == 0 and patch is None and [rid for rid, _ in errors] == [1]
    assert np.all(nxt.input_prev_row == 0)


def test_serve_passes_the_switch_to_every_worker():
    from nsaserve.cli import build_parser
    from nsaserve.serve import worker_command
    from nsaserve.worker.main import parse_args

    def flags(*extra):
        args = build_parser().parse_args(["serve", "--model-path=m", "--tp=2", *extra])
        return {parse_args(worker_command(args, r, "/ipc", None, "m", "cuda")[3:]).worker_pipeline for r in (0, 1)}

    assert flags() == {True} and flags("--disable-worker-pipeline") == {False}


def test_a_step_failing_at_finish_fails_its_requests_alone():
    """An error while a launched step's result is built (a failed copy back) fails that step's
    requests; the loop goes on."""
    from nsaserve.worker.main import finish_step

    class Failing:
        def finish(self, step):
            raise RuntimeError("copy failed")

    plan = build_plan(1, PAGE, [RequestSpec(i, [3, 4], 0, pages(i)) for i in (1, 2)])
    step = _launched(plan)
    result = finish_step(Failing(), step, [(7, "invalid plan: x")])
    assert result.step == 1 and [rid for rid, _ in result.errors] == [7, 1, 2]
    assert "copy failed" in result.errors[1][1]


def test_the_previous_result_goes_out_before_the_next_steps_sampling_is_built(executor, monkeypatch):
    """Step N's result is sent as soon as N+1's forward is queued: the router can plan N+2
    while the host still builds N+1's sampling (on a GPU, while the device runs N+1's forward)."""
    from nsaserve.worker import model_executor

    events = []
    built = model_executor.SamplingBatch.from_plan

    def logged(plan, device, patch=None):
        events.append(("sampling", plan.step))
        return built(plan, device, patch)

    monkeypatch.setattr(model_executor.SamplingBatch, "from_plan", staticmethod(logged))
    queue = deque(plans() + [SHUTDOWN])
    counting = CountingExecutor(executor)

    def send(data):
        events.append(("sent", unpack(data)["step"]))

    serve_pipelined(queue.popleft, lambda: bool(queue), send, counting, True, [0])
    assert events.index(("sent", 1)) < events.index(("sampling", 2))
    assert events.index(("sent", 2)) < events.index(("sampling", 3))
    assert [e for e in events if e[0] == "sent"] == [("sent", s) for s in range(1, 7)]


def test_a_late_mask_is_waited_for_after_the_forward_and_obeyed(executor):
    """Structured output under overlap: step 2's row arrives with mask_late, and its mask only
    after step 1's result has gone out (the router commits 1 first); the pipelined loop launches
    step 2, sends 1's result, waits for the masks, and samples under them."""
    from nsaserve.protocol.arrays import I32, U32, U64
    from nsaserve.protocol.messages import LateMasks
    from nsaserve.worker.inbox import PlanInbox
    from nsaserve.worker.main import late_masks_merger

    vocab = executor.vocab_size
    first = build_plan(1, PAGE, [RequestSpec(1, [5, 6, 7], 0, pages(1))])
    second = build_plan(2, PAGE, [RequestSpec(1, [-1], 3, pages(1), input_prev_row=0, mask_late=True)])
    free = [s[1] for s in sequential_steps(executor, [first, second])]
    want = (free[1][0][1] + 1) % vocab  # not what it samples unmasked
    words = np.zeros((vocab + 31) // 32, dtype=U32)
    words[want // 32] = np.uint32(1 << (want % 32))
    masks = LateMasks(2, np.array([1], dtype=U64), np.array([0, len(words)], dtype=I32), words).encode()
    queue = deque([encode_plan(first), encode_plan(second)])
    sent = []

    def send(data):
        sent.append(summary(data))
        queue.append(masks if len(sent) == 1 else SHUTDOWN)

    inbox = PlanInbox(queue.popleft, lambda: bool(queue))
    counting = CountingExecutor(executor)
    serve_pipelined(inbox.recv, inbox.waiting, send, counting, True, [0], late_masks_merger(inbox, vocab, True))
    assert counting.calls[:3] == [("launch", 1), ("launch", 2), ("finish", 1)]
    assert sent[0] == (1, free[0], [])
    assert sent[1][1] == [(1, want, None)] and sent[1][2] == []


def sequential_steps(executor, plans) -> list:
    prev = PrevStep(is_rank0=True)
    return [summary(run_plan(encode_plan(p), executor, True, prev)[0].encode()) for p in plans]
