"""The GLM-5-shaped checkpoint generator and the sweep harness around it, at a tiny scale on CPU:
the checkpoint goes through the normal loader, transformers (our side-by-side peer) computes the
same logits from it, the roofline counts the checkpoint's bytes, and the sweep driver serves it
and benches 5 requests end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nsaserve
from nsaserve.kernels.quant import BF16, NVFP4, load_quant_scheme
from nsaserve.kernels.quant.make_glm5_shaped import GLM5_CONFIG, TINY_OVERRIDES, glm5_config, make_glm5_shaped
from nsaserve.model.runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]
GPU_BENCH = ROOT / "bench" / "gpu"
sys.path.insert(0, str(ROOT / "tests" / "model"))
sys.path.insert(0, str(GPU_BENCH))

from model_helpers import Session, rel_err  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("glm5_tiny"))
    make_glm5_shaped(path, moe_layers=2, dense_layers=3, overrides=TINY_OVERRIDES, seed=3)
    return path


def test_full_config_has_glm5_shapes():
    cfg = glm5_config(moe_layers=6)
    assert cfg["num_hidden_layers"] == 9 and cfg["mlp_layer_types"] == ["dense"] * 3 + ["sparse"] * 6
    for key, value in dict(hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512,
                           qk_rope_head_dim=64, index_n_heads=32, index_head_dim=128, index_topk=2048,
                           n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                           n_shared_experts=1, vocab_size=154880).items():  # fmt: skip
        assert cfg[key] == value == GLM5_CONFIG[key], key


def test_checkpoint_loads_with_nvfp4_experts_and_finite_logits(ckpt):
    scheme = load_quant_scheme(ckpt)
    assert scheme.precision_of("model.layers.3.mlp.experts.0.gate_proj") == NVFP4
    for bf16_module in ("model.layers.3.self_attn.q_b_proj", "model.layers.0.mlp.down_proj",
                        "model.layers.4.mlp.shared_experts.up_proj", "model.layers.4.mlp.gate", "lm_head"):  # fmt: skip
        assert scheme.precision_of(bf16_module) == BF16, bf16_module
    assert os.path.exists(os.path.join(ckpt, "hf_quant_config.json"))
    runner = ModelRunner(ckpt, device=torch.device("cpu"), dtype=None, num_pages=32, page_size=16, show_progress=False)
    assert runner.model.model.layers[3].mlp.w13.precision == NVFP4
    session = Session(runner)
    tokens = torch.randint(0, TINY_OVERRIDES["vocab_size"], (80,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = session.step([(0, tokens)])[0]
    for _ in range(3):
        logits = session.step([(0, [int(logits.argmax())])])[0]
        assert torch.isfinite(logits).all()
    # Random weights, yet not degenerate: logits spread, so sampling is not a constant.
    assert 0.1 < float(logits.std()) < 100


def test_tokenizer_covers_the_vocabulary(ckpt):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    vocab = TINY_OVERRIDES["vocab_size"]
    assert tok.get_vocab_size() == vocab
    assert tok.decode([vocab - 1, vocab - 2]) == f" w{vocab - 1} w{vocab - 2}"


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_peer_computes_our_logits(ckpt):
    """The side-by-side peer runs the same weights: in float32 its logits equal ours."""
    from glm5_transformers import load_transformers_model, truncated_view

    view = truncated_view(ckpt, ckpt + "-view", 4)  # 3 dense + 1 MoE layer
    hf, cls = load_transformers_model(view, "cpu", torch.float32)
    if cls != "GlmMoeDsaForCausalLM":
        pytest.skip(f"this transformers only has {cls}")
    assert hf.config.num_hidden_layers == 4
    runner = ModelRunner(
        view, device=torch.device("cpu"), dtype=torch.float32, num_pages=32, page_size=16, show_progress=False
    )
    assert len(runner.model.model.layers) == 4
    tokens = torch.randint(0, TINY_OVERRIDES["vocab_size"], (50,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = Session(runner).step([(0, tokens)], all_logits=True)[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0].float()
    assert rel_err(ours, theirs) < 1e-4


def test_roofline_counts_the_checkpoint_bytes(ckpt):
    from glm5_roofline import DecodeRoofline

    from nsaserve.kernels.quant.checkpoint_io import CheckpointReader

    roof = DecodeRoofline(ckpt, "fp8_e4m3")
    fixed = experts = 0
    with CheckpointReader(ckpt) as reader:
        for name in reader.names():
            t = reader.get(name)
            size = t.numel() * t.element_size()
            if ".experts." in name:
                experts += 0 if name.endswith("input_scale") else size
            elif name != "model.embed_tokens.weight":
                fixed += size
    cfg = TINY_OVERRIDES
    assert roof.fixed_bytes == fixed and roof.moe_layers == 2
    assert roof.expert_bytes * 2 * cfg["n_routed_experts"] == pytest.approx(experts)
    assert roof.distinct_experts(1) == pytest.approx(cfg["num_experts_per_tok"])
    assert roof.distinct_experts(10**6) == pytest.approx(cfg["n_routed_experts"])
    b = roof.step_bytes(batch=4, ctx=400, sel=128)
    latent_row = cfg["kv_lora_rank"] + 4 * (cfg["kv_lora_rank"] // 64) + 2 * cfg["qk_rope_head_dim"]
    assert b["kv"] == 5 * (128 * latent_row + 400 * (cfg["index_head_dim"] + 4))
    assert b["total"] == b["weights"] + b["experts"] + b["kv"]


def test_step_flops_and_the_bound_that_counts_the_tensor_cores(ckpt, tmp_path):
    """A decode step's multiply-adds: every weight matrix once per token (the checkpoint's 2-D
    tensors outside the experts, the embedding and the scales), top-k experts per token, the
    sparse attention and the indexer per layer; the bound takes each part's longer side."""
    from glm5_roofline import DecodeRoofline

    from nsaserve.kernels.quant.checkpoint_io import CheckpointReader
    from nsaserve.kernels.quant.make_glm5_shaped import make_glm5_config_dir

    roof = DecodeRoofline(ckpt, "fp8_e4m3")
    matmul = 0
    with CheckpointReader(ckpt) as reader:
        for name in reader.names():
            t = reader.get(name)
            if ".experts." not in name and name != "model.embed_tokens.weight" and t.dim() == 2 and "scale" not in name:
                matmul += t.numel()
    assert roof.matmul_elements == matmul
    cfg_only = str(tmp_path / "cfg")
    make_glm5_config_dir(cfg_only, moe_layers=2, dense_layers=3, overrides=TINY_OVERRIDES)
    assert DecodeRoofline(cfg_only).matmul_elements == matmul  # the generator's list, the same matrices
    # A matrix of NVFP4 codes outside the experts (uint8, two weights a byte) counts its weights.
    from safetensors.torch import save_file

    packed = tmp_path / "packed"
    shutil.copytree(ckpt, packed)
    codes = torch.zeros(6, 8, dtype=torch.uint8)
    save_file({"model.layers.0.mlp.shared_experts.up_proj.weight": codes}, str(packed / "extra.safetensors"))
    assert DecodeRoofline(str(packed)).matmul_elements == matmul + 2 * codes.numel()
    c = TINY_OVERRIDES
    f = roof.step_flops(batch=4, ctx=400, sel=128)
    assert f["weights"] == 2 * 4 * matmul
    assert f["experts"] == 2 * 4 * c["num_experts_per_tok"] * 2 * 3 * c["hidden_size"] * c["moe_intermediate_size"]
    mla = 5 * 2 * c["num_attention_heads"] * 128 * (2 * c["kv_lora_rank"] + c["qk_rope_head_dim"])
    assert f["attention"] == mla + 5 * 2 * c["index_n_heads"] * 400 * c["index_head_dim"]
    assert f["total"] == f["weights"] + f["experts"] + f["attention"]
    # Per rank under tp 2: half of the weights' split matrices, of the slots and of the heads; the
    # replicated indexer whole (data-parallel attention: half its keys).
    half = DecodeRoofline(cfg_only, tp=2).step_flops(4, 400, 128)
    assert f["weights"] / 2 < half["weights"] < f["weights"]
    assert half["experts"] == f["experts"] / 2 and half["attention"] == mla / 2 + (f["attention"] - mla)
    dp = DecodeRoofline(cfg_only, tp=2, dp_attention=True).step_flops(4, 400, 128)
    assert dp["attention"] == pytest.approx(f["attention"] / 2)
    b = roof.step_bytes(4, 400, 128)
    # Bandwidth-bound everywhere at a huge matmul rate: the bound is the memory roofline.
    assert roof.step_bound_s(4, 400, 128, 1e12, 1e30)["total"] == pytest.approx(b["total"] / 1e12)
    # Each part takes its longer side.
    bound = roof.step_bound_s(4, 400, 128, 1e12, 1e9)
    assert bound["weights"] == max(b["weights"] / 1e12, f["weights"] / 1e9)
    assert bound["attention"] == max(b["kv"] / 1e12, f["attention"] / 1e9)
    assert bound["total"] == pytest.approx(bound["weights"] + bound["experts"] + bound["attention"])


def run_sweep(cmd: list[str], out: Path):
    """The sweep driver as a subprocess; its output and results document. The driver and its
    server import the nsaserve this test imports (installed, or the source tree with a built
    extension), never another one."""
    here = str(Path(nsaserve.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((out / "results.json").read_text())


def test_roofline_of_a_config_only_dir_and_per_rank_under_tp(ckpt, tmp_path):
    """A config-only directory (weights drawn at load) counts the generator's bytes, the same as
    the checkpoint's; under tp 2 one rank reads half of the split tensors and of the experts and
    all of the replicated ones and of the KV."""
    from glm5_roofline import DecodeRoofline

    from nsaserve.kernels.quant.make_glm5_shaped import make_glm5_config_dir

    cfg_only = str(tmp_path / "cfg")
    make_glm5_config_dir(cfg_only, moe_layers=2, dense_layers=3, overrides=TINY_OVERRIDES)
    full, drawn = DecodeRoofline(ckpt), DecodeRoofline(cfg_only)
    assert (drawn.fixed_bytes, drawn.expert_bytes) == (full.fixed_bytes, full.expert_bytes)
    half = DecodeRoofline(cfg_only, tp=2)
    c = TINY_OVERRIDES
    H, V, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    split = V * H + 5 * heads * (c["v_head_dim"] * H)  # lm_head and the o_proj of 5 layers, among others
    assert full.fixed_bytes / 2 < half.fixed_bytes < full.fixed_bytes - split  # replicated parts stay whole
    b1, b2 = full.step_bytes(8, 900, 300), half.step_bytes(8, 900, 300)
    assert b2["experts"] == pytest.approx(b1["experts"] / 2) and b2["kv"] == b1["kv"]
    # Data-parallel attention: the whole attention on every rank, half of the step's KV per rank.
    dp = DecodeRoofline(cfg_only, tp=2, dp_attention=True)
    b3 = dp.step_bytes(8, 900, 300)
    assert half.fixed_bytes < dp.fixed_bytes < full.fixed_bytes
    assert b3["kv"] == pytest.approx(b1["kv"] / 2) and b3["experts"] == b2["experts"]


@pytest.mark.skipif(importlib.util.find_spec("nsaserve._router") is None, reason="router extension not built")
def test_sweep_driver_at_tp2_with_random_weights_on_cpu(tmp_path):
    """--tp 2 --random-weights: a config-only directory, two ranks drawing their weights at load,
    two levels of 6 prompts end to end, the per-rank roofline and the tp target in the results. Pages of 16
    tokens, so the prompts' full pages enter the radix cache: a level that repeated the earlier
    level's prompts would show it as prefix hits."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(GPU_BENCH / "glm5_sweep.py"), "--out", str(out), "--device", "cpu", "--tiny",
           "--random-weights", "--tp", "2", "--moe-layers", "2", "--model-path", str(tmp_path / "cfg"),
           "--phases", "sweep,compare", "--levels", "3,6", "--level-waves", "3:2", "--input-len", "40", "--output-len", "4", "--prefill-probes", "0",
           "--budget-s", "100", "--serve-arg=--max-total-tokens=4096", "--serve-arg=--page-size=16"]  # fmt: skip
    proc, doc = run_sweep(cmd, out)
    assert not any(n.endswith(".safetensors") for n in os.listdir(tmp_path / "cfg"))
    assert "--tp 2" in doc["serve_command"] and "--load-format random" in doc["serve_command"]
    first, level = doc["phases"]["sweep"]
    assert (level["bench"]["summary"]["completed"], level["bench"]["summary"]["failed"]) == (6, 0)
    assert level["decode"]["decode_steps"] >= 1 and level["decode"]["roofline_ms_median"] > 0
    # Fresh prompts at every level (both draw 6 prompts: with one seed they would be the same
    # ones): nothing of the first level's is found in the cache.
    assert first["bench"]["prefix_hit_rate"] == level["bench"]["prefix_hit_rate"] == 0.0
    assert doc["checkpoint"]["random_weights"] and doc["machine"]["tp"] == 2
    assert "total_tok_s_at_1024_at_least_15000" in doc["targets"]  # not measured here: no level 1024
    assert any("compare" in s for s in doc["skipped"])  # transformers needs the weights on disk


@pytest.mark.skipif(importlib.util.find_spec("nsaserve._router") is None, reason="router extension not built")
def test_sweep_driver_serves_and_benches_on_cpu(ckpt, tmp_path):
    """The whole harness on CPU: serve the tiny checkpoint, a warm-up, then 10 requests (2 waves)
    at concurrency 5, decode steps read from the worker's step log and set against the roofline;
    then the shared-prefix workload, its decode steps split by path."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(GPU_BENCH / "glm5_sweep.py"), "--out", str(out), "--device", "cpu", "--model-path", ckpt,
           "--phases", "sweep,shared", "--levels", "5", "--level-waves", "5:2", "--warmup-prompts", "2", "--input-len", "40", "--output-len", "4", "--prefill-probes", "0",
           "--shared-conversations", "2", "--shared-concurrency", "2", "--shared-system-len", "24", "--shared-question-len", "8",
           "--shared-output-len", "3", "--budget-s", "100", "--serve-arg=--max-total-tokens=4096"]  # fmt: skip
    proc, doc = run_sweep(cmd, out)
    (level,) = doc["phases"]["sweep"]
    assert doc["phases"]["shared_prefix"]["summary"]["completed"] == 4  # 2 conversations x 2 turns
    split = doc["phases"]["shared_prefix_decode"]
    assert split["eager"]["steps"] >= 1 and split["graph"]["steps"] == 0  # CPU: no graphs
    assert "shared prefix decode steps: graph 0" in proc.stdout
    from glm5_summary import summary_table

    assert "shared prefix decode steps: graph 0 (median n/a ms), eager " in summary_table(doc)
    s = level["bench"]["summary"]
    assert (s["completed"], s["failed"]) == (10, 0)
    assert doc["phases"]["warmup"] == {"prompts": 2, "concurrency": 5}
    assert level["decode"]["decode_steps"] >= 1 and level["decode"]["roofline_ms_median"] > 0
    assert level["decode"]["graph_steps"] == 0  # CPU: no graphs
    assert level["decode"]["prefill_or_mixed_steps"] >= 1
    assert "| 5 | 10 | 10 | 0 |" in proc.stdout  # the summary table
    assert os.path.exists(os.path.join(ckpt, "config.json")), "a given --model-path is never deleted"
    assert doc["checkpoint"]["moe_layers"] == 2 and doc["targets"]["zero_failed"]["met"]
    assert doc["phases"]["finite_logits"]["finite"] and doc["phases"]["finite_logits"]["values"] > 256
    assert doc["compiled_while_serving"] == [] and "kernel variants compiled while serving: 0" in proc.stdout
    from glm5_report import report

    assert "| 5 | 10 | 10 | 0 |" in report(doc, "title")


@pytest.mark.skipif(importlib.util.find_spec("nsaserve._router") is None, reason="router extension not built")
def test_compare_phase_with_repeats_and_a_variant_on_cpu(ckpt, tmp_path):
    """The compare phase end to end on CPU: our server twice (as is, then with a variant's flags),
    each benched twice with the median kept, against one transformers run on the same prompts."""
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    cmd = [sys.executable, str(GPU_BENCH / "glm5_sweep.py"), "--out", str(out), "--device", "cpu", "--model-path", ckpt,
           "--phases", "compare", "--compare-moe-layers", "1", "--compare-batch", "3", "--compare-input-len", "24",
           "--compare-output-len", "3", "--compare-repeats", "2", "--compare-variant=--disable-worker-pipeline",
           "--prefill-probes", "0", "--budget-s", "120", "--serve-arg=--max-total-tokens=4096"]  # fmt: skip
    proc, doc = run_sweep(cmd, out)
    c = doc["phases"]["compare"]
    theirs = c["transformers"]["output_throughput"]
    for s in (c["ours"], c["variants"]["--disable-worker-pipeline"]):
        assert (s["completed"], s["failed"]) == (3, 0) and len(s["repeats_output_throughput"]) == 2
        assert s["output_throughput"] in s["repeats_output_throughput"]
    v = c["variants"]["--disable-worker-pipeline"]
    assert v["ratio_output_throughput"] == pytest.approx(v["output_throughput"] / theirs)
    assert "with --disable-worker-pipeline" in proc.stdout
    served = (out / "log.txt").read_text()
    assert "--disable-worker-pipeline" in served


def test_prompt_steps_split_by_attention_form_and_allocations():
    from glm5_roofline import prompt_step_report

    steps = [
        {"mode": "prefill", "tokens": 1000, "ms": 40.0, "dense": True, "mallocs": 2, "retries": 0},
        {"mode": "prefill", "tokens": 1000, "ms": 20.0, "dense": True, "mallocs": 0, "retries": 0},
        {"mode": "mixed", "tokens": 500, "ms": 90.0, "dense": False, "mallocs": 0, "retries": 1},
        {"mode": "mixed", "tokens": 500, "ms": 30.0, "dense": False, "mallocs": 0, "retries": 0},
    ]
    r = prompt_step_report(steps)
    assert r["dense"] == {"steps": 2, "ms_median": 40.0, "ms_mean": 30.0, "ms_max": 40.0, "tokens_total": 2000}
    assert r["sparse"]["steps"] == 2 and r["sparse"]["ms_max"] == 90.0
    assert r["with_device_allocations"]["steps"] == 2 and r["with_device_allocations"]["ms_mean"] == 65.0
    assert r["without_device_allocations"]["ms_mean"] == 25.0 and r["allocator_retries"] == 1
    assert r["time"] == "ms"  # (no device times in these lines)
    # With device times logged they are what counts: a pipelined step's wall time may be another's.
    timed = [{**s, "ms": 0.5 if i % 2 else 700.0, "gpu_ms": 300.0 + i} for i, s in enumerate(steps)]
    r = prompt_step_report(timed)
    assert r["time"] == "gpu_ms" and r["all"]["ms_max"] == 303.0 and r["all"]["ms_median"] == 302.0


def test_decode_steps_split_by_graph_or_eager():
    from glm5_roofline import decode_path_split

    steps = [
        {"mode": "decode", "reqs": 64, "ms": 14.0, "gpu_ms": 13.0, "graph": True},
        {"mode": "decode", "reqs": 64, "ms": 41.0, "gpu_ms": 33.0, "graph": False},
        {"mode": "decode", "reqs": 62, "ms": 40.0, "gpu_ms": 35.0, "graph": False},
        {"mode": "mixed", "reqs": 64, "ms": 300.0, "gpu_ms": 290.0, "graph": False},
    ]
    split = decode_path_split(steps)
    assert split["graph"] == {"steps": 1, "ms_median": 13.0, "reqs_median": 64}
    assert split["eager"] == {"steps": 2, "ms_median": 35.0, "reqs_median": 64}
    assert decode_path_split([])["eager"] == {"steps": 0, "ms_median": None, "reqs_median": None}


def test_background_shard_writer_matches_the_reference_writer(tmp_path):
    """The generator's threaded raw-safetensors writer against checkpoint_io's save_file one."""
    from nsaserve.kernels.quant.checkpoint_io import CheckpointReader, ShardedWriter
    from nsaserve.kernels.quant.make_glm5_shaped import _BackgroundShardWriter

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "a.weight_scale": torch.rand(33, 2, generator=g).to(torch.float8_e4m3fn),
        "a.weight_scale_2": torch.tensor(0.25),
        "b.weight": torch.randint(0, 256, (40, 8), generator=g, dtype=torch.uint8),
        "c.bias": torch.randn(5, generator=g),
    }
    for cls, name in ((ShardedWriter, "ref"), (_BackgroundShardWriter, "fast")):
        w = cls(str(tmp_path / name), max_shard_bytes=1500)
        for k, t in tensors.items():
            w.add(k, t)
        w.close()
    assert sorted(os.listdir(tmp_path / "ref")) == sorted(os.listdir(tmp_path / "fast"))
    with CheckpointReader(str(tmp_path / "ref")) as ref, CheckpointReader(str(tmp_path / "fast")) as fast:
        assert ref.file_of == fast.file_of and len(set(ref.file_of.values())) > 1
        for k, t in tensors.items():
            got = fast.get(k)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)) if t.dim() else got == t


def test_decode_report_uses_full_decode_steps_and_targets_read_it(ckpt):
    from glm5_roofline import DecodeRoofline, decode_step_report
    from glm5_summary import targets

    roof = DecodeRoofline(ckpt, "fp8_e4m3")
    bw = 1e12
    steps = [
        {"mode": "prefill", "reqs": 256, "tokens": 9000, "ctx": 9000, "sel": 9000, "ms": 900.0},
        {"mode": "mixed", "reqs": 256, "tokens": 300, "ctx": 9000, "sel": 9000, "ms": 500.0},
        {"mode": "decode", "reqs": 100, "tokens": 100, "ctx": 5000, "sel": 3000, "ms": 1.0},  # a tail step
    ] + [
        {"mode": "decode", "reqs": 256, "tokens": 256, "ctx": 256 * 40, "sel": 256 * 32, "ms": m, "graph": m > 3}
        for m in (3.0, 5.0, 4.0)
    ]
    t = 100.0
    for s in steps[2:]:  # each decode step ends 0.5 ms after its own time past the one before
        t = s["t"] = t + (s["ms"] + 0.5) / 1e3
    r = decode_step_report(steps, roof, bw, 256)
    assert (r["decode_steps"], r["full_steps"], r["batch_median"], r["step_ms_median"]) == (4, 3, 256, 4.0)
    assert r["graph_steps"] == 2 and r["prefill_or_mixed_steps"] == 2
    assert r["between_steps_ms_median"] == pytest.approx(0.5)
    assert (r["prefill_or_mixed_ms_median"], r["prefill_or_mixed_tokens_median"]) == (900.0, 9000)
    roofline_ms = 1e3 * roof.step_bytes(256, 256 * 40, 256 * 32)["total"] / bw
    assert r["roofline_ms_median"] == pytest.approx(roofline_ms)
    assert r["ratio_median"] == pytest.approx(4.0 / roofline_ms)
    assert decode_step_report(steps[:2], roof, bw, 256) == {"decode_steps": 0}
    # Old step logs (no dense / allocator fields): sparse steps without allocations.
    assert r["prompt_steps"]["all"] == r["prompt_steps"]["sparse"] == r["prompt_steps"]["without_device_allocations"]
    assert r["prompt_steps"]["all"]["ms_mean"] == 700.0 and r["prompt_steps"]["dense"] == {"steps": 0}
    assert r["gpu_ms_median"] is None and r["gap_ms_median"] is None  # step logs without device times
    from glm5_roofline import slow_steps

    slow = slow_steps(steps, limit_ms=600.0)
    assert slow["count"] == 1 and slow["first"][0]["ms"] == 900.0 and slow["first"][0]["mode"] == "prefill"
    assert (slow["steps_that_compiled"], slow["compile_s"]) == (0, 0)
    compiled = slow_steps([*steps, {**steps[-1], "step": 99, "compiles": 2, "compile_s": 3.25}], limit_ms=600.0)
    assert (compiled["steps_that_compiled"], compiled["compile_s"]) == (1, 3.25)
    timed = [{**s, "gpu_ms": s["ms"] - 0.25, "prep_ms": 0.05, "gap_ms": 0.2} for s in steps]
    r = decode_step_report(timed, roof, bw, 256)
    assert (r["gpu_ms_median"], r["prep_ms_median"], r["gap_ms_median"]) == (3.75, 0.05, 0.2)
    # Steps whose contexts all fit the top-k log idx 0: the indexer read no key, the bound drops.
    unscored = decode_step_report([{**s, "idx": 0} for s in steps], roof, bw, 256)
    no_index_ms = 1e3 * roof.step_bytes(256, 0, 256 * 32)["total"] / bw
    assert unscored["roofline_ms_median"] == pytest.approx(no_index_ms) and no_index_ms < roofline_ms
    assert "bound_ms_median" not in r  # only with a matmul rate
    rated = decode_step_report(steps, roof, bw, 256, matmul_rate=1e12)
    bound_ms = 1e3 * roof.step_bound_s(256, 256 * 40, 256 * 32, bw, 1e12)["total"]
    assert rated["bound_ms_median"] == pytest.approx(bound_ms) and bound_ms >= roofline_ms
    assert rated["ratio_to_bound_median"] == pytest.approx(4.0 / bound_ms)
    assert set(rated["bound_at_median_ms"]) == set(rated["tflop_at_median"]) == {"weights", "experts", "attention", "total"}

    def level(c, out_tps, ttft, failed=0, decode=None):
        summary = {"failed": failed, "output_throughput": out_tps, "ttft": {"p50_ms": ttft}}
        return {"concurrency": c, "bench": {"summary": summary}, "decode": decode or {}}

    doc = {"phases": {"sweep": [level(64, 100.0, 50.0), level(256, 300.0, 80.0, decode={"ratio_median": 1.2})],
                      "prefill_alone": {"ttft_p50_ms": 20.0}, "compare": {"ratio_output_throughput": 25.0},
                      "finite_logits": {"finite": True}}}  # fmt: skip
    t = targets(doc)
    assert t["decode_256_within_1.5x_roofline"]["met"] and t["20x_transformers"]["met"]
    assert t["ttft_p50_64_within_2x_prefill_alone"] == {"ratio": 2.5, "met": False}
    assert t["zero_failed"]["met"] and t["throughput_rises_with_concurrency"]["met"] and t["finite_logits"]["met"]
    # The TTFT of requests that joined a running batch is shown beside the criterion, not in it.
    doc["phases"]["sweep"][0]["bench"]["summary"]["ttft_after_first_wave"] = {"p50_ms": 30.0}
    assert targets(doc)["ttft_p50_64_within_2x_prefill_alone"] == {"ratio": 2.5, "met": False, "after_first_wave_ratio": 1.5}
    # Levels run in another order (256 first): the throughput still compares by concurrency.
    doc["phases"]["sweep"] = [level(256, 300.0, 80.0), level(1024, 500.0, 90.0), level(64, 100.0, 50.0)]
    assert targets(doc)["throughput_rises_with_concurrency"]["met"]
    doc["phases"]["sweep"][1] = level(1024, 250.0, 90.0)
    assert not targets(doc)["throughput_rises_with_concurrency"]["met"]
