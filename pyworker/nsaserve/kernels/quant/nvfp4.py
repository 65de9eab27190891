"""NVFP4 weights as NVIDIA ModelOpt writes them, with a torch reference for dequantisation and Linear.

Per quantised Linear with weight W [N out, K in] (K a multiple of 16):

    weight          uint8          [N, K/2]   two e2m1 codes per byte, element 2j in the LOW nibble
    weight_scale    float8_e4m3fn  [N, K/16]  one scale per 16 consecutive inputs, row-major (not swizzled)
    weight_scale_2  float32        []         global scale = amax(|W|) / (6 * 448)
    input_scale     float32        []         static activation scale, used only by W4A4 kernels

    W[n, k] = e2m1(code[n, k]) * float(weight_scale[n, k // 16]) * weight_scale_2

Leading dimensions are allowed ([E, N, K] for stacked experts); the global scale then covers the
whole tensor. Quantisation follows ModelOpt's weight path (amax based, no calibration needed):
block scale = amax(block) / (6 * weight_scale_2), stored as e4m3 with all-zero blocks set to 1.0 and
tiny ones clamped to 2^-9 (the smallest e4m3 subnormal) so they do not flush to 0; codes are the
round-to-nearest-even e2m1 of W / (block scale * weight_scale_2).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .e2m1 import E2M1_MAX, decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1
from .fp8 import E4M3_MAX, E4M3_MIN_SUBNORMAL

NVFP4_GROUP_SIZE = 16


class Nvfp4Weight(NamedTuple):
    """The three tensors of one NVFP4 weight, named as in the checkpoint (unpacks like a tuple)."""

    weight: torch.Tensor  # uint8 [..., N, K/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [..., N, K/16]
    weight_scale_2: torch.Tensor  # float32 []


def nvfp4_global_scale(weight: torch.Tensor) -> torch.Tensor:
    """ModelOpt's global scale amax(|W|) / (6 * 448), float32 scalar.

    An all-zero tensor gets 1.0 instead of 0 (any positive value decodes it exactly), so the block
    scales stay finite.
    """
    amax = weight.detach().abs().amax().float()
    scale_2 = amax / (E2M1_MAX * E4M3_MAX)
    return torch.where(amax > 0, scale_2, torch.ones_like(scale_2))


def quantize_nvfp4(weight: torch.Tensor, weight_scale_2: torch.Tensor | None = None) -> Nvfp4Weight:
    """Quantise a float weight [..., N, K] to NVFP4.

    ``weight_scale_2`` may be given to share one global scale between tensors that a kernel fuses
    (gate_proj and up_proj of one MLP share it in ModelOpt exports); by default it is computed from
    this tensor's amax. Runs on the tensor's device.
    """
    k = weight.shape[-1]
    if k % NVFP4_GROUP_SIZE:
        raise ValueError(f"NVFP4 needs the input dimension to be a multiple of {NVFP4_GROUP_SIZE}, got {k}")
    if weight_scale_2 is None:
        weight_scale_2 = nvfp4_global_scale(weight)
    scale_2 = weight_scale_2.to(device=weight.device, dtype=torch.float32).reshape(())

    blocks = weight.detach().float().reshape(*weight.shape[:-1], k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
    block_scale = blocks.abs().amax(dim=-1) / (E2M1_MAX * scale_2)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    # The upper clamp only guards float rounding just above 448 (e4m3fn has no inf: overflow is NaN).
    block_scale = block_scale.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)

    # Divide by the scale the decoder will actually use (the e4m3-rounded one), like ModelOpt.
    scaled = blocks / (block_scale.float() * scale_2).unsqueeze(-1)
    codes = encode_e2m1(scaled.reshape(weight.shape))
    return Nvfp4Weight(pack_e2m1(codes), block_scale, scale_2.clone())


def dequantize_nvfp4(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reference dequantisation: packed uint8 [..., N, K/2] to ``dtype`` [..., N, K]."""
    values = decode_e2m1(unpack_e2m1(weight))
    k = values.shape[-1]
    if weight_scale.shape != (*values.shape[:-1], k // NVFP4_GROUP_SIZE):
        raise ValueError(
            f"weight_scale shape {tuple(weight_scale.shape)} does not match weight {tuple(weight.shape)} "
            f"(expected {(*values.shape[:-1], k // NVFP4_GROUP_SIZE)})"
        )
    blocks = values.reshape(*values.shape[:-1], k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
    scale = weight_scale.float() * weight_scale_2.to(device=weight.device, dtype=torch.float32)
    return (blocks * scale.unsqueeze(-1)).reshape(values.shape).to(dtype)


def nvfp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference W4A16 Linear: ``x @ dequantize_nvfp4(...).T (+ bias)``, accumulated in float32,
    returned in x's dtype. ``input_scale`` is deliberately not an argument: it only matters when the
    activations are quantised too (W4A4)."""
    w = dequantize_nvfp4(weight, weight_scale, weight_scale_2, torch.float32)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


def random_nvfp4_experts(
    num_experts: int, rows: int, cols: int, parts: int, generator: torch.Generator, device="cpu"
) -> Nvfp4Weight:
    """Random stacked expert weights in the NVFP4 layout, made directly from random codes and block
    scales (for kernel tests and benchmarks at sizes where quantising float weights would dominate):
    weight uint8 [E, rows, cols/2], weight_scale e4m3 [E, rows, cols/16] spread over 2^-9..2^8.7
    (subnormals included), weight_scale_2 float32 [E, parts] sized so that a row's dot product with
    a unit-variance input stays O(1). `generator` must live on `device`."""
    w = torch.randint(0, 256, (num_experts, rows, cols // 2), dtype=torch.uint8, generator=generator, device=device)
    exps = torch.empty(num_experts, rows, cols // NVFP4_GROUP_SIZE, device=device).uniform_(
        -9, 8.7, generator=generator
    )
    s2 = torch.rand(num_experts, parts, generator=generator, device=device) + 0.3
    return Nvfp4Weight(w, torch.exp2(exps).to(torch.float8_e4m3fn), s2 / (cols**0.5 * 3 * 2**2))
