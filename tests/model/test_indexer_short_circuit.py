"""A step whose every context fits the indexer's top-k selects whole causal contexts without
scoring them (model/attention.py, Indexer.forward): the same logits as the scoring path, which
then picks every key anyway, and no query or weight projection runs. Checked with the top-k
raised above the contexts, then with a context past it (the scoring path runs again)."""

import pytest
import torch
from model_helpers import VOCAB, Session, make_checkpoint

from nsaserve.model.attention import Indexer
from nsaserve.model.runner import ModelRunner


def run(path: str, kv: str, prompt_lens: tuple[int, ...], decode_steps: int):
    """Logits of a prompt step and greedy decode steps, and how often weights_proj ran."""
    runner = ModelRunner(path, device=torch.device("cpu"), dtype=None, kv_cache_dtype=kv, num_pages=64, page_size=4,
                         show_progress=False)  # fmt: skip
    calls = [0]
    for layer in runner.model.model.layers:
        idx = layer.self_attn.indexer
        if idx is not None:
            idx.weights_proj.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
    s = Session(runner, seed=2)
    out = s.step(list(enumerate(prompts)), all_logits=True)
    last = [lg[-1] for lg in out]
    for _ in range(decode_steps):
        last = s.step([(i, [int(lg.argmax())]) for i, lg in enumerate(last)])
        out += last
    return out, calls[0]


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_whole_contexts_match_the_scoring_path(model_type, kv, tmp_path, monkeypatch):
    make_checkpoint(model_type, str(tmp_path), seed=5, index_topk=40)
    got, calls = run(str(tmp_path), kv, (23, 9), decode_steps=4)  # contexts up to 27 <= 40
    assert calls == 0
    monkeypatch.setattr(Indexer, "skip_scoring_when_all_fit", False)
    want, calls = run(str(tmp_path), kv, (23, 9), decode_steps=4)
    assert calls > 0
    # The two paths visit the same keys in other orders (sums differ by ~1e-6). With the fp8 cache
    # such a difference can move a new token's latent across an e4m3 rounding step (~6%), so
    # later logits may differ by ~1e-4; a different key set moves them by ~0.1 and more.
    tol = 1e-5 if kv == "auto" else 1e-3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_a_context_past_the_top_k_scores_the_step(tmp_path):
    make_checkpoint("glm_moe_dsa", str(tmp_path), seed=6, index_topk=16)
    _, calls = run(str(tmp_path), "auto", (20, 5), decode_steps=1)
    assert calls == 2 * 2  # both steps score (one request is past 16), in both full indexer layers


def test_whole_context_slots_are_built_once_a_step(tmp_path, monkeypatch):
    """Every indexer layer of a step selects the same whole contexts: the first builds their
    slots (StepMeta.whole_slots), the others read them."""
    import nsaserve.model.attention as attention

    built = [0]
    real = attention.topk_to_slots

    def counting(*args):
        built[0] += 1
        return real(*args)

    monkeypatch.setattr(attention, "topk_to_slots", counting)
    make_checkpoint("glm_moe_dsa", str(tmp_path), seed=5, index_topk=40)
    runner = ModelRunner(str(tmp_path), device=torch.device("cpu"), dtype=None, num_pages=64, page_size=4,
                         show_progress=False)  # fmt: skip
    layers = sum(layer.self_attn.indexer is not None for layer in runner.model.model.layers)
    assert layers >= 2
    s = Session(runner, seed=2)
    last = s.step([(0, list(range(1, 12))), (1, [5, 6, 7])])
    assert built[0] == 1
    s.step([(i, [int(lg.argmax())]) for i, lg in enumerate(last)])
    assert built[0] == 2  # one more step, one more build
