"""`serve --enable-priority-scheduling`: the flags reach the router, a bad threshold is refused
before anything starts, and end to end an urgent request preempts a running one, finishes first,
and the victim still gives exactly the output it gives alone."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_process import DEVICE_FLAG

from nsaserve.cli import build_parser
from nsaserve.serve import EMBEDDED_MODEL, ServeError, Supervisor, router_config


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "--model-path=m", *flags])


def test_off_by_default_and_passed_to_the_router():
    off = router_config(serve_args(), "/ipc", "m")
    assert off["enable_priority_scheduling"] is False
    assert off["schedule_low_priority_values_first"] is False
    assert off["priority_scheduling_preemption_threshold"] == 10
    on = router_config(
        serve_args(
            "--enable-priority-scheduling",
            "--schedule-low-priority-values-first",
            "--priority-scheduling-preemption-threshold=3",
        ),
        "/ipc",
        "m",
    )
    assert on["enable_priority_scheduling"] is True
    assert on["schedule_low_priority_values_first"] is True
    assert on["priority_scheduling_preemption_threshold"] == 3


def test_a_negative_threshold_is_refused():
    with pytest.raises(ServeError, match="--priority-scheduling-preemption-threshold must be a non-negative"):
        Supervisor(serve_args("--priority-scheduling-preemption-threshold=-1")).start()


@pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")
def test_an_urgent_request_preempts_a_running_one_and_finishes_first(start_server):
    server = start_server("--enable-priority-scheduling", "--max-running-requests=1", DEVICE_FLAG)
    slow_prompt, urgent_prompt = "Beautiful is better than", "Errors should never"
    alone = server.complete(slow_prompt, max_tokens=160, ignore_eos=True)
    before = server.metrics()["nsaserve_preemptions_total"]
    finished: dict[str, float] = {}

    def run(name: str, prompt: str, max_tokens: int, priority: int) -> str:
        text = server.complete(prompt, max_tokens=max_tokens, ignore_eos=True, priority=priority)
        finished[name] = time.monotonic()
        return text

    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(run, "slow", slow_prompt, 160, 0)
        deadline = time.monotonic() + 60
        while server.metrics()["nsaserve_requests_running"] < 1:
            assert time.monotonic() < deadline, "the first request never started"
            time.sleep(0.01)
        urgent = pool.submit(run, "urgent", urgent_prompt, 4, 50)
        urgent_text, slow_text = urgent.result(timeout=120), slow.result(timeout=120)
    assert finished["urgent"] < finished["slow"], finished
    assert server.metrics()["nsaserve_preemptions_total"] > before
    # Preempted and recomputed, the victim's output is the one it gives alone.
    assert slow_text == alone
    assert urgent_text.startswith(" pass"), urgent_text
    assert server.stop() == 0
