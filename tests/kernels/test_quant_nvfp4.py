import pytest
import torch

from nsaserve.kernels.quant import dequantize_nvfp4, nvfp4_linear, quantize_nvfp4
from nsaserve.kernels.quant.nvfp4 import nvfp4_global_scale

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def quantize_reference(w: torch.Tensor):
    """Element-by-element NVFP4 quantisation of a 2-D weight, written out as the format defines it."""
    n, k = w.shape
    amax = max(abs(v) for v in w.flatten().tolist())
    scale_2 = torch.tensor(amax, dtype=torch.float32) / (6.0 * 448.0)
    codes = [[0] * k for _ in range(n)]
    scales = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn)
    for r in range(n):
        for b in range(k // 16):
            block = w[r, 16 * b : 16 * b + 16].float()
            s = (block.abs().max() / (6.0 * scale_2)).item()
            s = 1.0 if s == 0 else min(max(s, 2.0**-9), 448.0)
            scales[r, b] = s
            denom = scales[r, b].float() * scale_2
            for j in range(16):
                t = (block[j] / denom).item()
                mag = min(abs(t), 6.0)
                best = min(range(8), key=lambda i: (abs(MAGNITUDES[i] - mag), i % 2))
                codes[r][16 * b + j] = best | (8 if t < 0 else 0)
    packed = [[codes[r][2 * j] | (codes[r][2 * j + 1] << 4) for j in range(k // 2)] for r in range(n)]
    return torch.tensor(packed, dtype=torch.uint8), scales, scale_2


def dequantize_reference(packed, scales, scale_2):
    n, half = packed.shape
    out = torch.empty(n, 2 * half)
    for r in range(n):
        for j in range(half):
            byte = int(packed[r, j])
            for pos, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                value = MAGNITUDES[code & 7] * (-1 if code & 8 else 1)
                out[r, pos] = value * scales[r, pos // 16].float().item() * scale_2.item()
    return out


def test_hand_computed_row_of_every_value():
    # amax 6 -> scale_2 = 6 / 2688 = 1/448, block scale = 6 / (6/448) = 448 (exact in e4m3),
    # so each value is its own code.
    w = torch.tensor([[0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]])
    q = quantize_nvfp4(w)
    assert q.weight_scale_2.item() == pytest.approx(1 / 448, rel=1e-7)
    assert q.weight_scale.float().tolist() == [[448.0]]
    assert q.weight.tolist() == [[0x10, 0x32, 0x54, 0x76, 0x90, 0xBA, 0xDC, 0xFE]]
    assert torch.equal(dequantize_nvfp4(*q), w)


def test_hand_computed_two_blocks_with_ties():
    # Global amax 3 -> scale_2 = 3/2688. Block A (amax 3): scale 448, unit 448*3/2688 = 0.5.
    # Block B (amax 0.75): scale 0.75/(6*3/2688) = 112 (exact), unit 112*3/2688 = 0.125.
    a = [3.0, 1.25, 1.75, -2.5, 0.125, -0.1] + [0.0] * 10  # scaled: 6, 2.5, 3.5, -5, 0.25, -0.2
    b = [0.75, 0.0625, 0.1875, 0.03125, 0.09375] + [0.0] * 11  # scaled: 6, 0.5, 1.5, 0.25, 0.75
    q = quantize_nvfp4(torch.tensor([a + b]))
    assert q.weight_scale.float().tolist() == [[448.0, 112.0]]
    codes_a = [7, 4, 6, 8 | 6, 0, 8 | 0] + [0] * 10  # ties: 2.5->2, 3.5->4, 5->4, 0.25->0
    codes_b = [7, 1, 3, 0, 2] + [0] * 11  # ties: 0.25->0, 0.75->1
    codes = codes_a + codes_b
    assert q.weight[0].tolist() == [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
    deq = dequantize_nvfp4(*q)[0].tolist()
    assert deq[:6] == [3.0, 1.0, 2.0, -2.0, 0.0, 0.0]
    assert deq[16:21] == [0.75, 0.0625, 0.1875, 0.0, 0.125]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_elementwise_reference(dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(6, 64, generator=g) * torch.rand(6, 1, generator=g) * 0.1).to(dtype)
    w[2, 16:32] = 0  # an all-zero block gets scale 1.0
    w[3, :16] *= 1e-4  # a tiny block: its scale would underflow e4m3 without the 2^-9 clamp
    q = quantize_nvfp4(w)
    ref_packed, ref_scales, ref_scale_2 = quantize_reference(w)
    assert torch.equal(q.weight, ref_packed)
    assert torch.equal(q.weight_scale.view(torch.uint8), ref_scales.view(torch.uint8))
    assert q.weight_scale_2.item() == ref_scale_2.item()
    assert q.weight_scale[2, 1].float().item() == 1.0
    assert q.weight_scale[3, 0].float().item() >= 2.0**-9


def test_dequantize_matches_elementwise_reference():
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (5, 24), dtype=torch.uint8, generator=g)
    scales = (torch.rand(5, 3, generator=g) * 10 + 0.01).to(torch.float8_e4m3fn)
    scale_2 = torch.tensor(0.037)
    assert torch.allclose(
        dequantize_nvfp4(packed, scales, scale_2), dequantize_reference(packed, scales, scale_2), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_error_is_within_half_a_step(device):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 256, generator=g) * 0.02).to(device)
    q = quantize_nvfp4(w)
    assert q.weight.device.type == device
    err = (dequantize_nvfp4(*q) - w).abs()
    unit = (q.weight_scale.float() * q.weight_scale_2).repeat_interleave(16, dim=-1)
    t = (w / unit).abs()
    half_step = torch.where(t < 2, 0.25, torch.where(t < 4, 0.5, 1.0))
    allowed = unit * (half_step + (t - 6).clamp_min(0)) * (1 + 1e-6)
    assert bool((err <= allowed).all())
    rel = (err.norm() / w.norm()).item()
    assert rel < 0.12  # ~8 % is typical for 4-bit e2m1 with e4m3 scales on Gaussian weights


def test_shared_global_scale_and_stacked_experts():
    g = torch.Generator().manual_seed(4)
    gate, up = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g) * 3
    shared = torch.maximum(nvfp4_global_scale(gate), nvfp4_global_scale(up))
    qg = quantize_nvfp4(gate, shared)
    assert qg.weight_scale_2.item() == shared.item()
    assert (qg.weight_scale.float() <= 448).all()
    experts = torch.randn(3, 16, 32, generator=g)
    q3 = quantize_nvfp4(experts)
    assert q3.weight.shape == (3, 16, 16) and q3.weight_scale.shape == (3, 16, 2)
    flat = quantize_nvfp4(experts.reshape(48, 32))
    assert torch.equal(q3.weight.reshape(48, 16), flat.weight)


def test_all_zero_weight_decodes_to_zero():
    q = quantize_nvfp4(torch.zeros(4, 32))
    assert torch.isfinite(q.weight_scale.float()).all() and q.weight_scale_2.item() > 0
    assert torch.equal(dequantize_nvfp4(*q), torch.zeros(4, 32))


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.randn(4, 24))
    q = quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(ValueError):
        dequantize_nvfp4(q.weight, q.weight_scale[:, :1], q.weight_scale_2)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_matches_dense_matmul(device):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=g).to(device)
    x = torch.randn(3, 5, 64, generator=g).to(device, torch.bfloat16)
    bias = torch.randn(48, generator=g).to(device)
    q = quantize_nvfp4(w)
    y = nvfp4_linear(x, *q, bias=bias)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, 48)
    expected = x.float() @ dequantize_reference(*(t.cpu() for t in q)).to(device).T + bias
    assert torch.allclose(y.float(), expected, rtol=1e-2, atol=1e-2)
