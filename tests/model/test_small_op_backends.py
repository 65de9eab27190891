"""The model with the Triton small ops (RMSNorm + residual, RoPE, KV and index-key stores) gives
the logits of the torch references: float32 and an FP8 bf16 cache, both RoPE layouts of the indexer
(GLM-5 interleaved, DeepSeek-V3.2 half-split). Triton's CPU interpreter without a GPU."""

import os

import pytest
import torch
from model_helpers import make_checkpoint, prompts_then_decodes, rel_err

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from nsaserve.model.runner import ModelRunner  # noqa: E402

SMALL_OPS = ("rmsnorm", "rope", "kv_store", "index_key_store")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def run(runner) -> torch.Tensor:
    return prompts_then_decodes(runner, (13, 6), decodes=4, seed=5, offset=3)


@pytest.mark.parametrize(
    "model_type,dtype,kv", [("glm_moe_dsa", torch.float32, "auto"), ("deepseek_v32", torch.bfloat16, "fp8_e4m3")]
)
def test_triton_small_ops_match_torch(model_type, dtype, kv, tmp_path):
    make_checkpoint(model_type, str(tmp_path), seed=4, initializer_range=0.06, confident_embedding=0.12)

    def runner(backend):
        r = ModelRunner(
            str(tmp_path), device=torch.device(DEV), dtype=dtype, kv_cache_dtype=kv, num_pages=32, page_size=4,
            show_progress=False,
        )  # fmt: skip
        for kind in SMALL_OPS:
            r.set_backend(kind, backend)
        return r

    want, got = run(runner("torch")), run(runner("triton"))
    # float32: summation order only; bf16: a few last-bit differences in norms and RoPE propagate.
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 3e-2)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
