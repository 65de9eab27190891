"""`nsaserve serve --load-format` reaches every worker, and a worker started with `random` serves a
config-only model directory (config and tokenizer, no tensors) with the generator's weights."""

from __future__ import annotations

import os

import torch

from nsaserve.cli import build_parser
from nsaserve.kernels.quant.make_glm5_shaped import TINY_OVERRIDES, make_glm5_config_dir, make_glm5_shaped
from nsaserve.serve import worker_command
from nsaserve.worker.main import parse_args


def worker_args(serve_flags: list[str], model_path: str, rank: int = 0):
    args = build_parser().parse_args(["serve", f"--model-path={model_path}", "--tp=2", *serve_flags])
    cmd = worker_command(args, rank, "/ipc", None, model_path, "cpu")
    assert cmd[1:3] == ["-m", "nsaserve.worker.main"]
    return parse_args(cmd[3:])


def test_the_flag_travels_to_every_worker_and_defaults_to_safetensors():
    assert worker_args([], "m").load_format == "safetensors"
    assert [worker_args(["--load-format", "random"], "m", rank).load_format for rank in (0, 1)] == ["random"] * 2


def test_a_random_worker_serves_a_config_only_directory(tmp_path):
    from nsaserve.worker.model_executor import ModelExecutor

    cfg_only, ckpt = str(tmp_path / "cfg"), str(tmp_path / "ckpt")
    make_glm5_config_dir(cfg_only, moe_layers=1, dense_layers=1, overrides=TINY_OVERRIDES)
    make_glm5_shaped(ckpt, moe_layers=1, dense_layers=1, overrides=TINY_OVERRIDES)
    assert not any(n.endswith(".safetensors") for n in os.listdir(cfg_only))
    args = worker_args(["--load-format=random", "--max-total-tokens=256", "--page-size=16"], cfg_only)
    args.tp_size = 1  # one process here: the flags as rank 0 of a TP=1 group
    random_weights = ModelExecutor.from_args(args).runner.model.state_dict()
    args.model_path, args.load_format = ckpt, "safetensors"
    written = ModelExecutor.from_args(args).runner.model.state_dict()
    assert all(torch.equal(random_weights[k], written[k]) for k in written)


def test_cuda_graph_batch_sizes_travel_to_every_worker():
    assert worker_args([], "m").cuda_graph_bs is None
    got = [worker_args(["--cuda-graph-bs", "1", "8", "64", "512"], "m", r).cuda_graph_bs for r in (0, 1)]
    assert got == [[1, 8, 64, 512]] * 2
