"""bench/gpu/step_profile.py on CPU at tp 2 (gloo): the worker's own executor runs the synthetic
decode and prefill steps, the profile groups operators into families, and the report is written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nsaserve
from nsaserve.kernels.quant.make_glm5_shaped import TINY_OVERRIDES, make_glm5_config_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))


def test_decode_scenarios_with_spread_contexts():
    from step_profile import parse_decode

    assert parse_decode("2x7") == [("decode 2x7", [7, 7])]
    (name, ctx), (_, desc), (_, asc) = parse_decode("5x10-30,5x10-30d,5x10-30a")
    assert name == "decode 5x10-30" and sorted(ctx) == asc == [10, 15, 20, 25, 30] and desc == asc[::-1]
    assert ctx != asc and ctx != desc  # arrival order: shuffled, the same every run
    assert parse_decode("5x10-30")[0][1] == ctx


def test_family_names():
    from step_profile import family

    assert family("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "nccl"
    assert family("_moe_gate_up_w4a16_kernel") == "moe_experts"
    for name in ("_gate_up_kernel", "_down_kernel", "_align_kernel", "_align_count_kernel", "_sum_kernel"):
        assert family(name) == "moe_experts", name  # as the profiler names the Triton MoE kernels
    assert family("_combine_kernel") == "sparse_mla" and family("_logits_kernel") == "indexer"
    assert family("_sparse_mla_decode_kernel") == "sparse_mla"
    assert family("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert family("_rmsnorm_residual_kernel") == "norm_rope"
    assert family("something_new") == "other"


def test_profiles_decode_and_prefill_at_tp2_on_cpu(tmp_path):
    cfg = tmp_path / "cfg"
    make_glm5_config_dir(str(cfg), moe_layers=1, dense_layers=1, overrides=TINY_OVERRIDES)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu" / "step_profile.py"), "--model-path", str(cfg),
           "--load-format", "random", "--tp", "2", "--device", "cpu", "--decode", "4x40,3x10-40d", "--prefill", "2x30", "--extend", "3x5x20",
           "--steps", "1", "--sources", "5", "--host-profile", "2",
           "--sampling", '{"top_p": 0.95, "frequency_penalty": 0.2, "seed": 3, "top_logprobs": 2}', "--out", str(out)]  # fmt: skip
    here = str(Path(nsaserve.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((out / "profile.json").read_text())
    assert doc["machine"]["tp"] == 2 and not doc["graphs"]
    names = ["decode 4x40", "decode 3x10-40d", "prefill 2x30", "extend 3x5 after 20"]
    assert [s["scenario"] for s in doc["scenarios"]] == names
    for s in doc["scenarios"]:
        assert len(s["eager_ms"]) == 1 and s["eager_profile"]["kernels_total_ms"] > 0
        assert sum(s["eager_profile"]["families_ms"].values()) > 0
    assert "| decode 4x40 | eager |" in (out / "profile.md").read_text()
    assert doc["scenarios"][1]["pipelined_ms"] > 0 and "pipelined_ms" not in doc["scenarios"][2]
    # --sources: operators by the project line that called them
    src = doc["scenarios"][0]["sources"]
    assert 0 < len(src) <= 5 and all(r["op"].startswith("aten::") and r["ms"] > 0 for r in src)
    assert any(r["source"].startswith("nsaserve/") for r in src), src
    # --host-profile: the eager decode step's Python functions by host time
    host = doc["scenarios"][0]["host_profile"]
    assert host["own"] and all(r["own_ms"] >= 0 and r["calls"] >= 0 for r in host["own"])
    assert host["cum"] and all(r["function"].startswith("nsaserve/") for r in host["cum"])
    assert "host_profile" not in doc["scenarios"][2]  # decode scenarios only
    assert "Host ms a step by function" in (out / "profile.md").read_text()


def test_host_profile_paths_name_the_project_files_installed_or_not():
    from step_profile import _short_path

    assert _short_path("/repo/pyworker/nsaserve/worker/main.py") == "nsaserve/worker/main.py"
    assert _short_path("/venv/lib/python3.11/site-packages/nsaserve/model/model.py") == "nsaserve/model/model.py"
    assert _short_path("/venv/lib/python3.11/site-packages/triton/runtime/jit.py") == "site-packages/triton/runtime/jit.py"
    assert _short_path("/usr/lib/python3.11/threading.py") == "python3.11/threading.py"
    assert _short_path("~") == "~"


def test_timeline_idle_and_gaps():
    from step_profile import timeline

    spans = [(0, 10, "a"), (12, 20, "b"), (15, 18, "c"), (25, 30, "d"), (31, 33, "a"), (40, 41, "b")]
    t = timeline(spans, 5)
    assert t["kernels"] == 6 and t["span_ms"] == 0.041 and t["busy_ms"] == 0.026 and t["idle_ms"] == 0.015
    assert t["gaps"][0] == {"after": "a", "before": "b", "us": 9.0, "count": 2}
    assert [g["us"] for g in t["gaps"]] == [9.0, 5.0, 1.0]
    assert timeline([], 3)["kernels"] == 0
