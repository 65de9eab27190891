"""Loading: missing / unexpected tensors are named; MTP layers are skipped; tied embeddings.
Config: GLM-5.2 indexer schedules and the old rope_scaling layout."""

import json

import pytest
import torch
from model_helpers import Session, make_checkpoint, rel_err
from safetensors.torch import load_file, save_file

from nsaserve.model.config import parse_config
from nsaserve.model.runner import ModelRunner


def load(path, **kw):
    return ModelRunner(
        str(path), device=torch.device("cpu"), dtype=None, num_pages=8, page_size=4, show_progress=False, **kw
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm")
    make_checkpoint("glm_moe_dsa", str(path), seed=4)
    return path, load_file(path / "model.safetensors")


def rewrite(src, dst, tensors, config_update=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config_update or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, dst / "model.safetensors")


def test_missing_tensor_is_named(ckpt, tmp_path):
    src, sd = ckpt
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    rewrite(src, tmp_path / "m", {k: v for k, v in sd.items() if k != name})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load(tmp_path / "m")


def test_unexpected_tensor_is_named(ckpt, tmp_path):
    src, sd = ckpt
    rewrite(src, tmp_path / "u", {**sd, "model.layers.1.self_attn.surprise.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"surprise"):
        load(tmp_path / "u")


def test_shared_indexer_layer_has_no_indexer_weights(ckpt, tmp_path):
    src, sd = ckpt
    extra = {"model.layers.2.self_attn.indexer.wk.weight": sd["model.layers.1.self_attn.indexer.wk.weight"].clone()}
    rewrite(src, tmp_path / "s", {**sd, **extra})
    with pytest.raises(ValueError, match=r"layers\.2\.self_attn\.indexer\.wk"):
        load(tmp_path / "s")


def test_mtp_layer_is_ignored(ckpt, tmp_path):
    src, sd = ckpt
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64)}
    rewrite(src, tmp_path / "t", {**sd, **mtp})
    tokens = list(range(10))
    a = Session(load(src)).step([(0, tokens)], all_logits=True)[0]
    b = Session(load(tmp_path / "t")).step([(0, tokens)], all_logits=True)[0]
    assert torch.equal(a, b)


def test_tied_embeddings_without_lm_head(ckpt, tmp_path):
    src, sd = ckpt
    tied = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    rewrite(src, tmp_path / "tied", tied, {"tie_word_embeddings": True})
    runner = load(tmp_path / "tied")
    assert torch.equal(runner.model.lm_head.weight, sd["model.embed_tokens.weight"])
    rewrite(src, tmp_path / "untied", tied, {"tie_word_embeddings": False})
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load(tmp_path / "untied")


def test_bfloat16_from_dtype_argument(ckpt):
    src, _ = ckpt
    runner = load(src, kv_cache_dtype="auto")
    assert runner.model.model.embed_tokens.weight.dtype == torch.float32  # config dtype ("auto")
    bf = ModelRunner(str(src), device=torch.device("cpu"), dtype=torch.bfloat16, num_pages=8, page_size=4,
                     show_progress=False)  # fmt: skip
    assert bf.model.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    # Router and indexer weights_proj stay float32, as in the reference.
    assert bf.model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert bf.model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    tokens = list(range(12))
    a = Session(runner).step([(0, tokens)], all_logits=True)[0]
    b = Session(bf).step([(0, tokens)], all_logits=True)[0]
    assert rel_err(b, a) < 0.5  # same model, coarser arithmetic


def test_bad_kv_cache_dtype(ckpt):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        load(ckpt[0], kv_cache_dtype="int4")


BASE = dict(
    vocab_size=10, hidden_size=8, intermediate_size=8, moe_intermediate_size=4, num_hidden_layers=6,
    num_attention_heads=2, q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2,
    v_head_dim=2, num_experts_per_tok=1, max_position_embeddings=64, index_topk=4, index_n_heads=2,
    index_head_dim=4,
)  # fmt: skip


def test_glm_indexer_schedules():
    glm = dict(BASE, model_type="glm_moe_dsa")
    assert parse_config(glm).indexer_types == ["full"] * 6
    sched = parse_config(dict(glm, index_topk_freq=2, index_skip_topk_offset=2)).indexer_types
    assert sched == ["full", "full", "shared", "full", "shared", "full"]
    assert parse_config(dict(glm, index_topk_pattern="FSFFSS")).indexer_types == [
        "full", "shared", "full", "full", "shared", "shared"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="first layer"):
        parse_config(dict(glm, indexer_types=["shared"] + ["full"] * 5))


def test_rope_and_indexer_conventions():
    ds = parse_config(
        dict(BASE, model_type="deepseek_v32", rope_theta=10000.0,
             rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                           "mscale": 1.0, "mscale_all_dim": 1.0})
    )  # fmt: skip
    assert ds.rope_parameters["rope_type"] == "yarn" and ds.rope_parameters["rope_theta"] == 10000.0
    assert not ds.indexer_rope_interleave and ds.mla_rope_interleave
    assert parse_config(dict(BASE, model_type="glm_moe_dsa")).indexer_rope_interleave
    assert not parse_config(dict(BASE, model_type="glm_moe_dsa", indexer_rope_interleave=False)).indexer_rope_interleave
    assert ds.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 3
    with pytest.raises(ValueError, match="model_type"):
        parse_config(dict(BASE, model_type="llama"))


def test_quantised_checkpoint_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="fp8"):
        parse_config(dict(BASE, model_type="deepseek_v32", quantization_config={"quant_method": "fp8"}))
