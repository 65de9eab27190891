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


@pytest.mark.parametrize("model_type,kv,dtype", CASES)
def test_triton_backends_match_torch(model_type, kv, dtype, tmp_path):
    make_checkpoint(model_type, str(tmp_path), seed=3, initializer_range=0.06, confident_embedding=0.12)
    want_logits, want_tokens = run(runner(str(tmp_path), kv, "torch", dtype))
    got_logits, got_tokens = run(runner(str(tmp_path), kv, "triton", dtype), forced=want_tokens)
    assert torch.isfinite(got_logits).all()
    # The indexer's products are float32-exact, so both pick the same keys; sparse attention
    # rounds q, the latent and the probabilities to bf16 for the tensor cores.
    # Per row; a few rows may differ by more where the rounding flips a routed expert (the MoE
    # gate's top-k is discontinuous), so the bound is on nearly every row, not all.
    row_err = (got_logits - want_logits).abs().amax(1) / want_logits.abs().amax(1)
    assert float((row_err < 3e-2).float().mean()) >= 0.9, row_err
    assert float(row_err.median()) < 1e-2
    agree = sum(a == b for p, q in zip(got_tokens, want_tokens) for a, b in zip(p, q)) / (2 * STEPS)
    assert agree >= 0.9, (got_tokens, want_tokens)


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
