"""Decode CUDA graphs under tensor parallelism (worker/cuda_graphs.py), two ranks.

On CPU (gloo): graphs stay off and say why (only NCCL collectives are captured), and the graphs'
static batch, run eagerly on each rank, gives the logits of the plan's own batch, identical on
both ranks and equal to one rank alone. On two or more GPUs (NCCL): the captured graphs, with the
all-reduces and the logits all-gather inside, replay to the eager logits on both ranks.
"""

import datetime
import faulthandler
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from graph_helpers import compare_graph_to_eager, graph_runner
from model_helpers import make_checkpoint, rel_err
from test_tensor_parallel import free_port

from nsaserve.worker.cuda_graphs import DecodeGraphs, graph_blockers

GRAPH_SAFE = {"moe_experts": "torch_dense"}
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
STEPS, SEED = 6, 11


def _rank(rank, path, port, out_dir, cuda, dp):
    # A rank stuck in a collective (its peer failed) prints where it is and exits, so the test
    # fails with the reason instead of hanging.
    faulthandler.dump_traceback_later(float(os.environ.get("NSASERVE_TEST_HANG_S", "120")), exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=2, timeout=timeout)
    try:
        r = graph_runner(path, f"cuda:{rank}" if cuda else "cpu", backends=GRAPH_SAFE, tp_rank=rank, tp_size=2,
                         dp_attention=dp)  # fmt: skip
        reasons = " ".join(graph_blockers(r))
        assert reasons == "" if cuda else "only NCCL collectives are captured" in reasons, reasons
        print(f"rank {rank}: model loaded, capturing", flush=True)
        graphs = DecodeGraphs(r, max_bs=8, log=lambda m: None)
        print(f"rank {rank}: captured {sum(g.graph is not None for g in graphs.graphs.values())} graphs", flush=True)
        logits = compare_graph_to_eager(r, graphs, steps=STEPS, exact=True, seed=SEED, dp_size=2 if dp else 1)
        assert graphs.replays == (2 * STEPS if cuda else 0)  # each step as planned, then with patched tokens
        torch.save(logits, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        import traceback

        traceback.print_exc()  # before a peer waiting in a collective is torn down
        raise
    finally:
        # NCCL: no destroy_process_group. Tearing the communicator down while captured graphs
        # still reference it hangs (seen on two H200s after every check had passed); the process
        # exit releases it.
        if not cuda:
            dist.destroy_process_group()


@pytest.mark.parametrize("dp", [False, True], ids=["tp", "dp-attention"])
@pytest.mark.parametrize(
    "cuda", [False, pytest.param(True, marks=pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs"))]
)
def test_tp2_decode_graphs(cuda, dp, tmp_path):
    """dp: data-parallel attention, the requests alternating between the ranks: each rank's graph
    runs its own requests padded to the bucket, the logits come back in plan order."""
    path = str(tmp_path / "model")
    # vocab 97: not divisible by 2, so the all-gathered lm_head shards are padded and trimmed.
    make_checkpoint("glm_moe_dsa", path, seed=2, vocab_size=97, initializer_range=0.06, confident_embedding=0.12)
    mp.spawn(_rank, args=(path, free_port(), str(tmp_path), cuda, dp), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert torch.equal(r0, r1), "ranks must return identical logits"
    one = graph_runner(path, "cpu", backends=GRAPH_SAFE)
    alone = compare_graph_to_eager(
        one, DecodeGraphs(one, max_bs=8, log=lambda m: None), steps=STEPS, exact=True, seed=SEED
    )
    assert r0.shape == alone.shape
    assert rel_err(r0, alone) < (1e-4 if cuda else 1e-5)
