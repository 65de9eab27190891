"""Quantised checkpoints under TP=2 (two processes, gloo) give the same logits as TP=1, on every rank.

NVFP4 (every Linear) for both model types, block FP8 for GLM. In the tiny models some splits land on
scale-group boundaries and stay quantised slices (NVFP4 o_proj: 32 of 64 inputs per rank = 16 bytes
of packed weight and 2 scale columns), others do not (the shared expert's down_proj: 8 of 16 inputs;
every FP8 split, all dims being < 128) and are dequantised once at load and sliced; both kinds are
checked against the checkpoint on rank 1 too.
"""

import torch
from model_helpers import make_checkpoint, quantize_checkpoint, rel_err
from safetensors.torch import load_file
from test_tensor_parallel import TP_VOCAB, _worker, run_steps, spawn_gloo

from nsaserve.kernels.quant import dequantize_nvfp4
from nsaserve.model.linear import Linear
from nsaserve.model.quant_linear import Fp8BlockLinear, Nvfp4Linear
from nsaserve.model.runner import ModelRunner

CASES = [("glm_moe_dsa", "nvfp4"), ("deepseek_v32", "nvfp4"), ("glm_moe_dsa", "fp8_block")]


def check_rank1_slices(path: str, fmt: str) -> None:
    """Rank 1's tensors, loaded without running (no process group needed), against the checkpoint."""
    runner = ModelRunner(
        path,
        device=torch.device("cpu"),
        dtype=None,
        num_pages=4,
        page_size=4,
        show_progress=False,
        tp_rank=1,
        tp_size=2,
    )
    layer = runner.model.model.layers[1]
    attn, shared = layer.self_attn, layer.mlp.shared_experts
    assert layer.mlp.w13.weight.shape[0] == 4  # experts 4..7 of 8, whole
    if fmt == "fp8_block":
        assert type(attn.q_a_proj) is Fp8BlockLinear  # replicated: not split, stays FP8
        assert type(attn.q_b_proj) is Linear and type(attn.o_proj) is Linear
        return
    sd = load_file(f"{path}/model.safetensors")
    p = "model.layers.1."
    assert type(attn.o_proj) is Nvfp4Linear and type(attn.q_b_proj) is Nvfp4Linear
    assert torch.equal(attn.o_proj.weight, sd[p + "self_attn.o_proj.weight"][:, 16:32])
    assert torch.equal(
        attn.o_proj.weight_scale.view(torch.uint8), sd[p + "self_attn.o_proj.weight_scale"][:, 2:4].view(torch.uint8)
    )
    assert torch.equal(attn.q_b_proj.weight, sd[p + "self_attn.q_b_proj.weight"][48:96])
    assert type(shared.down_proj) is Linear
    n = p + "mlp.shared_experts.down_proj."
    full = dequantize_nvfp4(sd[n + "weight"], sd[n + "weight_scale"], sd[n + "weight_scale_2"])
    assert torch.equal(shared.down_proj.weight, full[:, 8:16])


def test_quantized_tp2_equals_tp1(tmp_path):
    paths = []
    for model_type, fmt in CASES:
        src, dst = tmp_path / f"{model_type}-float", tmp_path / f"{model_type}-{fmt}"
        make_checkpoint(model_type, str(src), seed=2, vocab_size=TP_VOCAB)
        quantize_checkpoint(str(src), str(dst), fmt)
        paths.append(str(dst))
        check_rank1_slices(str(dst), fmt)
    spawn_gloo(_worker, 2, paths, str(tmp_path))
    for i, path in enumerate(paths):
        single = run_steps(path)
        r0, r1 = (torch.load(tmp_path / f"{i}-rank{r}.pt") for r in (0, 1))
        assert r0.shape == single.shape == (32 + 12, TP_VOCAB)
        assert torch.equal(r0, r1), f"{CASES[i]}: ranks must return identical logits"
        assert rel_err(r0, single) < 1e-5, CASES[i]
