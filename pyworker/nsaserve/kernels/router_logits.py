"""MoE router logits: float32 [T, E] = x [T, H] . W^T for the float32 router weight W [E, H].

The reference (and the model's definition) is float32: routing decisions flip on small rounding
differences, so the logits must be float32-accurate. A float32 GEMM runs on the CUDA cores, not the
tensor cores: on the H200 at GLM-5 shapes it took 1.0 ms per MoE layer for a 16K-token prefill
(bench/results/2026-12-01-step-profile-dense-prefill.json), plus the float32 copy of x.

"bf16x3": W = W_hi + W_mid + W_lo, each part the bf16 rounding of what the parts before it left
(split_bf16x3, done once per weight); the residual after three parts is below 2^-24 |W|, so the
parts hold W to float32 precision. x is bf16 already (the model's activations), so every product
x_i * part is exact in float32, and one bf16 GEMM of x against the stacked parts [3E, H] with
float32 output (tensor cores, float32 accumulation), then the sum of the three [T, E] slices,
gives the float32 logits up to summation order, as a float32 GEMM with another blocking would.
Off CUDA (tests) the same parts are multiplied in float32; fp16 activations take the float32 GEMM.

Kind "router_logits": (x [T, H] in the model dtype, weight float32 [E, H], split bf16 [3E, H] or
None) -> float32 [T, E]. "bf16x3" needs split (the model's Router builds it once, when the
runner chooses the backend).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .registry import register

PARTS = 3


def split_bf16x3(weight: torch.Tensor) -> torch.Tensor:
    """float32 [E, H] -> bf16 [3E, H]: rows [0, E) the high parts, then the middle, then the low."""
    parts, rest = [], weight.float()
    for _ in range(PARTS):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
    return torch.cat(parts)


@register("router_logits", "torch")
def router_logits_torch(x: torch.Tensor, weight: torch.Tensor, split: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.float(), weight)


# torch.mm(bf16, bf16, out_dtype=float32): a CUDA operator of recent torch versions. Set to False
# (with a warning, once) if it fails on this machine: the float32 GEMM then serves.
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def _mm_float32_out(x: torch.Tensor, split: torch.Tensor) -> torch.Tensor | None:
    global _MM_OUT_DTYPE
    try:
        return torch.mm(x, split.t(), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        _MM_OUT_DTYPE = False
        warnings.warn(f"router logits: torch.mm(out_dtype=float32) failed ({e}); using the float32 GEMM", stacklevel=2)
        return None


@register("router_logits", "bf16x3")
def router_logits_bf16x3(x: torch.Tensor, weight: torch.Tensor, split: torch.Tensor | None = None) -> torch.Tensor:
    if split is None:
        raise ValueError("the bf16x3 router logits need the weight's bf16 parts (split_bf16x3)")
    experts = weight.shape[0]
    if not x.is_cuda:  # the same parts, multiplied in float32 (what the tests check off CUDA)
        y = F.linear(x.float(), split.float())
    else:
        y = _mm_float32_out(x, split) if x.dtype == torch.bfloat16 and _MM_OUT_DTYPE else None
        if y is None:  # fp16 activations (the parts are bf16) or no such operator: the float32 GEMM
            return F.linear(x.float(), weight)
    # (hi + mid) + lo: the large parts first, as their sum is what the low part refines.
    return (y[:, :experts] + y[:, experts : 2 * experts]) + y[:, 2 * experts :]
