"""Oracle: nsaserve's model against transformers' own, on tiny random checkpoints of both types.

Prefill logits of every position, and 32 greedy decode steps through a paged cache whose pages
are handed out scrambled, must match transformers (float32, relative error <= 1e-4). The context
(20 + 32 tokens) is far above index_topk (8), so sparse top-k selection happens in every step.
"""

import pytest
import torch
from model_helpers import VOCAB, Session, hf_greedy, hf_prefill_logits, make_checkpoint, rel_err

from nsaserve.model.runner import ModelRunner

MODEL_TYPES = ["glm_moe_dsa", "deepseek_v32"]
TOL = 1e-4


@pytest.fixture(scope="module", params=MODEL_TYPES)
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_checkpoint(request.param, path)
    runner = ModelRunner(path, device=torch.device("cpu"), dtype=None, num_pages=40, page_size=4, show_progress=False)
    return hf, runner


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def test_runner_attributes(pair):
    hf, runner = pair
    assert runner.vocab_size == VOCAB
    assert runner.num_pages == 40 and runner.page_size == 4
    assert runner.max_context == hf.config.max_position_embeddings
    assert runner.config.index_topk < 20


def test_prefill_matches_transformers(pair):
    hf, runner = pair
    tokens = prompt(1, 20)
    ours = Session(runner).step([(0, tokens)], all_logits=True)[0]
    assert ours.shape == (20, VOCAB) and ours.dtype == torch.float32
    assert rel_err(ours, hf_prefill_logits(hf, tokens)) < TOL


def test_greedy_decode_through_scrambled_pages(pair):
    hf, runner = pair
    tokens = prompt(2, 20)
    ref_tokens, ref_logits = hf_greedy(hf, tokens, 32)
    session = Session(runner, seed=7)
    logits = session.step([(0, tokens)])[0]
    pages = session.reqs[0].pages
    assert pages != sorted(pages), "pages should be scattered"
    ours_tokens = []
    for step, tok in enumerate([None] + ref_tokens):
        if tok is not None:
            logits = session.step([(0, [tok])])[0]
        assert rel_err(logits, ref_logits[step]) < TOL, f"step {step}"
        ours_tokens.append(int(logits.argmax()))
    assert ours_tokens[:-1] == ref_tokens


def test_sparse_selection_is_exercised(pair):
    """The same model forced dense (top-k over everything) must NOT match transformers, otherwise
    these tests would not be checking the top-k at all."""
    hf, runner = pair
    tokens = prompt(3, 40)
    ref = hf_prefill_logits(hf, tokens)
    layers = [layer.self_attn.indexer for layer in runner.model.model.layers if layer.self_attn.indexer]
    saved = [ix.topk for ix in layers]
    try:
        for ix in layers:
            ix.topk = 10**6
        dense = Session(runner).step([(0, tokens)], all_logits=True)[0]
    finally:
        for ix, k in zip(layers, saved):
            ix.topk = k
    sparse = Session(runner).step([(0, tokens)], all_logits=True)[0]
    assert rel_err(sparse, ref) < TOL
    assert rel_err(dense[:8], ref[:8]) < TOL  # contexts <= index_topk are dense anyway
    assert rel_err(dense, ref) > 1e-2
