"""Eight ranks (eight processes, gloo), the tiny GLM-5: tensor parallel attention and data-parallel
attention both give the logits of TP=1, identical on every rank.

The layout of the eight-GPU run at a size CPUs can run: 8 MLA heads split 1 per rank, 8 routed
experts 1 per rank, the MLP and shared-expert intermediate dims in eighths, a vocabulary of 97
(lm_head shards padded). Under data-parallel attention each rank keeps its own pool of P pages and
runs attention for its own requests; steps leave some ranks without requests, and one rank holds
two of them.
"""

import os

import torch
from model_helpers import Session, make_checkpoint, rel_err
from test_tensor_parallel import TP_VOCAB, run_steps, spawn_gloo

from nsaserve.model.runner import ModelRunner

N, P, PAGE = 8, 12, 4


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, TP_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class PoolsOf:
    """One TP=1 runner holding all N pools' pages, in front of which a Session lays out pages as for
    N data-parallel ranks of P pages each (the plans' page ids are global either way)."""

    def __init__(self, runner):
        self.runner, self.page_size, self.num_pages = runner, runner.page_size, P

    def forward_plan(self, plan):
        return self.runner.forward_plan(plan)


def dp_scenario(runner) -> torch.Tensor:
    """Prefill on ranks 0, 2, 3, 5 and 7 (7 holds two requests), decodes of changing subsets (ranks
    1, 4 and 6 never have a request; some steps leave others empty too); all logit rows stacked."""
    s = Session(runner, seed=5, dp_size=N)
    ranks = {0: 0, 1: 2, 2: 3, 3: 5, 4: 7, 5: 7}
    out = [torch.cat(s.step([(r, tokens(r, 5 + 2 * r)) for r in ranks], all_logits=True, ranks=ranks))]
    for i, subset in enumerate(([0, 1, 2, 3, 4, 5], [5, 2], [4], [1, 0, 3, 5], [0, 1, 2, 3, 4, 5])):
        out.append(torch.stack(s.step([(r, [(3 * i + r) % TP_VOCAB]) for r in subset])))
    return torch.cat(out)


def _worker(rank, path, result_dir):
    tp = run_steps(path, tp_rank=rank, tp_size=N)
    runner = ModelRunner(path, device=torch.device("cpu"), dtype=None, num_pages=P, page_size=PAGE,
                         show_progress=False, tp_rank=rank, tp_size=N, dp_attention=True)  # fmt: skip
    torch.save((tp, dp_scenario(runner)), os.path.join(result_dir, f"rank{rank}.pt"))


def test_tp8_and_dp_attention_8_equal_tp1(tmp_path):
    path = str(tmp_path / "m")
    make_checkpoint("glm_moe_dsa", path, seed=2, vocab_size=TP_VOCAB, num_attention_heads=8)
    spawn_gloo(_worker, N, path, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(N)]
    want_tp = run_steps(path)
    one = ModelRunner(path, device=torch.device("cpu"), dtype=None, num_pages=N * P, page_size=PAGE, show_progress=False)
    want_dp = dp_scenario(PoolsOf(one))
    for k, want in enumerate((want_tp, want_dp)):
        assert got[0][k].shape == want.shape
        for r in range(1, N):
            assert torch.equal(got[r][k], got[0][k]), f"{('TP', 'DP attention')[k]}: rank {r} differs from rank 0"
        assert rel_err(got[0][k], want) < 1e-5, ("TP", "DP attention")[k]
