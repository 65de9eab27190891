"""Loading quantised checkpoints: weights stay quantised in memory (NVFP4 ~0.28x, FP8 ~0.5x the bf16
bytes of the same modules); a missing, unexpected or wrongly typed tensor is an error naming it;
NVFP4's input_scale is accepted and not required; unsupported configs are refused before loading."""

import json

import pytest
import torch
from model_helpers import Session, make_checkpoint, quantize_checkpoint
from safetensors.torch import load_file
from test_loader_and_config import BASE, rewrite

from nsaserve.model.config import parse_config
from nsaserve.model.expert_stack import ExpertStack
from nsaserve.model.quant_linear import QuantLinear
from nsaserve.model.runner import ModelRunner


def load(path, dtype=None):
    return ModelRunner(
        str(path), device=torch.device("cpu"), dtype=dtype, num_pages=8, page_size=4, show_progress=False
    )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    make_checkpoint("glm_moe_dsa", str(root / "float"), seed=6)
    for fmt in ("nvfp4", "fp8_block"):
        quantize_checkpoint(str(root / "float"), str(root / fmt), fmt)
    return root


def quantized_modules(model):
    """Names of the modules holding quantised weights (Linear layers and expert stacks)."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, QuantLinear) or (isinstance(m, ExpertStack) and m.quantized)
    ]


def param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.mark.parametrize("fmt, low, high", [("nvfp4", 0.27, 0.30), ("fp8_block", 0.49, 0.52)])
def test_quantized_bytes_against_bf16(ckpts, fmt, low, high):
    bf16 = load(ckpts / "float", torch.bfloat16).model
    runner = load(ckpts / fmt, torch.bfloat16)
    quant = runner.model
    names = quantized_modules(quant)
    # Every Linear but the always-bf16 ones: 3 layers x (attention + indexer) + MLPs + expert stacks.
    assert len(names) > 20
    assert not any(n.endswith(("weights_proj", "lm_head")) for n in names)
    q = sum(param_bytes(quant.get_submodule(n)) for n in names)
    b = sum(param_bytes(bf16.get_submodule(n)) for n in names)
    assert low < q / b < high, q / b
    assert param_bytes(quant) < param_bytes(bf16)
    # The bf16 compute path runs (weights dequantised to bf16; the oracle tests cover float32).
    logits = Session(runner).step([(0, list(range(12)))], all_logits=True)[0]
    assert logits.shape == (12, runner.vocab_size) and torch.isfinite(logits).all()


def test_missing_quantised_tensor_is_named(ckpts, tmp_path):
    sd = load_file(ckpts / "nvfp4" / "model.safetensors")
    for i, name in enumerate(
        ["model.layers.1.mlp.experts.3.down_proj.weight_scale", "model.layers.0.self_attn.q_a_proj.weight_scale_2"]
    ):
        rewrite(ckpts / "nvfp4", tmp_path / f"m{i}", {k: v for k, v in sd.items() if k != name})
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            load(tmp_path / f"m{i}")


def test_unexpected_scale_is_named(ckpts, tmp_path):
    sd = load_file(ckpts / "nvfp4" / "model.safetensors")
    extra = {
        "model.layers.1.self_attn.q_a_layernorm.weight_scale": torch.ones(1),
        "lm_head.input_scale": torch.ones(()),
    }
    rewrite(ckpts / "nvfp4", tmp_path / "u", {**sd, **extra})
    with pytest.raises(ValueError, match=r"unexpected.*lm_head\.input_scale.*q_a_layernorm\.weight_scale"):
        load(tmp_path / "u")


def test_wrong_dtype_is_named(ckpts, tmp_path):
    sd = load_file(ckpts / "nvfp4" / "model.safetensors")
    name = "model.layers.2.self_attn.kv_b_proj.weight_scale"
    rewrite(ckpts / "nvfp4", tmp_path / "d", {**sd, name: sd[name].float()})
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*dtype"):
        load(tmp_path / "d")


def test_input_scale_is_optional_and_unused(ckpts, tmp_path):
    sd = load_file(ckpts / "nvfp4" / "model.safetensors")
    assert any(k.endswith(".input_scale") for k in sd)
    rewrite(ckpts / "nvfp4", tmp_path / "w4a16", {k: v for k, v in sd.items() if not k.endswith(".input_scale")})
    scaled = {k: v * 7 if k.endswith(".input_scale") else v for k, v in sd.items()}
    rewrite(ckpts / "nvfp4", tmp_path / "scaled", scaled)
    tokens = list(range(12))
    ref = Session(load(ckpts / "nvfp4")).step([(0, tokens)], all_logits=True)[0]
    for variant in ("w4a16", "scaled"):
        assert torch.equal(Session(load(tmp_path / variant)).step([(0, tokens)], all_logits=True)[0], ref)


def test_experts_of_one_layer_must_share_a_precision(ckpts, tmp_path):
    quantize_checkpoint(
        str(ckpts / "float"), str(tmp_path / "mixed"), "nvfp4", exclude=["model.layers.2.mlp.experts.5"]
    )
    with pytest.raises(ValueError, match=r"share one precision.*bf16 \(e\.g\. model\.layers\.2\.mlp\.experts\.5\."):
        load(tmp_path / "mixed")


def test_unsupported_quantisation_is_refused():
    cfg = dict(BASE, model_type="glm_moe_dsa")
    with pytest.raises(NotImplementedError, match="modelopt.*FP8"):
        parse_config(dict(cfg, quantization_config={"quant_method": "modelopt", "quant_algo": "FP8"}))
    with pytest.raises(NotImplementedError, match="128x128"):
        parse_config(dict(cfg, quantization_config={"quant_method": "fp8", "weight_block_size": [1, 128]}))
    ok = parse_config(dict(cfg, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}))
    assert ok.quant.precision_of("model.layers.1.self_attn.q_a_proj") == "fp8_block"


def test_config_and_tensors_disagreeing_is_named(ckpts, tmp_path):
    """The config keeps q_a_proj in bf16 but the file holds it in NVFP4: the packed weight is named."""
    sd = load_file(ckpts / "nvfp4" / "model.safetensors")
    qc = json.loads((ckpts / "nvfp4" / "config.json").read_text())["quantization_config"]
    qc = dict(qc, ignore=qc["ignore"] + ["model.layers.0.self_attn.q_a_proj"])
    rewrite(ckpts / "nvfp4", tmp_path / "c", sd, {"quantization_config": qc})
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_a_proj\.weight: checkpoint dtype torch\.uint8"):
        load(tmp_path / "c")
