"""The model's MoE router through the "bf16x3" logits backend (kernels/router_logits.py) routes as
through the float32 reference: a bf16 GLM-5 and DeepSeek-V3.2 give the same logits either way."""

import pytest
import torch
from model_helpers import make_checkpoint, prompts_then_decodes, rel_err

from nsaserve.model.runner import ModelRunner


def run(runner) -> torch.Tensor:
    return prompts_then_decodes(runner, (13, 6), decodes=3, seed=5, offset=3)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_bf16x3_router_logits_match_float32(model_type, tmp_path):
    make_checkpoint(model_type, str(tmp_path), seed=4)
    outs = {}
    for name in ("torch", "bf16x3"):
        r = ModelRunner(str(tmp_path), device=torch.device("cpu"), dtype=torch.bfloat16, num_pages=32, page_size=4,
                        show_progress=False)  # fmt: skip
        r.set_backend("router_logits", name)
        gates = [layer.mlp.gate for layer in r.model.model.layers if hasattr(layer.mlp, "gate")]
        assert gates and all((g._split is not None) == (name == "bf16x3") for g in gates)  # split at load
        outs[name] = run(r)
    assert rel_err(outs["bf16x3"], outs["torch"]) < 1e-3
