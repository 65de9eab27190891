"""A real worker process driven by a stand-in router (pyzmq sockets bound by the test): hello,
heartbeats, plans in and results out, malformed plans that fail only their requests, a fatal
line when the model cannot load, and a clean exit on shutdown."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import pytest
import zmq

from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.protocol.messages import PROTOCOL_VERSION, SHUTDOWN, encode_plan

PS = 4


class FakeRouter:
    def __init__(self, tmp: str):
        self.ctx = zmq.Context()
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(f"ipc://{tmp}/events")
        self.plans = self.ctx.socket(zmq.PUSH)
        self.plans.bind(f"ipc://{tmp}/plan-0")

    def recv(self, kind: str, timeout_s: float = 60.0) -> dict:
        """Next message of `kind` (heartbeats in between are skipped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.events.poll(100):
                msg = msgpack.unpackb(self.events.recv(), raw=False)
                if msg["kind"] == kind:
                    return msg
                if msg["kind"] == "fatal" and kind != "fatal":
                    raise AssertionError(f"worker failed: {msg['message']}")
        raise AssertionError(f"no {kind} within {timeout_s} s")

    def close(self):
        self.ctx.destroy(linger=0)


def start_worker(tmp: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nsaserve.worker.main", "--rank=0", "--tp-size=1", f"--ipc-dir={tmp}", f"--page-size={PS}", "--num-pages=32", *extra]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture
def null_worker():
    with tempfile.TemporaryDirectory() as tmp:
        router = FakeRouter(tmp)
        proc = start_worker(tmp, "--model-executor=null")
        try:
            yield router, proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            router.close()


def test_hello_heartbeat_plan_result_and_shutdown(null_worker):
    router, proc = null_worker
    hello = router.recv("hello")
    assert hello["rank"] == 0 and hello["version"] == PROTOCOL_VERSION and hello["num_pages"] == 32 and hello["page_size"] == PS
    assert hello["pid"] == proc.pid
    assert router.recv("heartbeat", timeout_s=5)["rank"] == 0

    plan = build_plan(
        1,
        PS,
        [
            RequestSpec(10, [3, 4, 5], 0, [0]),
            RequestSpec(11, [6, 7], 2, [1], sample=False),  # a non-final chunk: no token
            RequestSpec(12, [8], 5, [2, 3], sampling=SamplingSpec(temperature=0.0)),
        ],
    )
    router.plans.send(encode_plan(plan))
    result = router.recv("result")
    assert result["step"] == 1 and result["errors"] == []
    assert list(np.frombuffer(result["req_ids"], "<u8")) == [10, 12]
    assert len(np.frombuffer(result["tokens"], "<i4")) == 2

    router.plans.send(SHUTDOWN)
    assert proc.wait(timeout=10) == 0


def test_malformed_plans_fail_only_their_requests(null_worker):
    router, proc = null_worker
    router.recv("hello")
    # Request 21 claims a page outside the 32-page pool; 20 and 22 are fine.
    plan = build_plan(2, PS, [RequestSpec(20, [1, 2], 0, [0]), RequestSpec(21, [1, 2], 0, [99]), RequestSpec(22, [5], 3, [4])])
    router.plans.send(encode_plan(plan))
    result = router.recv("result")
    assert [e[0] for e in result["errors"]] == [21] and "outside the pool" in result["errors"][0][1]
    assert sorted(np.frombuffer(result["req_ids"], "<u8")) == [20, 22]

    # Garbage and a truncated plan: answered (with no tokens), and the worker keeps serving.
    router.plans.send(b"\xc1 not msgpack")
    assert router.recv("result")["step"] == 0
    router.plans.send(encode_plan(plan)[:40])
    assert router.recv("result")["step"] == 0

    router.plans.send(encode_plan(build_plan(3, PS, [RequestSpec(30, [1], 1, [5])])))
    result = router.recv("result")
    assert result["step"] == 3 and list(np.frombuffer(result["req_ids"], "<u8")) == [30]
    assert proc.poll() is None


def test_a_worker_that_cannot_load_its_model_says_why_and_exits_nonzero():
    with tempfile.TemporaryDirectory() as tmp:
        router = FakeRouter(tmp)
        missing = os.path.join(tmp, "no-such-model")
        proc = start_worker(tmp, "--model-executor=model", f"--model-path={missing}")
        try:
            fatal = router.recv("fatal")
            assert fatal["rank"] == 0 and missing in fatal["message"] and "\n" not in fatal["message"]
            assert proc.wait(timeout=30) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
            router.close()


class FailingExecutor:
    """Fails every step with `error`, as a model whose collective or kernel raised would."""

    num_pages = 32
    vocab_size = 1000

    def __init__(self, error: Exception):
        self.error = error

    def run(self, batch, is_rank0):
        raise self.error


def test_a_broken_tensor_parallel_group_stops_the_worker_but_a_failing_step_does_not():
    from nsaserve.worker.main import GroupBroken, run_plan

    plan = encode_plan(build_plan(4, PS, [RequestSpec(40, [1, 2], 0, [0])]))
    # A kernel error fails the step's requests; the worker goes on.
    result, step = run_plan(plan, FailingExecutor(ValueError("bad shape")), True)
    assert step == 4 and [e[0] for e in result.errors] == [40] and "bad shape" in result.errors[0][1]
    # A dead peer rank (gloo's words): every later step would fail too, so it is fatal.
    peer_gone = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:35725")
    with pytest.raises(GroupBroken, match="Connection closed by peer"):
        run_plan(plan, FailingExecutor(peer_gone), True)
