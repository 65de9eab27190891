"""FP8 lightning-indexer key cache in DeepGEMM's paged layout (132 bytes per token).

Each token's key (128 values, after the indexer's LayerNorm, RoPE and, where the model applies it,
the Hadamard rotation) is stored as 128 x float8_e4m3fn plus one float32 scale:

    key[i] = float(e4m3[i]) * scale

Within a page of ``page_size`` tokens (DeepGEMM ``fp8_paged_mqa_logits`` uses 64) the values of all
tokens come first, then all scales:

    page bytes [0, 128 * page_size)                   token t's values at 128 t
    page bytes [128 * page_size, 132 * page_size)     token t's float32 scale at 128 * page_size + 4 t

The cache tensor is uint8 [pages, page_size, 132] (the shape DeepGEMM takes; note that a token's
132 bytes are not contiguous). Slot s lives in page s // page_size at offset s % page_size.
Scales are powers of two by default (DeepSeek-V3.2 ``scale_fmt = "ue8m0"``); ``scale_fmt="float"``
gives amax / 448.
"""

import torch

from .fp8 import fp8_scale_from_amax, to_e4m3

INDEXER_K_DIM = 128
INDEXER_K_BYTES = INDEXER_K_DIM + 4  # 132


def encode_indexer_k(k: torch.Tensor, scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [N, 128] to (values float8_e4m3fn [N, 128], scales float32 [N])."""
    if k.shape[-1] != INDEXER_K_DIM:
        raise ValueError(f"expected indexer keys [..., {INDEXER_K_DIM}], got {tuple(k.shape)}")
    scale = fp8_scale_from_amax(k.float().abs().amax(dim=-1), scale_fmt)
    return to_e4m3(k, scale.unsqueeze(-1)), scale


def _regions(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the cache as values [pages, page_size, 128] and scale bytes [pages, page_size, 4]."""
    if (
        cache.dtype != torch.uint8
        or cache.dim() != 3
        or cache.shape[-1] != INDEXER_K_BYTES
        or not cache.is_contiguous()
    ):
        raise ValueError(
            f"indexer cache must be contiguous uint8 [pages, page_size, {INDEXER_K_BYTES}], got {cache.dtype} {tuple(cache.shape)}"
        )
    pages, page_size, _ = cache.shape
    flat = cache.view(pages, page_size * INDEXER_K_BYTES)
    values = flat[:, : page_size * INDEXER_K_DIM].view(pages, page_size, INDEXER_K_DIM)
    scales = flat[:, page_size * INDEXER_K_DIM :].view(pages, page_size, 4)
    return values, scales


def write_indexer_k(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, scale_fmt: str = "ue8m0") -> None:
    """Quantise keys [N, 128] and store them at ``slots`` (int [N]) of ``cache``, in place."""
    values_region, scales_region = _regions(cache)
    page_size = cache.shape[1]
    slots = slots.long()
    page, offset = slots // page_size, slots % page_size
    values, scale = encode_indexer_k(k, scale_fmt)
    values_region[page, offset] = values.view(torch.uint8)
    scales_region[page, offset] = scale.contiguous().view(torch.uint8).view(-1, 4)


def read_indexer_k(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float8_e4m3fn [N, 128], scales float32 [N]) of the keys at ``slots``.

    The dequantised key is ``values.float() * scales[:, None]``; the FP8 indexer score uses the two
    parts separately.
    """
    values_region, scales_region = _regions(cache)
    page_size = cache.shape[1]
    slots = slots.long()
    page, offset = slots // page_size, slots % page_size
    values = values_region[page, offset].view(torch.float8_e4m3fn)
    scale = scales_region[page, offset].contiguous().view(torch.float32).reshape(-1)
    return values, scale
