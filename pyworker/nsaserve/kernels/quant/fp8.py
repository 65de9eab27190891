"""float8_e4m3fn constants and the two scale conventions shared by the FP8 formats.

A scale here always multiplies: ``real value = float(e4m3 value) * scale`` (DeepSeek calls it
``scale_inv`` on weights). ``float`` scales are amax / 448; ``ue8m0`` scales are rounded UP to a
power of two (DeepSeek-V3.2 ``scale_fmt = "ue8m0"``, FlashMLA's FP8 KV cache), so that dividing by
them is exact and a kernel may apply them as exponent adds.
"""

import torch

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9

# DeepSeek's reference keeps power-of-two scales at least this large (amax floor 1e-4 / 448 would
# underflow to tiny exponents for all-zero rows); FlashMLA's cache quantiser uses the same floor on
# the scale itself.
UE8M0_SCALE_FLOOR = 1e-4


def fp8_scale_from_amax(amax: torch.Tensor, scale_fmt: str = "float") -> torch.Tensor:
    """Per-group multiplying scale from the group's amax, float32.

    ``"float"``: amax / 448, with all-zero groups given 1.0 (any positive scale encodes zeros exactly).
    ``"ue8m0"``: 2^ceil(log2(max(amax / 448, 1e-4))).
    """
    scale = amax.float() / E4M3_MAX
    if scale_fmt == "float":
        return torch.where(scale > 0, scale, torch.ones_like(scale))
    if scale_fmt == "ue8m0":
        return pow2_ceil(scale.clamp_min(UE8M0_SCALE_FLOOR))
    raise ValueError(f"unknown FP8 scale format {scale_fmt!r} (expected 'float' or 'ue8m0')")


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The least power of two >= x, for normal positive float32 x, read off its bits: exact, as the
    kernels compute it (exp2(ceil(log2(x))) can round log2 of a value just above a power of two
    down to that power)."""
    bits = x.float().contiguous().view(torch.int32)
    up = ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (((bits >> 23) + up) << 23).view(torch.float32)


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round x / scale to float8_e4m3fn, saturating at +-448 (a plain cast would give NaN above it)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
