"""On a CUDA machine: the same tiny models on the GPU match the CPU reference, and the KV pool is
sized from free memory when num_pages is not given. Skipped without a GPU."""

import pytest
import torch
from model_helpers import make_checkpoint, prompts_then_decodes, rel_err

from nsaserve.model.kv_pool import bytes_per_slot
from nsaserve.model.runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run(runner) -> torch.Tensor:
    return prompts_then_decodes(runner, (37, 11), decodes=12, seed=2, offset=7)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_cuda_matches_cpu(model_type, tmp_path):
    make_checkpoint(model_type, str(tmp_path), seed=3, initializer_range=0.06, confident_embedding=0.12)
    cpu = run(ModelRunner(str(tmp_path), device="cpu", dtype=torch.float32, num_pages=64, page_size=4))
    cuda = torch.device("cuda")
    f32 = ModelRunner(str(tmp_path), device=cuda, dtype=torch.float32, num_pages=64, page_size=4)
    assert rel_err(run(f32), cpu) < 1e-3
    del f32
    for kv in ("auto", "fp8_e4m3"):
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # A fraction that leaves about 1 GiB for the KV pool after these (tiny) weights.
        frac = 1 - (free - 2**30) / total
        bf16 = ModelRunner(
            str(tmp_path), device=cuda, dtype=torch.bfloat16, kv_cache_dtype=kv, num_pages=None, page_size=4,
            mem_fraction_static=frac,
        )  # fmt: skip
        pool_bytes = bytes_per_slot(bf16.config, kv, torch.bfloat16) * 4 * bf16.num_pages
        assert 0.9 * 2**30 < pool_bytes <= 2**30
        out = run(bf16)
        assert (out.argmax(-1) == cpu.argmax(-1)).float().mean() >= 0.95, kv
        del bf16
