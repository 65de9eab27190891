"""Rounding inside Triton kernels, bit-exact with torch: casts to bf16 and quantisation to e4m3.

Triton's CPU interpreter (3.6) truncates float32 -> bfloat16 and rounds float32 -> e4m3 halfway
cases away from zero; torch and the GPU round to nearest even. The helpers here round on the
float32 bits where the interpreter runs, and use the hardware conversions on the GPU.


Scale conventions (a scale multiplies: value = e4m3 * scale); the constexpr codes kernels take:
    SCALE_CACHE = 0: max(amax / 448, 1e-10)            kernels.kv_cache_format's indexer key
    SCALE_FLOAT = 1: amax / 448, all-zero groups 1.0    kernels.quant.fp8 "float"
    SCALE_UE8M0 = 2: 2^ceil(log2(max(amax / 448, 1e-4)))   kernels.quant.fp8 "ue8m0", kv_cache_format's latent
"""

import triton
import triton.language as tl

SCALE_CODES = {"cache": 0, "float": 1, "ue8m0": 2}


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """x (float32) -> dtype, rounded to nearest even as torch's .to(dtype)."""
    if INTERPRET and dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # round the low 16 bits away, ties to even
        return b.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def fp8_scale(amax, SCALE_FMT: tl.constexpr, INTERPRET: tl.constexpr):
    """Per-group multiplying scale from the group's amax (float32), as the torch quantisers compute it
    on the same device: torch divides by the Python scalar 448 exactly on the CPU, but on CUDA
    multiplies by its float32 reciprocal (one bit less precise; BinaryDivTrueKernel.cu)."""
    if INTERPRET:
        s = tl.math.div_rn(amax, 448.0)
    else:
        s = amax * (1.0 / 448.0)
    if SCALE_FMT == 0:
        s = tl.maximum(s, 1e-10)
    elif SCALE_FMT == 1:
        s = tl.where(s > 0.0, s, 1.0)
    else:
        # The next power of two at or above s, from its bits: exact, unlike exp2(ceil(log2(s))).
        b = tl.maximum(s, 1e-4).to(tl.int32, bitcast=True)
        up = ((b & 0x7FFFFF) != 0).to(tl.int32)
        s = (((b >> 23) + up) << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def e4m3_code(x, INTERPRET: tl.constexpr):
    """float32 x, |x| <= 448 -> its float8_e4m3fn bits as uint8, rounded to nearest even.

    On the GPU this is the hardware conversion (cvt.rn.satfinite). In the interpreter
    x is rounded to a multiple of its e4m3 quantum 2^(max(e, -6) - 3) by the add-2^23 trick, then
    the code is read off the rounded value's exponent and top three mantissa bits.
    """
    if INTERPRET:
        b = x.to(tl.int32, bitcast=True)
        sign = (b >> 24) & 0x80
        a = tl.abs(x)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        r = ((a / quantum + 8388608.0) - 8388608.0) * quantum
        rb = r.to(tl.int32, bitcast=True)
        normal = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
        code = tl.where(r < 0.015625, (r * 512.0).to(tl.int32), normal)  # below 2^-6: subnormal m * 2^-9
        return (code | sign).to(tl.uint8)
    return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def quantize_groups(x, GROUPS: tl.constexpr, G: tl.constexpr, SCALE_FMT: tl.constexpr, INTERPRET: tl.constexpr):
    """x float32 [GROUPS * G] -> (e4m3 codes uint8 [GROUPS * G], scales float32 [GROUPS])."""
    xg = tl.reshape(x, [GROUPS, G])
    scale = fp8_scale(tl.max(tl.abs(xg), axis=1), SCALE_FMT, INTERPRET)
    q = tl.minimum(tl.maximum(tl.math.div_rn(xg, scale[:, None]), -448.0), 448.0)
    return tl.reshape(e4m3_code(q, INTERPRET), [GROUPS * G]), scale


def scale_code(scale_fmt: str) -> int:
    try:
        return SCALE_CODES[scale_fmt]
    except KeyError:
        raise ValueError(f"unknown FP8 scale format {scale_fmt!r}; expected one of {sorted(SCALE_CODES)}") from None
