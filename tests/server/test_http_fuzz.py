"""Schemathesis against the server's own OpenAPI document (GET /openapi.json): generated and
mutated requests on every operation, bounded in time. No response may be a 5xx, every response
must match the document (status, content type, body schema), and the server must stay up.

The null executor stands in for the model (the router is what is fuzzed), and a small
--context-length keeps fuzzed `max_tokens` and `n` cheap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nsaserve.serve import EMBEDDED_MODEL

pytest.importorskip("schemathesis")
pytestmark = pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")

# Seconds of fuzzing (the whole test takes about this plus the server's start).
BUDGET_S = int(os.environ.get("NSASERVE_FUZZ_SECONDS", "60"))
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def test_schemathesis_finds_no_server_errors(start_server, tmp_path):
    server = start_server("--model-executor=null", "--context-length=48", "--max-queued-requests=512")
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{server.base_url}/openapi.json",
        f"--checks={CHECKS}",
        f"--max-time={BUDGET_S}",
        "--max-examples=60",
        "--seed=1",
        "--workers=1",
        "--request-timeout=20",
        "--suppress-health-check=all",
        "--no-color",
        f"--report-dir={tmp_path}",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=BUDGET_S + 240, cwd=tmp_path)
    report = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    assert server.proc.poll() is None, "the server died under fuzzing:\n" + server.output[-4000:]
    assert server.get("/health")[0] == 200
    assert server.stop() == 0
