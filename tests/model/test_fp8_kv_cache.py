"""FP8 KV cache (e4m3 latent with per-group scales + bf16 rope part; Hadamard-rotated e4m3 indexer
keys with one scale per key) against the bf16 cache of the same bf16 model: >= 95% of greedy
tokens agree.

Tokens are compared under teacher forcing (both caches are fed the bf16 run's tokens), so one
early difference does not make every later step differ.
"""

import pytest
import torch
from model_helpers import VOCAB, Session, make_checkpoint

from nsaserve.model.runner import ModelRunner

STEPS = 32
PROMPT_LENS = (12, 20, 9, 16, 14, 10, 18, 11)


def greedy_batch(runner, prompts, forced=None):
    """Greedy decode of all prompts together. With `forced` (token lists), those tokens are fed
    instead of our own argmax (teacher forcing). Returns the argmax tokens of every step."""
    session = Session(runner, seed=21)
    logits = session.step(list(enumerate(prompts)))
    chosen = [[] for _ in prompts]
    for step in range(STEPS):
        for i, lg in enumerate(logits):
            chosen[i].append(int(lg.argmax()))
        feed = [forced[i][step] if forced else chosen[i][-1] for i in range(len(prompts))]
        logits = session.step([(i, [t]) for i, t in enumerate(feed)])
    return chosen


def agreement(a, b) -> float:
    return sum(x == y for p, q in zip(a, b) for x, y in zip(p, q)) / sum(len(p) for p in a)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_fp8_kv_agrees_with_bf16(model_type, tmp_path):
    make_checkpoint(model_type, str(tmp_path), seed=3, initializer_range=0.06, confident_embedding=0.12)

    def runner(kv):
        return ModelRunner(
            str(tmp_path), device=torch.device("cpu"), dtype=torch.bfloat16, kv_cache_dtype=kv,
            num_pages=160, page_size=4, show_progress=False,
        )  # fmt: skip

    bf16, fp8 = runner("auto"), runner("fp8_e4m3")
    assert bf16.pool.latent[0].dtype == torch.bfloat16
    assert fp8.pool.latent[0].dtype == torch.uint8 and fp8.pool.index_k[0].dtype == torch.uint8
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    ref = greedy_batch(bf16, prompts)
    assert agreement(ref, greedy_batch(fp8, prompts, forced=ref)) >= 0.95

    # The harness can tell: a different top-k (2 instead of 8) changes well over 5% of tokens.
    for layer in bf16.model.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = 2
    assert agreement(ref, greedy_batch(bf16, prompts, forced=ref)) < 0.9
