"""`nsaserve serve` as a process tree: it starts, serves and stops cleanly at --tp 1 and 2,
leaves nothing behind, and a worker that cannot start makes it exit non-zero in one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
from server_process import DEVICE_FLAG, descendants, gpus_short_of

from nsaserve.serve import EMBEDDED_MODEL

pytestmark = pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_serve_starts_serves_and_stops_cleanly(start_server, tp, tmp_path, monkeypatch):
    if gpus_short_of(tp):
        pytest.skip(f"needs {tp} GPUs")
    step_log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("NSASERVE_STEP_LOG", str(step_log))
    server = start_server(f"--tp={tp}", DEVICE_FLAG)
    assert len(descendants(server.proc.pid)) >= tp
    status, body = server.get("/health")
    assert status == 200, body
    status, body = server.get("/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"]
    # Heads and experts split over `tp` ranks still recite exactly.
    text = server.complete("Errors should never", max_tokens=12)
    assert text.startswith(" pass silently.\nUnless explicitly silenced."), text
    assert server.stop() == 0
    # The benchmark step log has one line per step, written by rank 0 alone.
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    numbers = [s["step"] for s in steps]
    assert steps and len(set(numbers)) == len(numbers), numbers  # every rank writing: each step tp times


def test_bad_model_path_exits_nonzero_with_the_reason(start_server, tmp_path):
    missing = tmp_path / "nope"
    server = start_server(f"--model-path={missing}", ready=False)
    assert server.wait_exit() == 1
    errors = [line for line in server.lines if line.startswith("nsaserve: error:")]
    assert len(errors) == 1 and str(missing) in errors[0], server.output


def test_a_port_in_use_is_refused_in_one_line_before_any_worker_starts(start_server):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # The later --port wins over the harness's --port=0.
        server = start_server(f"--port={port}", ready=False)
        t0 = time.monotonic()
        assert server.wait_exit() == 1
    errors = [line for line in server.lines if line.startswith("nsaserve: error:")]
    assert len(errors) == 1 and f"binding 127.0.0.1:{port}" in errors[0] and "in use" in errors[0], server.output
    # Refused while the router is built: no worker started, no weights loaded.
    assert not any("Loading weights" in line for line in server.lines), server.output
    assert time.monotonic() - t0 < 30


def test_a_worker_that_fails_to_load_reports_its_own_error(start_server, tmp_path):
    # A config.json that is not a model: the router starts, the worker fails to load, and its
    # fatal line (not just an exit code) is what serve prints.
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    server = start_server(f"--model-path={bad}", ready=False)
    assert server.wait_exit() == 1
    errors = [line for line in server.lines if line.startswith("nsaserve: error:")]
    assert len(errors) == 1 and "rank 0" in errors[0], server.output


def test_killed_worker_turns_health_red_within_5_s_and_serve_still_stops_cleanly(start_server):
    if gpus_short_of(2):
        pytest.skip("needs 2 GPUs")
    # Without restarts (tests/server/test_worker_restart.py has them) it stays red.
    server = start_server("--tp=2", DEVICE_FLAG, "--no-restart-workers")
    assert server.get("/health")[0] == 200
    worker = max(descendants(server.proc.pid))
    os.kill(worker, signal.SIGKILL)
    t0 = time.monotonic()
    while server.get("/health")[0] == 200:
        assert time.monotonic() - t0 < 5, "a dead worker went unnoticed for 5 s"
        time.sleep(0.1)
    assert server.get("/health")[0] == 503
    assert any("worker rank" in line for line in server.lines), server.output
    time.sleep(2)
    assert server.get("/health")[0] == 503
    assert any("answering 503 until restarted" in line for line in server.lines), server.output
    assert server.stop() == 0
