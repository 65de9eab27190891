"""TP=2 (two processes, gloo) gives the same logits as TP=1, on every rank.

The tiny models split 4 MLA heads 2/2, 8 routed experts 4/4, the MLP intermediate dims in half,
and a vocabulary of 97 (not divisible by 2: the lm_head shards are padded and trimmed).
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model_helpers import VOCAB, Session, make_checkpoint, rel_err

from nsaserve.model.runner import ModelRunner

MODEL_TYPES = ["glm_moe_dsa", "deepseek_v32"]
TP_VOCAB = 97


def run_steps(path, **tp) -> torch.Tensor:
    """A prefill of two requests, then 6 batched decode steps (fixed tokens); all logits stacked."""
    runner = ModelRunner(
        path, device=torch.device("cpu"), dtype=None, num_pages=32, page_size=4, show_progress=False, **tp
    )
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (19, 13))
    session = Session(runner, seed=4)
    out = [torch.cat(session.step([(0, a), (1, b)], all_logits=True))]
    for i in range(6):
        out.append(torch.stack(session.step([(0, [(7 * i) % VOCAB]), (1, [(5 * i + 3) % VOCAB])])))
    return torch.cat(out)


def _worker(rank, paths, result_dir):
    for i, path in enumerate(paths):
        torch.save(run_steps(path, tp_rank=rank, tp_size=2), os.path.join(result_dir, f"{i}-rank{rank}.pt"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_gloo_group(rank, fn, size, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn, size: int, *args) -> None:
    """fn(rank, *args) in `size` processes of one gloo group (one CPU thread each); fn must be a
    module-level function (it is pickled into the processes)."""
    mp.spawn(_in_gloo_group, args=(fn, size, free_port(), args), nprocs=size, join=True)


def test_tp2_equals_tp1(tmp_path):
    paths = [str(tmp_path / t) for t in MODEL_TYPES]
    for t, path in zip(MODEL_TYPES, paths):
        make_checkpoint(t, path, seed=2, vocab_size=TP_VOCAB)
    spawn_gloo(_worker, 2, paths, str(tmp_path))
    for i, path in enumerate(paths):
        single = run_steps(path)
        r0, r1 = (torch.load(tmp_path / f"{i}-rank{r}.pt") for r in (0, 1))
        assert r0.shape == single.shape == (32 + 12, TP_VOCAB)
        assert torch.equal(r0, r1), f"{MODEL_TYPES[i]}: ranks must return identical logits"
        assert rel_err(r0, single) < 1e-5, MODEL_TYPES[i]
