"""MoE router logits: the "bf16x3" backend (the float32 weight as three bf16 parts, one bf16 GEMM
with float32 output) is as accurate as the float32 reference against float64, and routes the same
experts, on fresh random inputs; on CUDA through torch.mm(out_dtype=float32), elsewhere through the
same parts in float32."""

import pytest
import torch

from nsaserve.kernels.moe import route_noaux_tc
from nsaserve.kernels.registry import get_backend, graph_safe, resolve
from nsaserve.kernels.router_logits import split_bf16x3

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_three_bf16_parts_hold_the_float32_weight():
    g = torch.Generator().manual_seed(0)
    # Magnitudes over many binades, as trained router weights (and their small outliers) span.
    w = torch.randn(64, 512, generator=g) * torch.exp2(torch.randint(-20, 4, (64, 512), generator=g).float())
    parts = split_bf16x3(w).double().reshape(3, 64, 512)
    assert split_bf16x3(w).dtype == torch.bfloat16
    residual = (parts.sum(0) - w.double()).abs()
    assert (residual <= w.double().abs() * 2.0**-24).all()
    assert (parts[1].abs() <= parts[0].abs() * 2.0**-8).all()  # each part refines the one before


# 2 and more tokens: the bf16 GEMMs on CUDA (one token takes the float32 GEMM); 4096 x 7168 (DeepSeek's
# hidden size, chains of 256) only on CUDA, where the float64 product is quick.
SHAPES = [(1, 256, 6144), (16, 256, 6144), (64, 256, 6144), (300, 64, 1024)]
SHAPES += [(4096, 256, 7168)] if DEV == "cuda" else []


@pytest.mark.parametrize("tokens,experts,hidden", SHAPES)
def test_bf16x3_logits_as_accurate_as_float32_and_same_routing(tokens, experts, hidden):
    g = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(DEV)
    exact = x.double() @ w.double().t()
    ref = get_backend("router_logits", "torch")(x, w)
    got = get_backend("router_logits", "bf16x3")(x, w, split_bf16x3(w))
    assert got.dtype == torch.float32 and got.shape == (tokens, experts)
    if DEV == "cuda":  # the bf16 GEMM with float32 output ran, not the float32 fallback
        from nsaserve.kernels import router_logits

        assert router_logits._MM_OUT_DTYPE
    err_ref = (ref.double() - exact).abs().max().item()
    err_got = (got.double() - exact).abs().max().item()
    assert err_got <= 2 * err_ref + 1e-7 * exact.abs().max().item(), (err_got, err_ref)
    bias = torch.randn(experts, generator=g).to(DEV) * 0.01
    args = (8, 8 if experts == 256 else 1, 4 if experts == 256 else 1, True, 2.5)
    w_ref, ids_ref = route_noaux_tc(ref, bias, *args)
    w_got, ids_got = route_noaux_tc(got, bias, *args)
    assert torch.equal(ids_got, ids_ref)
    assert torch.allclose(w_got, w_ref, rtol=1e-5, atol=1e-6)


def test_high_part_chains_divide_the_hidden_size():
    from nsaserve.kernels.router_logits import HI_CHUNK_K, hi_chunk

    assert HI_CHUNK_K == 384 and hi_chunk(6144) == 384 and hi_chunk(7168) == 256
    assert hi_chunk(5120) == 320 and hi_chunk(100) == 100  # no multiple of 64 divides 100: one chain


def test_the_split_is_required_and_auto_picks_the_parts_on_cuda_only():
    x, w = torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(4, 16)
    with pytest.raises(ValueError, match="bf16 parts"):
        get_backend("router_logits", "bf16x3")(x, w)
    assert resolve("router_logits", "auto", "cuda", 16) in ("bf16x3", "triton")
    assert resolve("router_logits", "auto", "cuda", 32) == "torch"
    assert resolve("router_logits", "auto", "cpu", 16) == "torch"
    assert graph_safe("router_logits", "bf16x3") and graph_safe("router_logits", "torch")
