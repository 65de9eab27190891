"""Byte layouts of the paged KV cache, and the only code that reads or writes them.

A KV slot (page * page_size + offset) holds, per layer, the MLA latent and the indexer key.

MLA latent, one row per slot:
- "auto" (model dtype): [num_slots, R + P] = normalised latent c (R = kv_lora_rank) | roped k_pe (P).
- fp8: [num_slots, R + 4 * R/G + 2 * P] uint8 with G = 128 (or R if smaller):
  R float8_e4m3fn codes | R/G float32 scales (one per G-group) | P bfloat16 k_pe (not quantised).
  For GLM-5 / DeepSeek-V3.2 (R = 512, P = 64) that is FlashMLA's 656-byte row.

Indexer key (D = index_head_dim):
- "auto": [num_slots, D] in the model dtype.
- fp8: DeepGEMM's paged layout, uint8 [num_pages, page_size, D + 4] whose bytes per page are
  page_size rows of D e4m3 codes, then page_size float32 scales (one per key); a key's D + 4
  bytes are therefore not contiguous.

These are the byte layouts of kernels.quant.mla_kv_fp8 / indexer_k_fp8 (which fix R = 512,
P = 64, D = 128); this module also serves the small dims of test models.

Scales: the latent's are powers of two, 2^ceil(log2(max(amax / 448, 1e-4))) ("ue8m0" in
kernels.quant.fp8, as FlashMLA's quantiser writes this row), so that the sparse MLA kernels
dequantise by bit operations and exact bf16 multiplies (gluon_sparse_mla._E4M3_BF16_ASM). The
indexer key's are amax / 448 (at least 1e-10). Either way every element is representable
(448 = e4m3's largest finite value).
"""

from __future__ import annotations

import torch

from .quant.fp8 import fp8_scale_from_amax

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest scale, so that an all-zero group does not divide by zero.
_MIN_SCALE = 1e-10


def latent_group(kv_lora_rank: int) -> int:
    g = min(128, kv_lora_rank)
    if kv_lora_rank % g:
        raise ValueError(f"fp8 KV cache needs kv_lora_rank divisible by {g}, got {kv_lora_rank}")
    return g


def latent_fp8_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    return kv_lora_rank + 4 * (kv_lora_rank // latent_group(kv_lora_rank)) + 2 * rope_dim


def _quant_groups(x: torch.Tensor, group: int, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] -> (e4m3 codes as uint8 [N, K], float32 scales [N, K/group]); pow2: "ue8m0" scales."""
    n, k = x.shape
    xg = x.float().view(n, k // group, group)
    amax = xg.abs().amax(-1)
    scale = fp8_scale_from_amax(amax, "ue8m0") if pow2 else (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    codes = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8).view(n, k)
    return codes, scale


def _dequant_groups(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    n, k = codes.shape
    vals = codes.view(FP8).float().view(n, k // group, group) * scale[..., None]
    return vals.view(n, k)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as uint8 [N, bytes per row]."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], -1)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.contiguous().view(dtype)


# ---- MLA latent ---------------------------------------------------------------------------------


def alloc_latent(num_slots, kv_lora_rank, rope_dim, fp8: bool, dtype, device) -> torch.Tensor:
    if fp8:
        return torch.zeros(num_slots, latent_fp8_row_bytes(kv_lora_rank, rope_dim), dtype=torch.uint8, device=device)
    return torch.zeros(num_slots, kv_lora_rank + rope_dim, dtype=dtype, device=device)


def pack_latent_fp8(c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """c [N, R], k_pe [N, P] -> uint8 rows [N, latent_fp8_row_bytes]."""
    codes, scale = _quant_groups(c, latent_group(c.shape[1]), pow2=True)
    return torch.cat((codes, _bytes(scale), _bytes(k_pe.to(torch.bfloat16))), dim=1)


def unpack_latent_fp8(rows: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 rows -> (c float32 [N, R], k_pe float32 [N, P])."""
    g = latent_group(kv_lora_rank)
    ns = kv_lora_rank // g
    codes = rows[:, :kv_lora_rank]
    scale = _from_bytes(rows[:, kv_lora_rank : kv_lora_rank + 4 * ns], torch.float32)
    k_pe = _from_bytes(rows[:, kv_lora_rank + 4 * ns :], torch.bfloat16).float()
    return _dequant_groups(codes, scale, g), k_pe


def write_latent(cache: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> None:
    if cache.dtype == torch.uint8:
        cache[slots] = pack_latent_fp8(c, k_pe)
    else:
        cache[slots] = torch.cat((c, k_pe), dim=1).to(cache.dtype)


def gather_latent(cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows at `slots` (any shape, all valid) -> (c, k_pe) float32 with slots' shape + [R] / [P]."""
    flat = slots.reshape(-1)
    if cache.dtype == torch.uint8:
        c, k_pe = unpack_latent_fp8(cache[flat], kv_lora_rank)
    else:
        rows = cache[flat].float()
        c, k_pe = rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]
    return c.view(*slots.shape, -1), k_pe.view(*slots.shape, -1)


# ---- indexer key --------------------------------------------------------------------------------


def alloc_index_k(num_pages, page_size, dim, fp8: bool, dtype, device) -> torch.Tensor:
    if fp8:
        return torch.zeros(num_pages, page_size, dim + 4, dtype=torch.uint8, device=device)
    return torch.zeros(num_pages * page_size, dim, dtype=dtype, device=device)


def _index_regions(cache: torch.Tensor):
    """(codes [pages, page_size, D] uint8, scale bytes [pages, page_size, 4]) views of the fp8
    paged layout."""
    num_pages, page_size, row = cache.shape
    dim = row - 4
    flat = cache.view(num_pages, page_size * row)
    codes = flat[:, : page_size * dim].view(num_pages, page_size, dim)
    scales = flat[:, page_size * dim :].view(num_pages, page_size, 4)
    return codes, scales, dim


def write_index_k(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    if cache.dtype != torch.uint8:
        cache[slots] = k.to(cache.dtype)
        return
    codes_part, scale_part, dim = _index_regions(cache)
    codes, scale = _quant_groups(k, dim)
    page, off = slots // page_size, slots % page_size
    codes_part[page, off] = codes
    scale_part[page, off] = _bytes(scale)


def gather_index_k(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Keys at `slots` [N] -> float32 [N, D]."""
    if cache.dtype != torch.uint8:
        return cache[slots].float()
    codes_part, scale_part, dim = _index_regions(cache)
    page, off = slots // page_size, slots % page_size
    scale = _from_bytes(scale_part[page, off], torch.float32)
    return _dequant_groups(codes_part[page, off], scale, dim)
