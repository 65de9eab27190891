"""FP8 MLA latent cache rows in the 656-byte layout FlashMLA's sparse kernels read.

One row per token (slot), 656 bytes:

    bytes [0, 512)    latent c_kv (after kv_a_layernorm), 512 x float8_e4m3fn
    bytes [512, 528)  4 x float32 scales, scale t covers latent[128 t : 128 t + 128]
    bytes [528, 656)  rope part k_pe (after RoPE), 64 x bfloat16, not quantised

    latent[i] = float(e4m3[i]) * scale[i // 128]

Multi-byte fields are in the device's native byte order (little-endian on x86 and NVIDIA GPUs).
Scales are powers of two by default (``ue8m0``: 2^ceil(log2(amax / 448)), at least 1e-4), as in
FlashMLA's reference quantiser; ``scale_fmt="float"`` gives amax / 448 instead.

A cache is any contiguous uint8 tensor whose last dimension is 656 ([slots, 656] or
[pages, page_size, 656]); slot s is row s of its [-1, 656] view, i.e. page s // page_size,
offset s % page_size.
"""

import torch

from .fp8 import fp8_scale_from_amax, to_e4m3

MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64
MLA_SCALE_TILE = 128
_NUM_TILES = MLA_LATENT_DIM // MLA_SCALE_TILE
_SCALES_AT = MLA_LATENT_DIM
_ROPE_AT = _SCALES_AT + 4 * _NUM_TILES
MLA_KV_BYTES = _ROPE_AT + 2 * MLA_ROPE_DIM  # 656


def encode_mla_kv(latent: torch.Tensor, rope: torch.Tensor, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """Latent [N, 512] and rope [N, 64] (any float dtype) to uint8 rows [N, 656]."""
    if latent.shape[-1] != MLA_LATENT_DIM or rope.shape[-1] != MLA_ROPE_DIM or latent.shape[:-1] != rope.shape[:-1]:
        raise ValueError(
            f"expected latent [N, 512] and rope [N, 64], got {tuple(latent.shape)} and {tuple(rope.shape)}"
        )
    tiles = latent.float().reshape(*latent.shape[:-1], _NUM_TILES, MLA_SCALE_TILE)
    scale = fp8_scale_from_amax(tiles.abs().amax(dim=-1), scale_fmt)
    values = to_e4m3(tiles, scale.unsqueeze(-1)).reshape(latent.shape)
    return torch.cat(
        [
            values.view(torch.uint8),
            scale.contiguous().view(torch.uint8),
            rope.to(torch.bfloat16).contiguous().view(torch.uint8),
        ],
        dim=-1,
    )


def decode_mla_kv(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 rows [N, 656] to (latent float32 [N, 512], rope bfloat16 [N, 64])."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != MLA_KV_BYTES:
        raise ValueError(f"expected uint8 rows [..., {MLA_KV_BYTES}], got {rows.dtype} {tuple(rows.shape)}")
    values = rows[..., :_SCALES_AT].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., _SCALES_AT:_ROPE_AT].contiguous().view(torch.float32)
    rope = rows[..., _ROPE_AT:].contiguous().view(torch.bfloat16)
    tiles = values.reshape(*values.shape[:-1], _NUM_TILES, MLA_SCALE_TILE) * scale.unsqueeze(-1)
    return tiles.reshape(values.shape), rope


def _rows_view(cache: torch.Tensor) -> torch.Tensor:
    if cache.dtype != torch.uint8 or cache.shape[-1] != MLA_KV_BYTES or not cache.is_contiguous():
        raise ValueError(
            f"MLA FP8 cache must be contiguous uint8 [..., {MLA_KV_BYTES}], got {cache.dtype} {tuple(cache.shape)}"
        )
    return cache.view(-1, MLA_KV_BYTES)


def write_mla_kv(
    cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, scale_fmt: str = "ue8m0"
) -> None:
    """Quantise N tokens and store them at ``slots`` (int [N]) of ``cache``, in place."""
    _rows_view(cache)[slots.long()] = encode_mla_kv(latent, rope, scale_fmt)


def read_mla_kv(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised (latent float32 [N, 512], rope bfloat16 [N, 64]) of the tokens at ``slots``."""
    return decode_mla_kv(_rows_view(cache)[slots.long()])
