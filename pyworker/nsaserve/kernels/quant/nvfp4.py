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


# Re-laid-out words (relayout_nvfp4): the two words of a 16-input scale group hold 8 pairs (input
# q, input q + 8), q = 0..7, word 0 pairs q = 0..3, word 1 q = 4..7; pair p of a word is read by
# rotating the word right by R_MAG[p] (magnitudes) and R_SIGN[p] (signs), which must put the
# magnitude bits e1 e0 m of the pair's two inputs at bits 8..6 and 24..22 and their signs at 15 and
# 31: the bf16x2 bits of (e2m1(q), e2m1(q + 8)) * 2^-126. With these rotations a pair costs 2-4
# integer instructions (shift or rotate, mask, and for two of them a merge of the signs) and one
# packed multiply by (scale * 2^119): 15 instructions per 8 inputs where the checkpoint's byte
# order needs 17 (no 4 rotations of one word can place all four pairs whole).
RELAYOUT_R_MAG = (31, 2, 28, 6)
RELAYOUT_R_SIGN = (1, 2, 28, 0)


def _scale_code_table() -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 byte -> relayout byte u (and back): u = 0 for a zero scale, else (E + 10) << 3 | mmm for
    the scale 1.mmm * 2^E (E = -9..8; e4m3 subnormals normalised), so that the bf16 bits
    u * 16 + (236 << 7) are exactly scale * 2^119. 255 marks bytes with no code (negative, NaN)."""
    fwd = torch.full((256,), 255, dtype=torch.uint8)
    back = torch.zeros(256, dtype=torch.uint8)
    for b in range(128):
        e, m = b >> 3, b & 7
        if b == 0x7F:  # NaN
            continue
        if e:
            u = b + 24  # (e - 7 + 10) << 3 | m
        elif m:
            top = m.bit_length() - 1  # m * 2^-9 = 1.f * 2^(top - 9)
            u = (top + 1) << 3 | ((m << (3 - top)) & 7)
        else:
            u = 0
        fwd[b] = u
        back[u] = b
    fwd[0x80] = 0  # -0
    return fwd, back


_SCALE_FWD, _SCALE_BACK = _scale_code_table()


def _pair_bits():
    """(word, pair index q within the 16-input group, half, code bit, bit in the word) for the 32
    bits of each of a group's two re-laid-out words."""
    out = []
    for word in range(2):
        for p in range(4):
            q = 4 * word + p
            rm, rs = RELAYOUT_R_MAG[p], RELAYOUT_R_SIGN[p]
            for half, inp in ((0, q), (1, q + 8)):
                for bit in range(3):
                    out.append((word, inp, bit, (6 + 16 * half + bit + rm) % 32))
                out.append((word, inp, 3, (15 + 16 * half + rs) % 32))
    return out


_PAIR_BITS = _pair_bits()


def relayout_nvfp4(weight: torch.Tensor, scale: torch.Tensor, rows_per_chunk: int = 32768):
    """Checkpoint NVFP4 (uint8 [..., K/2], two codes a byte; float8_e4m3fn [..., K/16]) -> the
    kernels' layout for relayout=True: uint8 [..., K/2] whose 32-bit words hold the codes in the
    order the W4A16 MoE kernel reads them (triton_moe_dequant._pair_asm), and uint8 [..., K/16] re-encoded scales (see _scale_code_table).
    Codes of blocks whose scale is zero become 0 (their values are 0 either way), so the round trip
    (unrelayout_nvfp4) dequantises to the same values. New tensors; the inputs are not changed."""
    if weight.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected uint8 codes and float8_e4m3fn scales, got {weight.dtype}, {scale.dtype}")
    k2 = weight.shape[-1]
    if k2 % 8 or scale.shape[-1] * 8 != k2:
        raise ValueError(f"codes {tuple(weight.shape)} and scales {tuple(scale.shape)} are not 16-input groups")
    w = weight.reshape(-1, k2)
    s = scale.reshape(-1, k2 // 8).view(torch.uint8)
    fwd = _SCALE_FWD.to(s.device)
    new_s = fwd[s.long()]
    if bool((new_s == 255).any()):
        raise ValueError("negative or NaN block scales have no relayout code")
    out = torch.empty_like(w)
    for r0 in range(0, w.shape[0], rows_per_chunk):
        chunk = w[r0 : r0 + rows_per_chunk].to(torch.int32)
        codes = torch.stack([chunk & 15, chunk >> 4], -1).reshape(chunk.shape[0], -1, 16)  # [R, groups, 16]
        codes = codes * (new_s[r0 : r0 + rows_per_chunk, :, None] != 0)
        words = torch.zeros(codes.shape[0], codes.shape[1], 2, dtype=torch.int64, device=w.device)
        for word, inp, bit, pos in _PAIR_BITS:
            words[:, :, word] |= ((codes[:, :, inp] >> bit) & 1).to(torch.int64) << pos
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        out[r0 : r0 + rows_per_chunk] = words.reshape(codes.shape[0], -1).view(torch.uint8)
    return out.reshape(weight.shape), new_s.reshape(scale.shape)


def unrelayout_nvfp4(weight: torch.Tensor, scale: torch.Tensor):
    """relayout_nvfp4's inverse: the checkpoint layout (uint8 codes, float8_e4m3fn scales)."""
    k2 = weight.shape[-1]
    words = weight.reshape(-1, k2).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = words.reshape(words.shape[0], -1, 2)
    codes = torch.zeros(words.shape[0], words.shape[1], 16, dtype=torch.int64, device=weight.device)
    for word, inp, bit, pos in _PAIR_BITS:
        codes[:, :, inp] |= ((words[:, :, word] >> pos) & 1) << bit
    codes = codes.reshape(codes.shape[0], -1, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    back = _SCALE_BACK.to(scale.device)[scale.reshape(-1).long()].view(torch.float8_e4m3fn)
    return packed.reshape(weight.shape), back.reshape(scale.shape)


# Tiles of the tiled layout (tile_nvfp4): rows x inputs, each tile's codes one contiguous 2 KB run
# (and its scales one 256-byte run), so that a kernel's K block of 16 rows is one burst of memory
# instead of 16 runs of 128 bytes a whole row apart.
TILE_ROWS = 16
TILE_K = 256


def _tiles(t: torch.Tensor, per_tile_row: int, inverse: bool, groups_per_chunk: int) -> torch.Tensor:
    """[..., R, n] (n bytes a row) with R % TILE_ROWS == 0 -> the same bytes with each group of
    TILE_ROWS rows stored tile by tile along the row (per_tile_row bytes of a row per tile), or back.
    A chunk of row groups at a time bounds the temporary copy."""
    rows, n = t.shape[-2], t.shape[-1]
    if rows % TILE_ROWS or n % per_tile_row:
        raise ValueError(f"{tuple(t.shape)} is not whole tiles of {TILE_ROWS} rows x {per_tile_row} bytes")
    tiles = n // per_tile_row
    # [groups, rows, tiles, bytes] -> [groups, tiles, rows, bytes], or back.
    groups = t.reshape(-1, tiles, TILE_ROWS, per_tile_row) if inverse else t.reshape(-1, TILE_ROWS, tiles, per_tile_row)
    out = torch.empty_like(t).reshape(-1, TILE_ROWS * n)
    for g0 in range(0, groups.shape[0], groups_per_chunk):
        out[g0 : g0 + groups_per_chunk] = groups[g0 : g0 + groups_per_chunk].transpose(1, 2).reshape(-1, TILE_ROWS * n)
    return out.reshape(t.shape)


def tile_nvfp4(weight: torch.Tensor, scale: torch.Tensor, groups_per_chunk: int = 4096):
    """relayout_nvfp4's output (uint8 [..., R, K/2] codes, uint8 [..., R, K/16] scales, R a multiple
    of TILE_ROWS and K of TILE_K) -> the same bytes in tiles of TILE_ROWS rows x TILE_K inputs
    (kernels' relayout=True, tiled=True): row group g's tile t holds its rows' inputs
    t*TILE_K .. (t+1)*TILE_K, row after row; tiles of a group in K order, groups in row order.
    Shapes are unchanged (a row index no longer names one row's bytes). New tensors."""
    return (
        _tiles(weight, TILE_K // 2, False, groups_per_chunk),
        _tiles(scale, TILE_K // 16, False, groups_per_chunk),
    )


def untile_nvfp4(weight: torch.Tensor, scale: torch.Tensor, groups_per_chunk: int = 4096):
    """tile_nvfp4's inverse."""
    return _tiles(weight, TILE_K // 2, True, groups_per_chunk), _tiles(scale, TILE_K // 16, True, groups_per_chunk)
