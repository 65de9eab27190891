import json

import pytest

from nsaserve.kernels.quant import load_quant_scheme, parse_quant_scheme

# Shaped like a GLM-5 NVFP4 ModelOpt export: routed experts NVFP4; attention, shared experts, the
# three dense layers and the MTP layer 78 excluded.
GLM5_NVFP4_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "quantization_config": {
        "config_groups": {
            "group_0": {
                "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                "targets": ["Linear"],
            }
        },
        "ignore": [
            "lm_head",
            "model.layers.*.self_attn*",
            "model.layers.0.mlp*",
            "model.layers.1.mlp*",
            "model.layers.2.mlp*",
            "model.layers.*.mlp.shared_experts*",
            "model.layers.78",
        ],
        "quant_algo": "NVFP4",
        "kv_cache_scheme": None,
        "producer": {"name": "modelopt", "version": "0.37.0"},
        "quant_method": "modelopt",
    },
}

DEEPSEEK_V32_FP8_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}


def test_glm5_nvfp4_export():
    scheme = parse_quant_scheme(GLM5_NVFP4_CONFIG)
    p = scheme.precision_of
    assert p("model.layers.3.mlp.experts.0.gate_proj") == "nvfp4"
    assert p("model.layers.77.mlp.experts.255.down_proj") == "nvfp4"
    assert p("model.layers.3.mlp.shared_experts.up_proj") == "bf16"
    assert p("model.layers.0.mlp.gate_proj") == "bf16"
    assert p("model.layers.10.self_attn.q_b_proj") == "bf16"
    assert p("model.layers.10.self_attn.indexer.wk") == "bf16"
    assert p("model.layers.78.mlp.experts.0.up_proj") == "bf16"  # parent-module entry
    assert p("model.layers.3.mlp.gate") == "bf16"  # router, always
    assert p("lm_head") == "bf16"


def test_hf_quant_config_only_and_always_bf16_modules(tmp_path):
    # Older ModelOpt exports: config.json without quantization_config + hf_quant_config.json.
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV32ForCausalLM"]}))
    hf = {
        "producer": {"name": "modelopt", "version": "0.23.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": "FP8",
            "group_size": 16,
            "exclude_modules": ["lm_head", "model.layers.*.self_attn.indexer.wk", "model.layers.61*"],
        },
    }
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf))
    scheme = load_quant_scheme(str(tmp_path))
    p = scheme.precision_of
    assert scheme.kv_cache_quant_algo == "FP8"
    assert p("model.layers.5.self_attn.q_a_proj") == "nvfp4"  # attention quantised in this variant
    assert p("model.layers.5.self_attn.kv_b_proj") == "nvfp4"
    assert p("model.layers.5.self_attn.indexer.wk") == "bf16"
    assert p("model.layers.5.self_attn.indexer.weights_proj") == "bf16"
    assert p("model.layers.61.eh_proj") == "bf16"
    assert p("model.layers.5.mlp.gate") == "bf16" and p("model.layers.5.mlp.gate_proj") == "nvfp4"
    assert p("model.embed_tokens") == "bf16"


def test_both_files_merge_their_exclusions():
    hf = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["*o_proj"]}}
    scheme = parse_quant_scheme(GLM5_NVFP4_CONFIG, hf)
    assert scheme.precision_of("model.layers.4.mlp.experts.1.o_proj") == "bf16"
    assert scheme.precision_of("model.layers.4.self_attn.q_a_proj") == "bf16"
    assert scheme.precision_of("model.layers.4.mlp.experts.1.up_proj") == "nvfp4"


def test_deepseek_fp8_block():
    p = parse_quant_scheme(DEEPSEEK_V32_FP8_CONFIG).precision_of
    assert p("model.layers.0.self_attn.q_a_proj") == "fp8_block"
    assert p("model.layers.0.self_attn.indexer.wk") == "fp8_block"
    assert p("model.layers.0.self_attn.indexer.weights_proj") == "bf16"
    assert p("model.layers.9.mlp.experts.3.down_proj") == "fp8_block"
    assert p("model.layers.9.mlp.gate") == "bf16" and p("lm_head") == "bf16"


def test_fp8_modules_to_not_convert():
    cfg = json.loads(json.dumps(DEEPSEEK_V32_FP8_CONFIG))
    cfg["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.self_attn.kv_b_proj"]
    p = parse_quant_scheme(cfg).precision_of
    assert p("model.layers.0.self_attn.kv_b_proj") == "bf16"
    assert p("model.layers.1.self_attn.kv_b_proj") == "fp8_block"


def test_mixed_precision_layers():
    hf = {
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {"model.layers.3.mlp.experts.0.up_proj": {"quant_algo": "NVFP4", "group_size": 16}},
        }
    }
    p = parse_quant_scheme(None, hf).precision_of
    assert p("model.layers.3.mlp.experts.0.up_proj") == "nvfp4"
    assert p("model.layers.3.mlp.experts.0.down_proj") == "bf16"


def test_unquantised_checkpoint_is_all_bf16():
    assert (
        parse_quant_scheme({"architectures": ["GlmMoeDsaForCausalLM"]}).precision_of(
            "model.layers.3.mlp.experts.0.up_proj"
        )
        == "bf16"
    )


@pytest.mark.parametrize(
    "config, hf",
    [
        ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}}, None),
        ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}, None),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, None),
        ({"quantization_config": {"quant_method": "gptq"}}, None),
        (GLM5_NVFP4_CONFIG, {"quantization": {"quant_algo": "W4A8_AWQ"}}),
        (DEEPSEEK_V32_FP8_CONFIG, {"quantization": {"quant_algo": "NVFP4"}}),
    ],
)
def test_unsupported_or_contradictory_configs_are_refused(config, hf):
    with pytest.raises(ValueError):
        parse_quant_scheme(config, hf)
