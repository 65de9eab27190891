"""ModelRunner: loads the model and its KV pool on one tensor-parallel rank and runs steps.

The worker builds a ForwardBatch from each plan and calls forward(); this returns float32 logits
for batch.logits_index rows, over the full vocabulary, identical on every rank.
"""

from __future__ import annotations

import os

import torch

from ..worker.batch import ForwardBatch
from .config import SUPPORTED, load_config
from .kv_pool import KVPool, bytes_per_slot, check_kv_cache_dtype
from .loader import load_weights
from .model import CausalLM
from .parallel import TPGroup
from .weight_source import open_weight_source


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        device: torch.device,
        dtype: torch.dtype | None,
        kv_cache_dtype: str = "auto",
        num_pages: int | None,
        page_size: int = 64,
        mem_fraction_static: float = 0.85,
        tp_rank: int = 0,
        tp_size: int = 1,
        show_progress: bool = True,
        load_format: str = "safetensors",
    ):
        """load_format: "safetensors" reads the checkpoint in model_path; "random" draws every
        weight on `device` with the GLM-5-shaped generator (seed 0) for model_path's config, which
        equals the checkpoint that generator would write, with nothing read but the config
        (weight_source.py; for benchmarks at depths whose checkpoint would not fit a disk)."""
        check_kv_cache_dtype(kv_cache_dtype)
        self.device = torch.device(device)
        self.config = load_config(model_path)
        cfg = self.config
        self.dtype = dtype or cfg.torch_dtype
        self.tp = TPGroup(tp_rank, tp_size)
        self.model_id = os.path.basename(os.path.normpath(model_path))
        self.architecture = SUPPORTED[cfg.model_type]
        self.vocab_size = cfg.vocab_size
        self.max_context = cfg.max_position_embeddings
        self.page_size = page_size
        self.kv_cache_dtype = kv_cache_dtype

        self.model = CausalLM(cfg, self.tp, dtype=self.dtype, device=self.device)
        source = open_weight_source(load_format, model_path, cfg, self.device)
        load_weights(self.model, source=source, show_progress=show_progress and tp_rank == 0)
        self.model.eval()

        if num_pages is None:
            num_pages = self._pages_from_free_memory(mem_fraction_static)
        self.num_pages = num_pages
        self.pool = KVPool(
            cfg, num_pages=num_pages, page_size=page_size, kv_cache_dtype=kv_cache_dtype,
            dtype=self.dtype, device=self.device,
        )  # fmt: skip

    def _pages_from_free_memory(self, mem_fraction_static: float) -> int:
        """Pages that fit in what is left of mem_fraction_static * total after the weights
        (the fraction covers weights + KV; the rest is for activations)."""
        if self.device.type != "cuda":
            raise ValueError("num_pages must be given when not running on CUDA")
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - (1.0 - mem_fraction_static) * total
        page_bytes = bytes_per_slot(self.config, self.kv_cache_dtype, self.dtype) * self.page_size
        pages = int(budget // page_bytes)
        if self.tp.size > 1:
            # Every rank must size the pool identically: the router addresses pages by id.
            t = torch.tensor([pages], device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            pages = int(t.item())
        if pages <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB "
                f"with mem_fraction_static={mem_fraction_static}"
            )
        return pages

    def set_backend(self, kind: str, name: str) -> None:
        """Pick a registered kernel backend for one kernel kind (see kernels.registry); "auto"
        picks the one preferred on this device."""
        from ..kernels.registry import get_backend, resolve

        name = resolve(kind, name, self.device.type, self.dtype.itemsize * 8)
        get_backend(kind, name)  # fails now, not mid-step, when the name is unknown
        self.model.backends[kind] = name
        if kind == "moe_experts" and name == "triton":
            self._experts_to_kernel_layout()

    def _experts_to_kernel_layout(self) -> None:
        """The Triton MoE reads NVFP4 stacks re-laid out for it: done here, once, at load, so that
        no forward pays (or synchronises for) it and no CUDA graph capture meets it."""
        from ..kernels.triton_moe_w4a16 import RELAYOUT_STACKS

        if not RELAYOUT_STACKS:
            return
        for layer in self.model.model.layers:
            for stack in (getattr(layer.mlp, "w13", None), getattr(layer.mlp, "w2", None)):
                if stack is not None and hasattr(stack, "to_kernel_layout"):
                    stack.to_kernel_layout()

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.page_size != self.page_size:
            raise ValueError(f"plan page_size {batch.page_size} != pool page_size {self.page_size}")
        return self.model(batch, self.pool)
