"""The worker pipeline under data-parallel attention: each rank patches the inputs of its own
requests from rank 0's sampled tokens (InputPatch.for_requests), and the pipelined loop sends
exactly what the sequential loop sends, at N=2 over gloo on CPU (decode graphs under DP with
patches: tests/model/test_cuda_graphs_tp.py runs on GPUs)."""

import os

import numpy as np
import torch
from model_helpers import make_checkpoint
from test_tensor_parallel import TP_VOCAB, spawn_gloo
from test_worker_pipeline import pipelined, sequential

from nsaserve.model.runner import ModelRunner
from nsaserve.protocol.builder import RequestSpec, build_plan
from nsaserve.worker.batch import InputPatch
from nsaserve.worker.model_executor import ModelExecutor

N, P, PAGE = 2, 64, 4
RANK_OF = {1: 0, 2: 1, 3: 1, 4: 0}  # request -> the rank owning its pages


def dp_pages(i: int) -> list[int]:
    return [RANK_OF[i] * P + 8 * i + p for p in range(8)]


def test_a_patch_cut_to_some_requests_lands_at_their_positions():
    plan = build_plan(1, PAGE, [RequestSpec(1, [7, 7, 7], 0, [0, 1]), RequestSpec(2, [-1], 5, [2, 3]),
                                RequestSpec(3, [8, 8], 0, [4]), RequestSpec(4, [-1], 6, [5, 6])])  # fmt: skip
    patch = InputPatch(np.array([3, 6]), torch.tensor([21, 41]))  # requests 2 and 4's single tokens
    keep = np.array([False, True, True, True])
    cut = patch.for_requests(plan, keep)  # the sub-plan: [request 2's 1 token, request 3's 2, request 4's 1]
    assert cut.token_index.tolist() == [0, 3] and cut.tokens.tolist() == [21, 41]
    assert patch.for_requests(plan, np.array([True, False, True, False])) is None
    ids = torch.tensor([-1, 8, 8, -1])
    cut.apply(ids)
    assert ids.tolist() == [21, 8, 8, 41]


def _worker(rank, path, result_dir):
    runner = ModelRunner(path, device=torch.device("cpu"), dtype=torch.float32, kv_cache_dtype="auto", num_pages=P,
                         page_size=PAGE, show_progress=False, tp_rank=rank, tp_size=N, dp_attention=True)  # fmt: skip
    executor = ModelExecutor(runner, runner.device)
    want = sequential(executor, rank == 0, dp_pages)
    # Every plan waiting from the start and every launch taken ahead: the patches are used.
    got, calls = pipelined(executor, True, is_rank0=rank == 0, pages=dp_pages)
    torch.save((want, got, calls), os.path.join(result_dir, f"rank{rank}.pt"))


def test_pipelined_dp_attention_sends_what_the_sequential_loop_sends(tmp_path):
    path = str(tmp_path / "m")
    make_checkpoint("glm_moe_dsa", path, seed=3, vocab_size=TP_VOCAB, confident_embedding=4.0)
    spawn_gloo(_worker, N, path, str(tmp_path))
    want, got, calls = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert any(err for _, _, err in want), "the bad reference must fail its request"
    assert sum(len(toks) for _, toks, _ in want) > 10
    assert got == want
    assert calls[:4] == [("launch", 1), ("launch", 2), ("finish", 1), ("launch", 3)]
    assert torch.load(tmp_path / "rank1.pt", weights_only=False)[1] == []  # rank 1 sends nothing
