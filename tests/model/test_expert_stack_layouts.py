"""An NVFP4 expert stack put in a kernel layout in place (re-laid out, or re-laid out and tiled)
dequantises to exactly the weights it held in the checkpoint layout; the tiled layout is refused
for sizes that are not whole tiles, and the MoE backend then falls back to the re-laid-out one."""

import pytest
import torch

from nsaserve.kernels.quant.nvfp4 import quantize_nvfp4
from nsaserve.model.expert_stack import CHECKPOINT, RELAYOUT, TILED, ExpertStack

pytest.importorskip("triton")  # stacks_to_kernel_layout lives with the triton kernels


def random_stack(rows: int, in_features: int, num_local: int = 3, seed: int = 0) -> ExpertStack:
    """A w13-like stack (gate and up parts) filled with random NVFP4 experts."""
    g = torch.Generator().manual_seed(seed)
    stack = ExpertStack("nvfp4", ("gate_proj", "up_proj"), rows, in_features, num_local,
                        dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    with torch.no_grad():
        for e in range(num_local):
            for p in range(2):
                q = quantize_nvfp4(torch.randn(rows, in_features, generator=g))
                at = slice(p * rows, (p + 1) * rows)
                stack.weight[e, at] = q.weight
                stack.weight_scale[e, at] = q.weight_scale
                stack.weight_scale_2[e, p] = q.weight_scale_2
    return stack


@pytest.mark.parametrize("layout", [RELAYOUT, TILED])
def test_kernel_layouts_dequantise_to_the_same_weights(layout):
    stack = random_stack(rows=32, in_features=512)
    ids = torch.tensor([2, 0])
    before = stack.dense(ids)
    stored = stack.weight.clone()
    stack.to_kernel_layout(layout)
    assert stack.kernel_layout == layout
    assert not torch.equal(stack.weight, stored)  # the bytes did move
    assert torch.equal(stack.dense(ids), before)
    stack.to_kernel_layout(RELAYOUT if layout == TILED else TILED)  # once out of the checkpoint layout: no-op
    assert stack.kernel_layout == layout


def test_tiled_refused_for_partial_tiles_and_backend_falls_back():
    from nsaserve.kernels.triton_moe_w4a16 import stacks_to_kernel_layout

    w13 = random_stack(rows=32, in_features=256)  # whole tiles
    w2 = random_stack(rows=24, in_features=256)  # 24 rows: not whole 16-row tiles
    assert w13.can_tile() and not w2.can_tile()
    with pytest.raises(ValueError, match="not whole"):
        w2.to_kernel_layout(TILED)
    assert w2.kernel_layout == CHECKPOINT
    stacks_to_kernel_layout(w13, w2, TILED)
    assert (w13.kernel_layout, w2.kernel_layout) == (RELAYOUT, RELAYOUT)


def test_a_ranks_stacks_know_the_layers_experts_on_all_ranks():
    """Rank 1 of 4 holds 2 of a tiny layer's 8 experts; its stacks carry both counts (the MoE
    kernel sizes its blocks by the rows a local expert can expect)."""
    from model_helpers import tiny_config

    from nsaserve.model.mlp import MoE
    from nsaserve.model.parallel import TPGroup
    from nsaserve.model.weight_factory import WeightFactory

    cfg = tiny_config("glm_moe_dsa")
    moe = MoE(cfg, TPGroup(1, 4), WeightFactory(torch.float32, torch.device("cpu")), "model.layers.1.mlp.")
    assert (moe.first_expert, moe.num_local) == (2, 2)
    assert moe.w13.weight.shape[0] == moe.w2.weight.shape[0] == 2
    assert moe.w13.num_experts == moe.w2.num_experts == cfg.n_routed_experts == 8
