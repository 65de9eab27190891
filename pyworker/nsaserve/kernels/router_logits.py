"""MoE router logits: float32 [T, E] = x [T, H] . W^T for the float32 router weight W [E, H].

The reference (and the model's definition) is float32: routing decisions flip on small rounding
differences, so the logits must be float32-accurate. A float32 GEMM runs on the CUDA cores, not the
tensor cores: on the H200 at GLM-5 shapes it took 1.0 ms per MoE layer for a 16K-token prefill
(bench/results/2026-12-01-step-profile-dense-prefill.json), plus the float32 copy of x.

"bf16x3": W = W_hi + W_mid + W_lo, each part the bf16 rounding of what the parts before it left
(split_bf16x3, done once per weight); the residual after three parts is below 2^-24 |W|, so the
parts hold W to float32 precision. x is bf16 already (the model's activations), so every product
x_i * part is exact in float32, and bf16 GEMMs with float32 output (tensor cores) sum them.

The tensor cores' float32 accumulation is not IEEE: each step truncates the running sum. On the
H200, one GEMM of x against the three parts stacked had 4-7x the float32 GEMM's largest error
against float64 at 1-16384 tokens (bench/results/2026-12-01-router-logits). The error grows with
the length of the accumulation chain and the size of the running sum, so it is the high part's:
that GEMM runs as a batch of chains of at most HI_CHUNK_K inputs (one strided batched GEMM) whose
float32 partial sums are then added; the mid and low parts, 2^8 and 2^16 times smaller, are one
GEMM over all of K. With chains of 384 the error was within 1.4x of the float32 GEMM's, and the
whole 3.4x faster than it at 16384 tokens. One token (below FLOAT32_BELOW) takes the float32
GEMM, faster there. Off CUDA (tests) the same parts are multiplied in float32; fp16 activations
take the float32 GEMM.

Kind "router_logits": (x [T, H] in the model dtype, weight float32 [E, H], split bf16 [3E, H] or
None) -> float32 [T, E]. "bf16x3" needs split (the model's Router builds it once, when the
runner chooses the backend), and so does "triton" (triton_router_logits.py: the same parts, one
launch).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .registry import register

PARTS = 3
# Backends that take the weight's bf16 parts (the model's Router builds them once, at load).
TAKES_SPLIT = ("bf16x3", "triton")


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


# Most inputs per accumulation chain of the high part's GEMM: the chains are the largest multiple of
# 64 inputs that divides the hidden size and is at most this (hi_chunk). Measured on the H200 at
# 256 experts x 6144 (bench/results/2026-12-01-router-logits), largest error over the float32
# GEMM's at 1 / 64 / 256 / 4096 / 16384 tokens: one chain 4.3 / 6.4 / 5.3 / 6.8 / 5.4x; chains of
# 1024 2.9 / 3.6 / 2.1 / 1.0 / 0.87x; of 384 1.0 / 1.4 / 0.85 / 0.38 / 0.29x, costing 381 against
# 235 us at 16384 tokens (the float32 GEMM: 1288 us); of 256 0.66-1.0x, 441 us.
HI_CHUNK_K: int | None = 384
# Fewer tokens than this take the float32 GEMM: at one token it is a 7.5 us matrix-vector product
# against 13.2 us for the bf16 GEMMs; at 8 tokens 19.3 against 13.8 (2-7 not measured).
FLOAT32_BELOW = 2


def hi_chunk(hidden: int) -> int:
    """Inputs per chain of the high part's GEMM for this hidden size (hidden itself: one chain)."""
    best = hidden
    if HI_CHUNK_K:
        for c in range(64, min(HI_CHUNK_K, hidden) + 1, 64):
            if hidden % c == 0:
                best = c
    return best


# torch.mm / torch.bmm (bf16, bf16, out_dtype=float32): CUDA operators of recent torch versions. Set
# to False (with a warning, once) if they fail on this machine: the float32 GEMM then serves.
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.bmm, "dtype")


def _high_part(x: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """x [T, H] . hi[E, H]^T in float32, as chains of hi_chunk(H) inputs whose sums are then added."""
    tokens, hidden = x.shape
    chunk = hi_chunk(hidden)
    if chunk == hidden:
        return torch.mm(x, hi.t(), out_dtype=torch.float32)
    n = hidden // chunk
    xs = x.view(tokens, n, chunk).transpose(0, 1)  # [n, T, chunk], views
    ws = hi.view(hi.shape[0], n, chunk).permute(1, 2, 0)  # [n, chunk, E]
    return torch.bmm(xs, ws, out_dtype=torch.float32).sum(0)


def _bf16x3_cuda(x: torch.Tensor, split: torch.Tensor, experts: int) -> torch.Tensor | None:
    global _MM_OUT_DTYPE
    try:
        high = _high_part(x, split[:experts])
        rest = torch.mm(x, split[experts:].t(), out_dtype=torch.float32)  # [T, 2E]: mid, then low
    except (RuntimeError, NotImplementedError, TypeError) as e:
        _MM_OUT_DTYPE = False
        warnings.warn(
            f"router logits: bf16 GEMMs with float32 output failed ({e}); using the float32 GEMM", stacklevel=2
        )
        return None
    # hi + (mid + lo): the small parts first, so the low one is not lost against the high one.
    return high + (rest[:, :experts] + rest[:, experts:])


@register("router_logits", "bf16x3")
def router_logits_bf16x3(x: torch.Tensor, weight: torch.Tensor, split: torch.Tensor | None = None) -> torch.Tensor:
    if split is None:
        raise ValueError("the bf16x3 router logits need the weight's bf16 parts (split_bf16x3)")
    experts = weight.shape[0]
    if not x.is_cuda:  # the same parts, multiplied in float32 (what the tests check off CUDA)
        y = F.linear(x.float(), split.float())
        return y[:, :experts] + (y[:, experts : 2 * experts] + y[:, 2 * experts :])
    use = x.dtype == torch.bfloat16 and _MM_OUT_DTYPE and x.shape[0] >= FLOAT32_BELOW
    y = _bf16x3_cuda(x, split, experts) if use else None
    if y is None:  # few tokens, fp16 activations (the parts are bf16) or no such operator: the float32 GEMM
        return F.linear(x.float(), weight)
    return y
