"""FP4 e2m1 codes: the value table, round-to-nearest-even encoding and two-codes-per-byte packing.

A 4-bit e2m1 code is ``sign(bit 3) | magnitude index(bits 0-2)``; the magnitude index selects one of
``0, 0.5, 1, 1.5, 2, 3, 4, 6``. Code 8 is negative zero and decodes to 0.0.

Packing (NVIDIA ModelOpt NVFP4 on disk): along the last axis, element ``2j`` goes in the LOW nibble
(bits 0-3) of byte ``j`` and element ``2j + 1`` in the HIGH nibble (bits 4-7).
"""

import torch

# Magnitudes of codes 0..7; codes 8..15 are the same magnitudes negated.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# Midpoints between neighbouring magnitudes. A value exactly on a midpoint is a tie; ties go to the
# neighbour with the even code (its mantissa bit is 0), i.e. IEEE round-half-to-even. The upper
# neighbour has an even code exactly for the midpoints at odd positions (0.75, 1.75, 3.5).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


def e2m1_value_table(device=None) -> torch.Tensor:
    """The 16 decoded values indexed by code, float32."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round each element of an already-scaled tensor to the nearest e2m1 code (uint8 0..15).

    Magnitudes above 6 saturate to 6 (code 7/15). Ties round to even. Negative values, including
    those that round to zero, get the sign bit, as ModelOpt's encoder does.
    """
    mag = x.abs()
    # Counting the midpoints below |x| gives the magnitude index; one pass per midpoint keeps peak
    # memory at a few bytes per element (weights can be 100M+ elements on a GPU).
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in zip(_MIDPOINTS, _TIE_ROUNDS_UP):
        index += (mag >= midpoint) if tie_up else (mag > midpoint)
    sign = (x < 0).to(torch.uint8) << 3
    return index | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes (any integer dtype, values 0..15) to float32 values."""
    return e2m1_value_table(codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., 2n] into bytes [..., n]: even elements low nibble, odd elements high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dimension must be even to pack two codes per byte, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_e2m1``: bytes [..., n] to codes [..., 2n] (uint8)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed e2m1 data must be uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)
