import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nsaserve.kernels.quant import dequantize_fp8_block, dequantize_nvfp4, load_quant_scheme, module_tensors
from nsaserve.kernels.quant.make_checkpoint import main, make_checkpoint

H, INTER, E = 64, 32, 4  # hidden, expert intermediate, routed experts


def tiny_glm_like_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A two-layer GLM-5-shaped state dict (dense layer 0, MoE layer 1), bf16 except the router bias."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": w(96, H), "model.norm.weight": w(H), "lm_head.weight": w(96, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": w(H),
            p + "post_attention_layernorm.weight": w(H),
            p + "self_attn.q_a_proj.weight": w(32, H),
            p + "self_attn.q_a_layernorm.weight": w(32),
            p + "self_attn.q_b_proj.weight": w(2 * 48, 32),
            p + "self_attn.kv_a_proj_with_mqa.weight": w(16 + 8, H),
            p + "self_attn.kv_a_layernorm.weight": w(16),
            p + "self_attn.kv_b_proj.weight": w(2 * 40, 16),
            p + "self_attn.o_proj.weight": w(H, 2 * 24),  # in = 48: a multiple of 16
            p + "self_attn.indexer.wq_b.weight": w(2 * 16, 32),
            p + "self_attn.indexer.wk.weight": w(16, H),
            p + "self_attn.indexer.k_norm.weight": w(16),
            p + "self_attn.indexer.k_norm.bias": w(16),
            p + "self_attn.indexer.weights_proj.weight": w(2, H),
        }
    sd |= {f"model.layers.0.mlp.{n}_proj.weight": w(INTER, H) for n in ("gate", "up")}
    sd["model.layers.0.mlp.down_proj.weight"] = w(H, INTER)
    sd["model.layers.1.mlp.gate.weight"] = w(E, H)
    sd["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.randn(E, generator=g)
    for e in range(E):
        p = f"model.layers.1.mlp.experts.{e}."
        sd |= {
            p + "gate_proj.weight": w(INTER, H),
            p + "up_proj.weight": w(INTER, H) * 4,
            p + "down_proj.weight": w(H, INTER),
        }
    sd |= {f"model.layers.1.mlp.shared_experts.{n}_proj.weight": w(INTER, H) for n in ("gate", "up")}
    sd["model.layers.1.mlp.shared_experts.down_proj.weight"] = w(H, INTER)
    sd["model.layers.1.self_attn.odd_proj.weight"] = w(8, 40)  # in = 40: not NVFP4-able, stays bf16
    return sd


def write_source(directory, sd, sharded: bool):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"architectures": ["GlmMoeDsaForCausalLM"], "hidden_size": H}, f)
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        f.write('{"model": "tiny"}')
    if not sharded:
        save_file(sd, os.path.join(directory, "model.safetensors"))
        return
    names = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: sd[n] for n in part}, os.path.join(directory, file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def read_output(directory) -> dict[str, torch.Tensor]:
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        return load_file(os.path.join(directory, "model.safetensors"))
    with open(index_path) as f:
        index = json.load(f)
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        shard = load_file(os.path.join(directory, file))
        assert all(index["weight_map"][n] == file for n in shard)
        out |= shard
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def linear_modules(sd):
    return [n[: -len(".weight")] for n, t in sd.items() if n.endswith(".weight") and t.dim() == 2]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    sd = tiny_glm_like_state()
    directory = tmp_path_factory.mktemp("src")
    write_source(str(directory), sd, sharded=True)
    return str(directory), sd


def test_nvfp4_all_linear_sharded(source, tmp_path):
    src, sd = source
    dst = str(tmp_path / "nvfp4")
    make_checkpoint(src, dst, "nvfp4", exclude=["*.indexer.wk"], max_shard_bytes=20_000, input_scale=0.5)
    out = read_output(dst)
    assert len([f for f in os.listdir(dst) if f.endswith(".safetensors")]) > 1
    assert open(os.path.join(dst, "tokenizer.json")).read() == '{"model": "tiny"}'
    with open(os.path.join(dst, "hf_quant_config.json")) as f:
        assert json.load(f)["quantization"]["quant_algo"] == "NVFP4"
    scheme = load_quant_scheme(dst)
    expected_bf16 = {
        "model.embed_tokens",
        "lm_head",
        "model.layers.1.mlp.gate",
        "model.layers.0.self_attn.indexer.weights_proj",
        "model.layers.1.self_attn.indexer.weights_proj",
        "model.layers.0.self_attn.indexer.wk",
        "model.layers.1.self_attn.indexer.wk",
        "model.layers.1.self_attn.odd_proj",
    }
    on_disk = {n for n in out}
    for module in linear_modules(sd):
        precision = scheme.precision_of(module)
        assert precision == ("bf16" if module in expected_bf16 else "nvfp4"), module
        load, skip = module_tensors(precision)
        # Tensors directly under the module; the router also owns its (never quantised) correction bias.
        own = {n for n in on_disk if n.rpartition(".")[0] == module and not n.endswith("e_score_correction_bias")}
        assert own == {f"{module}.{s}" for s in load + skip}
        if precision == "bf16":
            assert torch.equal(out[module + ".weight"], sd[module + ".weight"])
            assert module + ".weight_scale" not in out
            continue
        q = [out[module + s] for s in (".weight", ".weight_scale", ".weight_scale_2")]
        assert q[0].dtype == torch.uint8 and q[1].dtype == torch.float8_e4m3fn and q[2].shape == ()
        assert out[module + ".input_scale"].item() == 0.5
        original = sd[module + ".weight"].float()
        assert ((dequantize_nvfp4(*q) - original).norm() / original.norm()).item() < 0.15
    # Everything that is not a Linear weight is copied bit for bit, dtype included.
    bias = out["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, sd["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert torch.equal(
        out["model.layers.0.self_attn.indexer.k_norm.bias"], sd["model.layers.0.self_attn.indexer.k_norm.bias"]
    )
    # gate_proj and up_proj of one MLP share the global scale (the larger: up is 4x gate here).
    for p in ("model.layers.1.mlp.experts.2.", "model.layers.0.mlp.", "model.layers.1.mlp.shared_experts."):
        gate, up = out[p + "gate_proj.weight_scale_2"], out[p + "up_proj.weight_scale_2"]
        assert gate.item() == up.item()
        assert up.item() == pytest.approx(sd[p + "up_proj.weight"].float().abs().max().item() / 2688, rel=1e-6)
    assert (
        out["model.layers.1.mlp.experts.2.down_proj.weight_scale_2"].item()
        != out["model.layers.1.mlp.experts.2.up_proj.weight_scale_2"].item()
    )


def test_nvfp4_experts_only(source, tmp_path):
    src, sd = source
    dst = str(tmp_path / "experts")
    make_checkpoint(src, dst, "nvfp4", scope="experts")
    out = read_output(dst)
    assert os.listdir(dst).count("model.safetensors") == 1 and "model.safetensors.index.json" not in os.listdir(dst)
    scheme = load_quant_scheme(dst)
    for module in linear_modules(sd):
        quantised = ".mlp.experts." in module
        assert scheme.precision_of(module) == ("nvfp4" if quantised else "bf16"), module
        assert (module + ".weight_scale" in out) == quantised


def test_fp8_block_via_cli(source, tmp_path):
    src, sd = source
    dst = str(tmp_path / "fp8")
    main(["--src", src, "--dst", dst, "--format", "fp8_block", "--exclude", "model.layers.0.self_attn"])
    out = read_output(dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["hidden_size"] == H
    assert not os.path.exists(os.path.join(dst, "hf_quant_config.json"))
    scheme = load_quant_scheme(dst)
    for module in linear_modules(sd):
        precision = scheme.precision_of(module)
        assert (module + ".weight_scale_inv" in out) == (precision == "fp8_block"), module
        if precision == "fp8_block":
            original = sd[module + ".weight"].float()
            deq = dequantize_fp8_block(out[module + ".weight"], out[module + ".weight_scale_inv"])
            assert ((deq - original).norm() / original.norm()).item() < 0.05
    assert scheme.precision_of("model.layers.0.self_attn.q_a_proj") == "bf16"
    assert scheme.precision_of("model.layers.1.self_attn.q_a_proj") == "fp8_block"
    assert scheme.precision_of("model.layers.1.self_attn.odd_proj") == "fp8_block"  # any shape works in FP8


def test_single_file_source_and_refusals(tmp_path):
    sd = {"model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(16, 32, dtype=torch.bfloat16)}
    src = str(tmp_path / "src")
    write_source(src, sd, sharded=False)
    dst = str(tmp_path / "dst")
    make_checkpoint(src, dst, "nvfp4")
    assert read_output(dst)["model.layers.0.mlp.experts.0.up_proj.weight"].shape == (16, 16)
    with pytest.raises(FileExistsError):
        make_checkpoint(src, dst, "nvfp4")
    with pytest.raises(ValueError):
        make_checkpoint(dst, str(tmp_path / "again"), "nvfp4")  # already quantised
    with pytest.raises(ValueError):
        make_checkpoint(src, str(tmp_path / "x"), "int4")


@pytest.mark.parametrize("quantize_mtp", [False, True])
def test_mtp_layers_stay_bf16_unless_asked(tmp_path, quantize_mtp):
    g = torch.Generator().manual_seed(7)
    sd = {f"model.layers.{i}.mlp.experts.0.up_proj.weight": torch.randn(16, 32, generator=g).bfloat16() for i in (0, 1)}
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_source(src, sd, sharded=False)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = 1  # layer 1 is the MTP layer
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    qc = make_checkpoint(src, dst, "nvfp4", quantize_mtp=quantize_mtp)
    out = read_output(dst)
    assert "model.layers.0.mlp.experts.0.up_proj.weight_scale" in out
    assert ("model.layers.1.mlp.experts.0.up_proj.weight_scale" in out) == quantize_mtp
    assert ("model.layers.1" in qc["ignore"]) != quantize_mtp
    assert load_quant_scheme(dst).precision_of("model.layers.1.mlp.experts.0.up_proj") == (
        "nvfp4" if quantize_mtp else "bf16"
    )
