import pytest
import torch

from nsaserve.kernels.quant import dequantize_fp8_block, fp8_block_linear, quantize_fp8_block

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def dequantize_reference(weight, scale_inv):
    n, k = weight.shape
    out = torch.empty(n, k)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            rows, cols = slice(128 * bi, 128 * bi + 128), slice(128 * bj, 128 * bj + 128)
            out[rows, cols] = weight[rows, cols].float() * scale_inv[bi, bj]
    return out


def test_hand_computed_block():
    # amax 448 -> scale 1, so every value that e4m3 represents is stored exactly.
    w = torch.tensor([[448.0, 1.0, -0.5], [-224.0, 0.0, 3.5]])
    q = quantize_fp8_block(w)
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight_scale_inv.tolist() == [[1.0]]
    assert q.weight.float().tolist() == w.tolist()
    # e4m3 bytes: 448 = 0x7E, -224 = 0xF6, 1.0 = 0x38
    assert q.weight.view(torch.uint8)[:, :2].tolist() == [[0x7E, 0x38], [0xF6, 0x00]]


def test_partial_edge_blocks_and_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(130, 260, generator=g)
    w[128:, 256:] *= 100  # the corner block has its own scale
    q = quantize_fp8_block(w)
    assert q.weight.shape == (130, 260) and q.weight_scale_inv.shape == (2, 3)
    assert q.weight_scale_inv[1, 2].item() == pytest.approx(w[128:, 256:].abs().max().item() / 448, rel=1e-6)
    assert q.weight_scale_inv[0, 0].item() == pytest.approx(w[:128, :128].abs().max().item() / 448, rel=1e-6)
    assert torch.equal(dequantize_fp8_block(*q), dequantize_reference(*q))


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_error_bound(device):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(256, 384, generator=g) * 0.05).to(device)
    w[:128, :128] = 0  # zero block: scale 1.0, decodes to exact zeros
    q = quantize_fp8_block(w)
    deq = dequantize_fp8_block(*q)
    assert q.weight_scale_inv[0, 0].item() == 1.0 and bool((deq[:128, :128] == 0).all())
    scale = q.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    # e4m3: 3 mantissa bits -> relative half-step 2^-4 for normals; subnormal step 2^-9 in scaled units.
    allowed = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert bool(((deq - w).abs() <= allowed).all())


def test_ue8m0_scales_are_powers_of_two():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    q = quantize_fp8_block(w, scale_fmt="ue8m0")
    mant, _ = torch.frexp(q.weight_scale_inv)
    assert bool((mant == 0.5).all())
    assert (q.weight_scale_inv * 448 >= w.reshape(1, 128, 2, 128).abs().amax(dim=(1, 3))).all()


def test_ue8m0_scale_just_above_a_power_of_two_rounds_up():
    """float32 log2 of 1024 * (1 + 2^-23) rounds to 10 exactly, so exp2(ceil(log2(s))) gave 1024, a
    scale below amax / 448 (the codes would saturate); the scale is read off the bits instead."""
    from nsaserve.kernels.quant.fp8 import fp8_scale_from_amax, pow2_ceil

    s = torch.tensor([1024.0, 0.75, 3.0]).nextafter(torch.tensor(float("inf")))
    assert torch.equal(pow2_ceil(s), torch.tensor([2048.0, 1.0, 4.0]))
    assert torch.equal(pow2_ceil(torch.tensor([1024.0, 2.0**-13])), torch.tensor([1024.0, 2.0**-13]))
    amax = s * 448
    assert bool((fp8_scale_from_amax(amax, "ue8m0") * 448 >= amax).all())


@pytest.mark.parametrize("device", DEVICES)
def test_linear_matches_dense_matmul(device):
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(200, 300, generator=g), torch.randn(7, 300, generator=g).to(torch.bfloat16)
    q = quantize_fp8_block(w.to(device))
    y = fp8_block_linear(x.to(device), *q)
    expected = x.float() @ dequantize_reference(*(t.cpu() for t in q)).T
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float().cpu(), expected, rtol=2e-2, atol=5e-2)


def test_rejects_mismatched_scales():
    q = quantize_fp8_block(torch.randn(130, 64))
    with pytest.raises(ValueError):
        dequantize_fp8_block(q.weight, q.weight_scale_inv[:1])


def test_matches_transformers_dequantisation():
    # Cross-check against the torch dequantisation transformers uses for these checkpoints (a private
    # helper, hence the skip if it moves).
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    helper = getattr(fp8, "_dequantize_fp8_weight", None)
    if helper is None:
        pytest.skip("transformers no longer has _dequantize_fp8_weight")
    q = quantize_fp8_block(torch.randn(300, 200, generator=torch.Generator().manual_seed(4)))
    theirs = helper(q.weight, q.weight_scale_inv, [128, 128], torch.float32)
    assert torch.equal(dequantize_fp8_block(*q), theirs)
