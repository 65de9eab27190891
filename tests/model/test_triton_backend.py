"""The tiny models with the Triton attention and indexer backends against the torch backends on the
same device: same logits (within the kernels' bf16 operand rounding) and the same greedy tokens.

On CUDA the kernels run compiled; without CUDA they run in Triton's CPU interpreter (set by
tests/conftest.py), at the tiny shapes this takes seconds. Skipped where Triton is not installed.
"""

import pytest
import torch
from model_helpers import VOCAB, Session, make_checkpoint

from nsaserve.model.runner import ModelRunner

pytest.importorskip("triton")

GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if GPU else "cpu")
STEPS = 10 if GPU else 5


def runner(path, kv, backend, dtype=torch.float32):
    r = ModelRunner(path, device=DEV, dtype=dtype, kv_cache_dtype=kv, num_pages=96, page_size=4, show_progress=False)
    for kind in ("attention", "indexer"):
        r.set_backend(kind, backend)
    return r


def run(r, forced=None):
    """Two prompts (one longer than index_topk, so the indexer really selects), then greedy decode
    of both; with `forced`, those tokens are fed instead (teacher forcing). -> (logits of every
    step, argmax tokens)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (29, 6)]
    session = Session(r, seed=4)
    logits = [torch.cat(session.step(list(enumerate(prompts)), all_logits=True)).cpu()]
    tokens = []
    last = [logits[0][len(prompts[0]) - 1], logits[0][-1]]
    for step in range(STEPS):
        chosen = [int(lg.argmax()) for lg in last]
        tokens.append(chosen)
        feed = forced[step] if forced else chosen
        last = session.step([(i, [t]) for i, t in enumerate(feed)])
        logits.append(torch.stack(last).cpu())
    return torch.cat(logits), tokens


# The interpreter is slow: on CPU one case (the fp8 cache, where both kernels dequantise). On CUDA
# also a bf16 model, the dtype "auto" picks Triton for.
CASES = (
    [(m, kv, torch.float32) for m in ("glm_moe_dsa", "deepseek_v32") for kv in ("auto", "fp8_e4m3")]
    + [("glm_moe_dsa", "fp8_e4m3", torch.bfloat16)]
    if GPU
    else [("glm_moe_dsa", "fp8_e4m3", torch.float32)]
)


# Checkpoint seeds. The bounds below are on rows pooled over them: a routed expert that flips (the
# MoE gate's top-k is discontinuous) changes that token's KV entries, so every later row of that
# sequence differs by more, and how many rows that touches depends on the seed, not on the
# kernels. Measured on the H200 over seeds 3-7 with both FP8 scale formats (power-of-two, and
# amax / 448 before it): the fraction of rows within 3e-2 ranged 0.75-1.0 per seed in both, so a
# single seed's 0.9 failed 5 of 15 (seed, case) pairs with either.
SEEDS = (3, 4, 5) if GPU else (3,)


@pytest.mark.parametrize("model_type,kv,dtype", CASES)
def test_triton_backends_match_torch(model_type, kv, dtype, tmp_path):
    errs, agree = [], 0
    for seed in SEEDS:
        path = str(tmp_path / str(seed))
        make_checkpoint(model_type, path, seed=seed, initializer_range=0.06, confident_embedding=0.12)
        want_logits, want_tokens = run(runner(path, kv, "torch", dtype))
        got_logits, got_tokens = run(runner(path, kv, "triton", dtype), forced=want_tokens)
        assert torch.isfinite(got_logits).all()
        errs.append((got_logits - want_logits).abs().amax(1) / want_logits.abs().amax(1))
        agree += sum(a == b for p, q in zip(got_tokens, want_tokens) for a, b in zip(p, q))
    # The indexer's products are float32-exact, so both pick the same keys; sparse attention
    # rounds q and the probabilities (and the latent, for a bf16 cache) to bf16 for the tensor
    # cores. Per row; rows after an expert flip differ by more, so the bound is on most rows.
    row_err = torch.cat(errs)
    assert float((row_err < 3e-2).float().mean()) >= 0.85, errs
    # A bf16 model rounds its activations to bf16 between layers: row errors of ~1e-2 are its own.
    assert float(row_err.median()) < (1e-2 if dtype == torch.float32 else 1.5e-2), errs
    assert agree / (2 * STEPS * len(SEEDS)) >= 0.9, agree


def test_auto_backend_choice(tmp_path):
    from nsaserve.kernels.registry import resolve

    for kind in ("attention", "indexer"):
        assert resolve(kind, "auto", "cuda", 16) == "triton"
        assert resolve(kind, "auto", "cuda", 32) == "torch"  # float32 models keep float32 operands
        assert resolve(kind, "auto", "cpu", 16) == "torch"
        assert resolve(kind, "torch", "cuda") == "torch" and resolve(kind, "triton", "cpu") == "triton"
    assert resolve("moe_experts", "auto", "cpu") == "torch"
    make_checkpoint("glm_moe_dsa", str(tmp_path), seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        r = ModelRunner(str(tmp_path), device=DEV, dtype=dtype, num_pages=8, page_size=4, show_progress=False)
        r.set_backend("attention", "auto")
        assert r.model.backends["attention"] == ("triton" if GPU and dtype == torch.bfloat16 else "torch")
