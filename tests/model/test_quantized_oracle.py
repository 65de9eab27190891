"""Oracle for quantised checkpoints: a tiny random model of each type, quantised to NVFP4 (every
Linear, or routed experts only) and to 128x128 block FP8, loaded with the weights kept quantised,
must give the logits transformers gives on the DEQUANTISED weights (float32, relative error
<= 1e-4): prefill logits of every position, then greedy decode steps through scrambled pages.

The quantisation error itself is large on these tiny random models, so the same comparison against
the original float model fails by orders of magnitude: the test can tell whether the quantised
weights (and not some other copy) are what runs.
"""

import os
import shutil

import pytest
import torch
from model_helpers import (
    VOCAB,
    Session,
    dequantized_checkpoint,
    hf_greedy,
    hf_prefill_logits,
    load_hf,
    make_checkpoint,
    quantize_checkpoint,
    rel_err,
)
from safetensors.torch import load_file, save_file

from nsaserve.model.linear import Linear
from nsaserve.model.quant_linear import Fp8BlockLinear, Nvfp4Linear
from nsaserve.model.runner import ModelRunner

TOL = 1e-4
DECODE_STEPS = 6
# (format, make_checkpoint scope, class of an attention Linear, precision of the routed experts)
VARIANTS = {
    "nvfp4": ("nvfp4", "linear", Nvfp4Linear, "nvfp4"),
    "nvfp4-experts": ("nvfp4", "experts", Linear, "nvfp4"),
    "fp8_block": ("fp8_block", "linear", Fp8BlockLinear, "fp8_block"),
}


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def float_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return make_checkpoint(request.param, str(path / "float"), seed=5), path


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_quantized_matches_transformers_on_dequantized_weights(float_model, variant):
    original, root = float_model
    fmt, scope, attn_cls, expert_precision = VARIANTS[variant]
    quant, deq = str(root / variant), str(root / f"{variant}-dequantized")
    quantize_checkpoint(str(root / "float"), quant, fmt, scope)
    dequantized_checkpoint(quant, deq)
    hf = load_hf(deq)
    runner = ModelRunner(quant, device=torch.device("cpu"), dtype=None, num_pages=40, page_size=4, show_progress=False)

    moe_layer = runner.model.model.layers[1]
    assert type(moe_layer.self_attn.q_b_proj) is attn_cls
    assert type(moe_layer.mlp.shared_experts.up_proj) is attn_cls
    assert moe_layer.mlp.w13.precision == moe_layer.mlp.w2.precision == expert_precision
    assert type(moe_layer.self_attn.indexer.weights_proj) is Linear  # never quantised

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    ours = Session(runner).step([(0, tokens)], all_logits=True)[0]
    assert rel_err(ours, hf_prefill_logits(hf, tokens)) < TOL
    assert rel_err(ours, hf_prefill_logits(original, tokens)) > 100 * TOL

    ref_tokens, ref_logits = hf_greedy(hf, tokens, DECODE_STEPS)
    session = Session(runner, seed=7)
    logits = session.step([(0, tokens)])[0]
    assert session.reqs[0].pages != sorted(session.reqs[0].pages), "pages should be scattered"
    for step, tok in enumerate([None] + ref_tokens):
        if tok is not None:
            logits = session.step([(0, [tok])])[0]
        assert rel_err(logits, ref_logits[step]) < TOL, f"step {step}"


def test_gate_and_up_with_their_own_global_scales(float_model):
    """Exports usually give gate_proj and up_proj one shared weight_scale_2, but the format does not
    require it: with up_proj's global scale changed (a different but valid NVFP4 weight) in every
    expert, the stacked experts must still apply each projection its own scale."""
    _, root = float_model
    quant, odd = str(root / "shared-scales"), str(root / "own-scales")
    quantize_checkpoint(str(root / "float"), quant, "nvfp4", "experts")
    sd = load_file(f"{quant}/model.safetensors")
    changed = {k: v * 1.5 for k, v in sd.items() if k.endswith("up_proj.weight_scale_2")}
    assert len(changed) == 2 * 8  # two MoE layers x 8 experts
    os.makedirs(odd)
    shutil.copy(f"{quant}/config.json", odd)
    save_file({**sd, **changed}, f"{odd}/model.safetensors")
    for path in (quant, odd):
        dequantized_checkpoint(path, path + "-dequantized")
    runner = ModelRunner(odd, device=torch.device("cpu"), dtype=None, num_pages=40, page_size=4, show_progress=False)
    tokens = list(range(5, 25))
    ours = Session(runner).step([(0, tokens)], all_logits=True)[0]
    assert rel_err(ours, hf_prefill_logits(load_hf(odd + "-dequantized"), tokens)) < TOL
    assert rel_err(ours, hf_prefill_logits(load_hf(quant + "-dequantized"), tokens)) > 100 * TOL
