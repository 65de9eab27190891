"""The paged KV pool: per layer, the MLA latent cache and (for layers with an indexer) its key cache.

A slot id (page * page_size + offset) addresses both, in every layer, so pages move as one unit.
Byte layouts are defined in kernels.kv_cache_format ("auto" = model dtype, "fp8_e4m3" = FlashMLA's
latent row + DeepGEMM's paged index-key layout).
"""

from __future__ import annotations

import torch

from ..kernels import kv_cache_format as fmt
from ..kernels.small_ops import index_key_store_torch

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def check_kv_cache_dtype(kv_cache_dtype: str) -> bool:
    """-> True for fp8."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return kv_cache_dtype == "fp8_e4m3"


def bytes_per_slot(config, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    """Bytes one slot costs across all layers (for sizing the pool from free memory)."""
    fp8 = check_kv_cache_dtype(kv_cache_dtype)
    elem = torch.finfo(dtype).bits // 8
    r, p, d = config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim
    latent = fmt.latent_fp8_row_bytes(r, p) if fp8 else (r + p) * elem
    index = (d + 4) if fp8 else d * elem
    n_full = sum(t == "full" for t in config.indexer_types)
    return config.num_hidden_layers * latent + n_full * index


class KVPool:
    def __init__(self, config, *, num_pages: int, page_size: int, kv_cache_dtype: str, dtype, device):
        fp8 = check_kv_cache_dtype(kv_cache_dtype)
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"need num_pages > 0 and page_size > 0, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.num_slots = num_pages * page_size
        self.kv_lora_rank = config.kv_lora_rank
        self.fp8 = fp8
        # One page beyond those the router hands out: padded rows of a CUDA-graph batch write
        # their KV here, and positions past a request's end point here (worker/cuda_graphs.py).
        self.scratch_page = num_pages
        self.latent = [
            fmt.alloc_latent(
                self.num_slots + page_size, config.kv_lora_rank, config.qk_rope_head_dim, fp8, dtype, device
            )
            for _ in range(config.num_hidden_layers)
        ]
        self.index_k = [
            fmt.alloc_index_k(num_pages + 1, page_size, config.index_head_dim, fp8, dtype, device)
            if kind == "full"
            else None
            for kind in config.indexer_types
        ]

    def write_latent(self, layer: int, slots: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        fmt.write_latent(self.latent[layer], slots, c, k_pe)

    # `store` is an "index_key_store" kernel backend (kernels.small_ops); the default is the torch
    # reference. (The latent store goes through the "kv_store" backend, which also norms and ropes.)
    # prep: k is wk's output, to be normalised, roped and (fp8) rotated first (small_ops.IndexKeyPrep).
    def write_index_k(self, layer: int, slots: torch.Tensor, k: torch.Tensor, store=None, prep=None) -> None:
        (store or index_key_store_torch)(self.index_k[layer], slots, k, self.page_size, prep=prep)
