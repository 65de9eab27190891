"""Device helpers shared by the Triton kernels (imported only where Triton is available)."""

import triton
import triton.language as tl


@triton.jit
def mma_operand(x, INTERPRET: tl.constexpr):
    """x rounded to bf16, the MMA's operand type. Triton's CPU interpreter (3.6) computes bf16 dots
    wrongly, so there the rounded values are carried in fp32: the same products and fp32 sums."""
    if INTERPRET:
        return x.to(tl.bfloat16).to(tl.float32)
    return x.to(tl.bfloat16)


@triton.jit
def parity(v):
    """Parity of the set bits of each (non-negative, < 2^32) integer: 0 or 1."""
    v = v ^ (v >> 16)
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return v & 1


@triton.jit
def hadamard_signs(dims, offs_d):
    """Rows `dims` [K], columns `offs_d` [D] of the unnormalised Sylvester-Hadamard matrix: entry
    (i, j) is -1 to the parity of i & j (hadamard.py builds the same matrix by doubling)."""
    return 1.0 - 2.0 * parity(dims[:, None] & offs_d[None, :]).to(tl.float32)


@triton.jit
def times_hadamard(piece, dims, offs_d, BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """piece [R, K] (the values of R rows at row dims `dims` [K]) times those rows of the
    unnormalised Hadamard matrix (hadamard_signs), as an MMA: -> float32 [R, D]. BF16: the values
    are exact in bf16, so bf16 operands give exact products (the signs are exact too) and float32
    sums; else a float32 product. R, K and D at least 16."""
    sign = hadamard_signs(dims, offs_d)
    if BF16:
        return tl.dot(mma_operand(piece, INTERPRET), mma_operand(sign, INTERPRET))
    return tl.dot(piece, sign, input_precision="ieee")


@triton.jit
def exact_exp(x, INTERPRET: tl.constexpr):
    """exp as torch's CUDA kernels compute it (libdevice's expf, not the fast ex2-based exp)."""
    if INTERPRET:
        return tl.exp(x)
    return tl.extra.cuda.libdevice.exp(x)


@triton.jit
def exact_log(x, INTERPRET: tl.constexpr):
    """log as torch's CUDA kernels compute it (libdevice's logf)."""
    if INTERPRET:
        return tl.log(x)
    return tl.extra.cuda.libdevice.log(x)
