"""`--load-format random`: the weights drawn on the device by the GLM-5-shaped generator equal the
checkpoint that generator writes, go through the normal loader (so logits match loading that
checkpoint, at TP=1 and TP=2), and each rank draws only the experts it owns."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model_helpers import Session, rel_err
from test_tensor_parallel import free_port

from nsaserve.kernels.quant import BF16, NVFP4
from nsaserve.kernels.quant.checkpoint_io import CheckpointReader
from nsaserve.kernels.quant.make_checkpoint import _quantization_config
from nsaserve.kernels.quant.make_glm5_shaped import (
    TINY_OVERRIDES,
    draw_expert,
    main,
    make_glm5_config_dir,
    make_glm5_shaped,
)
from nsaserve.kernels.quant.precision import ALWAYS_BF16
from nsaserve.model.config import load_config
from nsaserve.model.runner import ModelRunner
from nsaserve.model.weight_source import GeneratedSource

CPU = torch.device("cpu")
SEED = 0  # what --load-format random draws with
VOCAB = TINY_OVERRIDES["vocab_size"]
N_EXPERTS = TINY_OVERRIDES["n_routed_experts"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(a written checkpoint, a config-only directory) of the same 1 dense + 1 MoE tiny model."""
    root = tmp_path_factory.mktemp("randload")
    ckpt, cfg_only = str(root / "ckpt"), str(root / "config")
    make_glm5_shaped(ckpt, moe_layers=1, dense_layers=1, overrides=TINY_OVERRIDES, seed=SEED)
    main(["--dst", cfg_only, "--moe-layers", "1", "--dense-layers", "1", "--tiny", "--config-only"])
    return ckpt, cfg_only


def runner(path, load_format="safetensors", dtype=None, **tp):
    return ModelRunner(
        path, device=CPU, dtype=dtype, num_pages=32, page_size=4, show_progress=False, load_format=load_format, **tp
    )


def run_steps(r) -> torch.Tensor:
    """A prefill of two requests, then 4 batched decode steps (fixed tokens); all logits stacked."""
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (19, 13))
    session = Session(r, seed=4)
    out = [torch.cat(session.step([(0, a), (1, b)], all_logits=True))]
    for i in range(4):
        out.append(torch.stack(session.step([(0, [(7 * i) % VOCAB]), (1, [(5 * i + 3) % VOCAB])])))
    return torch.cat(out)


def test_config_only_dir_has_config_and_tokenizer_but_no_tensors(dirs):
    ckpt, cfg_only = dirs
    files = set(os.listdir(cfg_only))
    assert {"config.json", "hf_quant_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not any(f.endswith(".safetensors") for f in files)
    for name in ("config.json", "hf_quant_config.json"):
        with open(os.path.join(ckpt, name)) as f, open(os.path.join(cfg_only, name)) as g:
            assert json.load(f) == json.load(g), name


def test_generated_tensors_equal_the_written_checkpoint_byte_for_byte(dirs):
    ckpt, _ = dirs
    source = GeneratedSource(load_config(ckpt), CPU, seed=SEED)
    with CheckpointReader(ckpt) as reader:
        assert sorted(source.names()) == sorted(reader.names())
        for name in source.names():
            want, got = reader.get(name), source.read(name, None)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    assert len(source.experts_drawn) == N_EXPERTS  # each expert drawn once, its tensors read from one draw


def test_a_slice_is_the_slice_of_the_whole_tensor(dirs):
    source = GeneratedSource(load_config(dirs[0]), CPU, seed=SEED)
    name = "model.layers.0.self_attn.q_b_proj.weight"
    assert torch.equal(source.read(name, (0, 96, 96)), source.read(name, None)[96:192])


def test_random_runner_gives_the_checkpoint_runner_logits(dirs):
    ckpt, cfg_only = dirs
    want = run_steps(runner(ckpt))
    got = run_steps(runner(cfg_only, "random"))
    assert torch.isfinite(want).all() and torch.equal(got, want)


def test_deepseek_v32_naming_loads_the_same_weights(dirs, tmp_path):
    """DeepSeek-V3.2 configs name the tensors the same way; the dense/MoE split comes from
    first_k_dense_replace when mlp_layer_types is absent."""
    ckpt, cfg_only = dirs
    with open(os.path.join(cfg_only, "config.json")) as f:
        cfg = json.load(f)
    cfg["model_type"], cfg["architectures"] = "deepseek_v32", ["DeepseekV32ForCausalLM"]
    del cfg["mlp_layer_types"]
    os.makedirs(tmp_path / "ds")
    with open(tmp_path / "ds" / "config.json", "w") as f:
        json.dump(cfg, f)
    a, b = runner(ckpt), runner(str(tmp_path / "ds"), "random")
    assert a.model.model.layers[1].mlp.w13.precision == b.model.model.layers[1].mlp.w13.precision == NVFP4
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tied_embeddings_draw_no_lm_head(tmp_path):
    path = str(tmp_path / "tied")
    make_glm5_config_dir(path, 1, 1, overrides=TINY_OVERRIDES | {"tie_word_embeddings": True})
    r = runner(path, "random")
    assert "lm_head.weight" not in GeneratedSource(r.config, CPU).names()
    assert torch.equal(r.model.lm_head.weight, r.model.model.embed_tokens.weight)


def _write_config(src: str, dst, quantization: tuple[dict, dict] | None) -> str:
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    os.makedirs(dst)
    if quantization is not None:
        cfg["quantization_config"] = quantization[0]
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump(quantization[1], f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_a_bf16_config_draws_bf16_experts(dirs, tmp_path):
    """No quantisation in the config: experts are the same draw, stored as a bf16 checkpoint would."""
    path = _write_config(dirs[1], tmp_path / "bf16", None)
    r = runner(path, "random")
    stack = r.model.model.layers[1].mlp.w13
    assert stack.precision == BF16
    drawn = draw_expert(GeneratedSource(r.config, CPU).gen_cfg, 1, 3, SEED, CPU, BF16)
    expert = "model.layers.1.mlp.experts.3."
    want = torch.cat([drawn[expert + "gate_proj.weight"], drawn[expert + "up_proj.weight"]])
    assert torch.equal(stack.weight[3], want.to(stack.weight.dtype))
    assert torch.isfinite(run_steps(r)).all()


def test_a_precision_the_generator_does_not_draw_is_a_clear_error(dirs, tmp_path):
    # NVFP4 attention: the generator draws attention in bf16.
    path = _write_config(dirs[1], tmp_path / "q", _quantization_config("nvfp4", list(ALWAYS_BF16)))
    with pytest.raises(ValueError, match=r"self_attn\.q_a_proj as nvfp4.*draws it as bf16"):
        runner(path, "random")
    with pytest.raises(ValueError, match="n_shared_experts = 0"):
        make_glm5_config_dir(str(tmp_path / "n"), 1, 1, overrides=TINY_OVERRIDES | {"n_shared_experts": 0})
    with pytest.raises(ValueError, match="load_format"):
        runner(dirs[1], "dummy")


def _tp_worker(rank, path, port, result_dir):
    import nsaserve.model.weight_source as ws

    drawn, read = [], []
    draw_expert, read_tensor = ws.GeneratedSource.draw_expert, ws.GeneratedSource.read

    def counting_draw(self, layer, expert):
        drawn.append((layer, expert))
        return draw_expert(self, layer, expert)

    def counting_read(self, name, shard):
        read.append(name)
        return read_tensor(self, name, shard)

    ws.GeneratedSource.draw_expert, ws.GeneratedSource.read = counting_draw, counting_read
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        logits = run_steps(runner(path, "random", torch.float32, tp_rank=rank, tp_size=2))
        torch.save({"logits": logits, "drawn": drawn, "read": read}, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_random_equals_tp1_and_each_rank_draws_only_its_experts(dirs, tmp_path):
    _, cfg_only = dirs
    mp.spawn(_tp_worker, args=(cfg_only, free_port(), str(tmp_path)), nprocs=2, join=True)
    single = run_steps(runner(cfg_only, "random", torch.float32))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert torch.equal(r0["logits"], r1["logits"]), "ranks must return identical logits"
    assert rel_err(r0["logits"], single) < 1e-5
    half = N_EXPERTS // 2
    assert r0["drawn"] == [(1, e) for e in range(half)]
    assert r1["drawn"] == [(1, e) for e in range(half, N_EXPERTS)]
    for rank, r in enumerate((r0, r1)):  # nothing read that the loader skips
        experts = {int(n.split(".")[5]) for n in r["read"] if ".experts." in n}
        assert experts == set(range(rank * half, (rank + 1) * half))
        assert not any(n.endswith("input_scale") for n in r["read"])
