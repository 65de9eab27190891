"""Dense (MHA-form) prompt attention (model/dense_prefill.py): where every context fits the top-k,
the same logits as the sparse absorbed path and as Hugging Face transformers' own model, for fresh
prompts, prompt chunks after cached prefixes and the decode steps after them (which stay sparse);
and the host-side choice of when to take it."""

import pytest
import torch
from model_helpers import VOCAB, Session, hf_prefill_logits, make_checkpoint, rel_err

from nsaserve.model import dense_prefill as dp
from nsaserve.model.dense_prefill import DENSE_MIN_QUERIES, dense_prefill_on, dense_requests
from nsaserve.model.runner import ModelRunner


def test_the_choice_is_per_request_within_the_top_k_with_enough_new_tokens():
    assert dense_requests([0, 500, 800], [500, 300], index_topk=2048) == [0, 1]  # fresh prompts
    assert dense_requests([0, 500, 800], [500, 3000], index_topk=2048) == [0]  # 1's context is past the top-k
    # 256 chunks of 33 tokens after ~1K cached: 33 new tokens < DENSE_MIN_QUERIES.
    qs = [33 * i for i in range(257)]
    assert dense_requests(qs, [1057] * 256, index_topk=2048) == [] and 33 < DENSE_MIN_QUERIES
    assert dense_requests([0, 1000], [2000], index_topk=2048) == [0]  # a long chunk after a cached half
    assert dense_requests([0, 1, 2], [1500, 1500], index_topk=2048) == []  # decode rows
    # A prompt beside decode rows: the prompt alone (the step splits between the two paths).
    assert dense_requests([0, 1, 1001, 1002], [1500, 1000, 900], index_topk=2048) == [1]
    assert dense_requests([0], [], index_topk=2048) == []


def test_the_switch_is_on_for_cuda_under_auto_and_reaches_every_worker():
    from nsaserve.cli import build_parser
    from nsaserve.serve import worker_command
    from nsaserve.worker.main import parse_args

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert dense_prefill_on("auto", cuda) and not dense_prefill_on("auto", cpu)
    assert dense_prefill_on("on", cpu) and not dense_prefill_on("off", cuda)
    with pytest.raises(ValueError, match="auto, on or off"):
        dense_prefill_on("yes", cuda)

    def worker_flag(*flags):
        args = build_parser().parse_args(["serve", "--model-path=m", "--tp=2", *flags])
        return {parse_args(worker_command(args, r, "/ipc", None, "m", "cuda")[3:]).dense_prefill for r in (0, 1)}

    assert worker_flag() == {"auto"}
    assert worker_flag("--dense-prefill=off") == {"off"}
    assert worker_flag("--dense-prefill=on") == {"on"}


def test_contexts_are_expanded_in_bounded_groups_of_consecutive_requests(monkeypatch):
    monkeypatch.setattr(dp, "GROUP_CONTEXT_TOKENS", 100)
    # (new tokens, context) per request: a request with nothing new splits the run of contexts.
    reqs = [(30, 40), (20, 50), (5, 30), (0, 10), (60, 60), (1, 150), (7, 20)]
    qs = [0]
    for q, _ in reqs:
        qs.append(qs[-1] + q)
    groups = dp._groups(qs, [n for _, n in reqs])
    assert [[(q1 - q0, n) for q0, q1, _, n in g] for g in groups] == [
        [(30, 40), (20, 50)], [(5, 30)], [(60, 60)], [(1, 150)], [(7, 20)]
    ]
    starts = [start for g in groups for _, _, start, _ in g]
    assert starts == [0, 40, 90, 130, 190, 340]


def runner(path: str, kv: str, dense: bool) -> ModelRunner:
    return ModelRunner(path, device=torch.device("cpu"), dtype=None, kv_cache_dtype=kv, num_pages=256, page_size=4,
                       show_progress=False, dense_prefill=dense)  # fmt: skip


def session_logits(r: ModelRunner) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Steps of prompts alone, and beside decode rows and short chunks, with contexts within the
    top-k (index_topk 256) and past it; then decode steps. The logits of every step and its
    requests (ids) that ran dense."""
    g = torch.Generator().manual_seed(11)
    a, b, more, c, d, e = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (90, 75, 180, 120, 20, 30))
    s = Session(r, seed=5)
    dense, out = [], []

    def step(work, all_logits=False):
        out.extend(s.step(work, all_logits=all_logits))
        plan = s.last_plan
        lens = (plan.cached_lens + (plan.query_start[1:] - plan.query_start[:-1])).tolist()
        chosen = dense_requests(plan.query_start.tolist(), lens, r.config.index_topk) if r.model.dense_prefill else []
        dense.append([int(plan.req_ids[i]) for i in chosen])

    step([(0, a), (1, b)], all_logits=True)  # two fresh prompts
    step([(0, more), (1, [7])], all_logits={0})  # a chunk of 180 after 90: its context is past the top-k
    step([(2, c), (1, [8])], all_logits={2})  # a prompt beside a decode
    step([(0, [1]), (3, e), (2, d), (1, [2])], all_logits={3, 2})  # chunks of 30 and 20: below the threshold
    step([(0, [5]), (3, c[:90])], all_logits={3})  # 90 new after 30 beside a decode past the top-k
    for t in range(3):
        step([(0, [3 + t]), (1, [9 + t]), (2, [t]), (3, [t + 1])])
    return out, dense


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_dense_prompts_match_the_sparse_path(model_type, kv, tmp_path):
    make_checkpoint(model_type, str(tmp_path), seed=8, index_topk=256, max_position_embeddings=512)
    want, _ = session_logits(runner(str(tmp_path), kv, dense=False))
    got, dense = session_logits(runner(str(tmp_path), kv, dense=True))
    # Prompt requests dense, alone or beside sparse rows; contexts past the top-k and short chunks not.
    assert dense == [[0, 1], [], [2], [], [3], [], [], []]
    # The two forms round differently (bf16-free here: a float32 model), and with the fp8 cache a
    # ~1e-6 difference can move a later token's latent across an e4m3 step.
    tol = 2e-5 if kv == "auto" else 2e-3
    for x, y in zip(got, want):
        assert rel_err(x, y) < tol


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_dense_prompt_matches_transformers(model_type, tmp_path):
    hf = make_checkpoint(model_type, str(tmp_path), seed=9, index_topk=256, max_position_embeddings=512)
    prompt = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    r = runner(str(tmp_path), "auto", dense=True)
    got = Session(r, seed=1).step([(0, prompt)], all_logits=True)[0]
    want = hf_prefill_logits(hf, prompt)
    assert rel_err(got, want) < 1e-4
