"""`nsaserve serve --indexer-backend` reaches every worker and picks the model's indexer kernels on
its own; under auto the indexer follows --attention-backend, as before the flag existed."""

from __future__ import annotations

import pytest

from nsaserve.cli import build_parser
from nsaserve.kernels.quant.make_glm5_shaped import TINY_OVERRIDES, make_glm5_config_dir
from nsaserve.kernels.registry import available
from nsaserve.serve import worker_command
from nsaserve.serve_args import INDEXER_BACKENDS
from nsaserve.worker.main import parse_args


def worker_args(serve_flags: list[str], model_path: str, rank: int = 0):
    args = build_parser().parse_args(["serve", f"--model-path={model_path}", "--tp=2", *serve_flags])
    return parse_args(worker_command(args, rank, "/ipc", None, model_path, "cpu")[3:])


def test_the_flag_lists_the_registrys_indexer_backends():
    names = set(available("indexer"))
    with_triton = any("triton" in n for n in names)  # registered only where Triton is installed
    assert names == {n for n in INDEXER_BACKENDS if with_triton or "triton" not in n}


def test_the_flag_travels_to_every_worker():
    assert worker_args([], "m").indexer_backend == "auto"
    got = [worker_args(["--indexer-backend", "triton_fp8q"], "m", r).indexer_backend for r in (0, 1)]
    assert got == ["triton_fp8q"] * 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--indexer-backend", "fast"])


@pytest.mark.parametrize("flags,want", [([], "torch"), (["--indexer-backend=torch_fp8q"], "torch_fp8q")])
def test_the_worker_sets_the_indexer_backend(tmp_path, flags, want):
    from nsaserve.worker.model_executor import ModelExecutor

    path = str(tmp_path / "cfg")
    make_glm5_config_dir(path, moe_layers=1, dense_layers=1, overrides=TINY_OVERRIDES)
    args = worker_args(["--load-format=random", "--max-total-tokens=256", "--page-size=16", *flags], path)
    args.tp_size = 1  # one process here: the flags as rank 0 of a TP=1 group
    backends = ModelExecutor.from_args(args).runner.model.backends
    assert backends["indexer"] == want
    assert backends["attention"] == "torch"  # on the CPU, auto is torch; the indexer flag leaves it
