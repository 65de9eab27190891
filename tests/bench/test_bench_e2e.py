"""`nsaserve bench` against a real `nsaserve serve --model-executor null`: exact token counts with
ignore_eos, a sweep's JSON (and plot), and a prefix hit rate that shows shared prefixes reused."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nsaserve.serve import EMBEDDED_MODEL

if importlib.util.find_spec("nsaserve._router") is None:
    pytest.skip("the router extension (nsaserve._router) is not built", allow_module_level=True)
if not ((EMBEDDED_MODEL / "config.json").exists() and (EMBEDDED_MODEL / "tokenizer.json").exists()):
    pytest.skip("the embedded model directory is not present", allow_module_level=True)


def load_server_helpers():
    """tests/server/conftest.py starts and stops servers; load it by path (test dirs are not packages)."""
    path = Path(__file__).parent.parent / "server" / "conftest.py"
    spec = importlib.util.spec_from_file_location("nsaserve_tests_server_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server():
    s = load_server_helpers().ServerProcess("--model-executor=null", "--device=cpu").wait_ready()
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            assert s.stop() == 0


def bench(server, tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "nsaserve", "bench", f"--base-url={server.base_url}", f"--output-file={out}", "--disable-tqdm", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_random_sweep_sends_exact_lengths_and_writes_json_and_plot(server, tmp_path):
    proc, doc = bench(
        server, tmp_path, "--num-prompts=24", "--random-input-len=100", "--random-output-len=12",
        "--random-range-ratio=1", f"--tokenizer={EMBEDDED_MODEL}", "--concurrency=2,8", "--warmup-requests=2",
    )
    assert "nsaserve bench" in doc["command"] and "--concurrency=2,8" in doc["command"]
    assert doc["date"] and doc["machine"]["python"] and doc["args"]["request_rate"] == "inf"
    assert [r["max_concurrency"] for r in doc["runs"]] == [2, 8]
    assert "concurrency     req/s" in proc.stdout  # the sweep's one-line-per-level table
    for run in doc["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (24, 0), s["first_errors"]
        assert s["total_input_tokens"] == 24 * 100  # the server's own count of the token-id prompts
        assert s["total_output_tokens"] == 24 * 12  # ignore_eos + max_tokens
        assert s["ttft"]["p50_ms"] > 0 and s["e2e_latency"]["p99_ms"] >= s["ttft"]["p99_ms"]
        assert s["tpot"]["mean_ms"] is not None and s["output_throughput"] > 0
        assert run["endpoint"] == "/v1/completions" and run["model"]
        # Random ids share nothing, and each level draws fresh prompts (none left in the cache by the last level).
        assert run["prefix_hit_rate"] is not None and run["prefix_hit_rate"] < 0.1
    png = tmp_path / "result.png"
    if importlib.util.find_spec("matplotlib"):
        assert png.read_bytes()[:4] == b"\x89PNG"
    else:
        assert "matplotlib is not installed" in proc.stdout and not png.exists()


def test_shared_prefix_conversations_hit_the_prefix_cache(server, tmp_path):
    _, doc = bench(
        server, tmp_path, "--dataset-name=shared-prefix", "--num-prompts=6", "--gsp-system-prompt-len=256",
        "--gsp-question-len=16", "--gsp-output-len=8", "--gsp-num-turns=3", "--max-concurrency=2",
        f"--tokenizer={EMBEDDED_MODEL}",
    )
    (run,) = doc["runs"]
    s = run["summary"]
    assert (run["num_requests"], s["completed"], s["failed"]) == (18, 18, 0), s["first_errors"]
    assert s["total_output_tokens"] == 18 * 8
    # Every turn but the very first can reuse at least the 256-token system prompt (4 pages).
    assert run["prefix_hit_rate"] > 0.5


def test_chat_backend_with_text_prompts(server, tmp_path):
    _, doc = bench(
        server, tmp_path, "--backend=openai-chat", "--dataset-name=shared-prefix", "--num-prompts=3",
        "--gsp-system-prompt-len=64", "--gsp-question-len=8", "--gsp-output-len=6", "--gsp-num-turns=2",
        "--request-rate=20", "--seed=3",
    )
    s = doc["runs"][0]["summary"]
    assert (s["completed"], s["failed"]) == (6, 0), s["first_errors"]
    assert s["total_output_tokens"] == 6 * 6
    assert s["total_input_tokens"] > 6 * 64  # the server's count: template and words, not the nominal length
