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
