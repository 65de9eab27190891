"""A batch mixing a prefix continuation (cached_len > 0), fresh prefills and a decode equals
running each request alone, and equals transformers on the whole sequence."""

import pytest
import torch
from model_helpers import VOCAB, Session, hf_prefill_logits, make_checkpoint, rel_err

from nsaserve.model.runner import ModelRunner


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_mixed_batch_equals_requests_alone(model_type, tmp_path):
    hf = make_checkpoint(model_type, str(tmp_path), seed=1)
    runner = ModelRunner(
        str(tmp_path), device=torch.device("cpu"), dtype=None, num_pages=64, page_size=4, show_progress=False
    )
    g = torch.Generator().manual_seed(5)
    seqs = {rid: torch.randint(0, VOCAB, (n,), generator=g).tolist() for rid, n in [(0, 30), (1, 17), (2, 11), (3, 21)]}
    # Before the mixed step: request 0 has 18 tokens cached (its prefix), request 3 has 20.
    cached = {0: 18, 3: 20}

    def run(session, rids, all_logits=True):
        return dict(zip(rids, session.step([(r, seqs[r][cached.get(r, 0) :]) for r in rids], all_logits)))

    def warm(session, rids):
        session.step([(r, seqs[r][: cached[r]]) for r in rids])

    mixed = Session(runner, seed=11)
    warm(mixed, [0, 3])
    # 0: prefill continuation (12 new tokens on 18 cached), 1 and 2: fresh, 3: one-token decode.
    together = run(mixed, [0, 1, 2, 3])
    assert mixed.last_plan.mode == "mixed"
    assert list(mixed.last_plan.cached_lens) == [18, 0, 0, 20]

    for rid in seqs:
        alone = Session(runner, seed=100 + rid)
        if rid in cached:
            warm(alone, [rid])
        solo = run(alone, [rid])[rid]
        assert rel_err(together[rid], solo) < 1e-5, f"request {rid}"
        ref = hf_prefill_logits(hf, seqs[rid])[cached.get(rid, 0) :]
        assert rel_err(together[rid], ref) < 1e-4, f"request {rid} vs transformers"
