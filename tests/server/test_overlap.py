"""Overlap scheduling end to end: a TP=2 server on CPU with the embedded model gives the same
greedy outputs (text and finish reason) with the next step planned while one runs (the
default) as with `--disable-overlap-schedule`, across the boundaries overlap has to get right:
max_tokens of 1 and 2 (a request ends while a step with it is already planned), stop strings
(the client side aborts a request that is in flight), stop tokens and penalties (planned ahead
too: the worker adds the pending token to their history); and with --disable-worker-pipeline (workers finishing each step before
launching the next, as against the default pipeline)."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import pytest
from server_process import DEVICE_FLAG, ServerProcess, gpus_short_of

from nsaserve.serve import EMBEDDED_MODEL

pytestmark = [
    pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built"),
    pytest.mark.skipif(gpus_short_of(2), reason="needs 2 GPUs"),
]

LINES = [
    "Beautiful is better than",
    "Explicit is better than",
    "Simple is better than complex. Complex is better than",
    "Flat is better than nested.",
    "Readability counts. Special cases",
    "Errors should never",
    "In the face of ambiguity,",
    "Now is better than",
    "better better better better better",
]


def requests() -> list[dict]:
    out = []
    for i, prompt in enumerate(LINES * 2):
        body = {"prompt": prompt, "temperature": 0, "max_tokens": [1, 2, 3, 7, 12][i % 5]}
        if i % 4 == 1:
            body["stop"] = ["than", "\n"]
        if i % 3 == 2:
            body["frequency_penalty"] = 1.5
            body["repetition_penalty"] = 1.3
        if i % 7 == 3:
            body["max_tokens"] = 20
        out.append(body)
    return out


def complete(base_url: str, body: dict) -> tuple[int, str, str]:
    req = urllib.request.Request(
        base_url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            choice = json.loads(r.read())["choices"][0]
            return r.status, choice["text"], choice["finish_reason"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), ""


def serve_all(*flags: str) -> list[tuple[int, str, str]]:
    server = ServerProcess("--tp=2", DEVICE_FLAG, "--chunked-prefill-size=16", "--page-size=16", *flags).wait_ready()
    try:
        bodies = requests()
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            outputs = list(pool.map(lambda b: complete(server.base_url, b), bodies))
        # Logged by rank 0 before its first step, so there by now.
        assert ("steps pipelined" in server.output) == ("--disable-worker-pipeline" not in flags), server.output
        return outputs
    finally:
        assert server.stop() == 0


def test_greedy_outputs_are_the_same_with_overlap_on_and_off():
    on = serve_all()
    off = serve_all("--disable-overlap-schedule")
    assert all(code == 200 for code, _, _ in on), on
    assert on == off
    # By default workers launch the next step before the previous one's tokens are back (the
    # references resolved on the device, broadcast from rank 0 over the process group); each step
    # finished first, host-side references: the same again.
    assert serve_all("--disable-worker-pipeline") == on
    reasons = {reason for _, _, reason in on}
    assert {"stop", "length"} <= reasons, reasons
