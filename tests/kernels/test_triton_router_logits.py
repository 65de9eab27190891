"""The Triton router logits (one launch over the weight's three bf16 parts) against float64: as
accurate as the float32 reference, the same experts routed, the same bits on every call (the split
sums are added in a fixed order), on fresh random inputs.

On the GPU at GLM-5 and DeepSeek shapes; without one in Triton's CPU interpreter at small shapes.
"""

import pytest
import torch

# The small-op tests' setup: Triton's CPU interpreter without a GPU, fresh seeds printed on failure.
from test_triton_small_ops import DEV, GPU, SEED

from nsaserve.kernels.moe import route_noaux_tc
from nsaserve.kernels.registry import get_backend, graph_safe
from nsaserve.kernels.router_logits import split_bf16x3

# (tokens, experts, hidden): one token (many splits), a decode batch, a partial expert tile, prompts.
SHAPES = (
    [(1, 256, 6144), (16, 256, 6144), (256, 256, 6144), (300, 80, 1024), (4096, 256, 7168)]
    if GPU
    else [(1, 64, 512), (5, 64, 256), (37, 80, 128)]
)


@pytest.mark.parametrize("tokens,experts,hidden", SHAPES)
def test_triton_logits_as_accurate_as_float32_same_routing_same_bits(tokens, experts, hidden):
    g = torch.Generator().manual_seed(SEED + tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(DEV, torch.bfloat16)
    # Rows of different norms (log-uniform over 2^-4..2^4), as trained routers have.
    row_scale = torch.exp2(torch.rand(experts, 1, generator=g) * 8 - 4)
    w = (torch.randn(experts, hidden, generator=g) * hidden**-0.5 * row_scale).to(DEV)
    split = split_bf16x3(w)
    exact = x.double() @ w.double().t()
    ref = get_backend("router_logits", "torch")(x, w)
    got = get_backend("router_logits", "triton")(x, w, split)
    assert got.dtype == torch.float32 and got.shape == (tokens, experts)
    err_ref = (ref.double() - exact).abs().max().item()
    err_got = (got.double() - exact).abs().max().item()
    assert err_got <= 2 * err_ref + 1e-7 * exact.abs().max().item(), (SEED, err_got, err_ref)
    assert torch.equal(get_backend("router_logits", "triton")(x, w, split), got), SEED
    if experts % 8 == 0 and experts >= 64:
        bias = torch.randn(experts, generator=g).to(DEV) * 0.01
        args = (8, 8, 4, True, 2.5)
        w_ref, ids_ref = route_noaux_tc(ref, bias, *args)
        w_got, ids_got = route_noaux_tc(got, bias, *args)
        assert torch.equal(ids_got, ids_ref), SEED
        assert torch.allclose(w_got, w_ref, rtol=1e-5, atol=1e-6), SEED


def test_launch_shape_fills_the_gpu_and_bounds_the_splits():
    from nsaserve.kernels.triton_router_logits import launch_shape

    assert launch_shape(1, 256, 6144, 132) == (16, 16)  # 4 tiles: as many splits as allowed
    assert launch_shape(64, 256, 6144, 132) == (32, 16)  # 8 tiles
    assert launch_shape(256, 256, 6144, 132) == (64, 16)  # 16 tiles x 16 splits
    assert launch_shape(1024, 256, 6144, 132) == (64, 4)  # 64 tiles: 5 wanted, 4 divides 96 blocks
    assert launch_shape(16384, 256, 6144, 132) == (64, 1)  # 1024 tiles: no split
    assert launch_shape(1, 256, 128, 132) == (16, 2)  # never more splits than K blocks


def test_needs_the_split_and_is_graph_safe():
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV), torch.zeros(4, 64, device=DEV)
    with pytest.raises(ValueError, match="bf16 parts"):
        get_backend("router_logits", "triton")(x, w)
    with pytest.raises(ValueError, match="split must be"):
        get_backend("router_logits", "triton")(x, w, torch.zeros(4, 64, dtype=torch.bfloat16, device=DEV))
    assert graph_safe("router_logits", "triton")
