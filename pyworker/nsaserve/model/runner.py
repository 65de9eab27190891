"""ModelRunner: loads the model and its KV pool on one tensor-parallel rank and runs steps.

The worker hands each plan to forward_plan() (or builds a ForwardBatch and calls forward()); this
returns float32 logits for the plan's logit rows, over the full vocabulary, identical on every rank.
Under data-parallel attention only forward_plan() serves: each rank picks its own requests from
the combined plan (model/dp_attention.py).
"""

from __future__ import annotations

import os

import torch

from ..protocol.messages import Plan
from ..worker.batch import ForwardBatch, build_forward_batch
from .config import SUPPORTED, load_config
from .dp_attention import DPStep
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
        dp_attention: bool = False,
        dense_prefill: bool = False,
    ):
        """load_format: "safetensors" reads the checkpoint in model_path; "random" draws every
        weight on `device` with the GLM-5-shaped generator (seed 0) for model_path's config, which
        equals the checkpoint that generator would write, with nothing read but the config
        (weight_source.py; for benchmarks at depths whose checkpoint would not fit a disk).

        dp_attention: data-parallel attention over the tp_size ranks (SGLang's, dp size = tp size):
        every rank holds the whole attention and its own pool of num_pages pages, and runs attention
        on the requests whose pages it owns (global pages [rank * num_pages, (rank + 1) * num_pages));
        MLPs, experts and lm_head stay split as without it.

        dense_prefill: dense attention for prompt steps whose contexts all fit the top-k
        (model/dense_prefill.py); the worker's --dense-prefill decides it (dense_prefill_on)."""
        check_kv_cache_dtype(kv_cache_dtype)
        self.device = torch.device(device)
        self.config = load_config(model_path)
        cfg = self.config
        self.dtype = dtype or cfg.torch_dtype
        self.tp = TPGroup(tp_rank, tp_size)
        if dp_attention and tp_size < 2:
            raise ValueError("data-parallel attention needs tp_size >= 2")
        self.dp_attention = dp_attention
        self.dp_size = tp_size if dp_attention else 1  # ranks the router's page id space spans
        self.model_id = os.path.basename(os.path.normpath(model_path))
        self.architecture = SUPPORTED[cfg.model_type]
        self.vocab_size = cfg.vocab_size
        self.max_context = cfg.max_position_embeddings
        self.page_size = page_size
        self.kv_cache_dtype = kv_cache_dtype

        self.model = CausalLM(cfg, self.tp, dtype=self.dtype, device=self.device, dp_attention=dp_attention)
        self.model.dense_prefill = dense_prefill
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
        from ..kernels.router_logits import TAKES_SPLIT

        name = resolve(kind, name, self.device.type, self.dtype.itemsize * 8)
        get_backend(kind, name)  # fails now, not mid-step, when the name is unknown
        self.model.backends[kind] = name
        if kind == "moe_experts" and name == "triton":
            self._experts_to_kernel_layout()
        if kind == "router_logits" and name in TAKES_SPLIT:  # at load, like the experts' layout
            for layer in self.model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.split_weight()

    def _experts_to_kernel_layout(self) -> None:
        """The Triton MoE reads NVFP4 stacks re-laid out for it: done here, once, at load, so that
        no forward pays (or synchronises for) it and no CUDA graph capture meets it."""
        from ..kernels.triton_moe_w4a16 import stacks_to_kernel_layout

        for layer in self.model.model.layers:
            w13, w2 = getattr(layer.mlp, "w13", None), getattr(layer.mlp, "w2", None)
            if w13 is not None and w2 is not None and hasattr(w13, "to_kernel_layout"):
                stacks_to_kernel_layout(w13, w2)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, float_logits: bool = True, logits_out=None) -> torch.Tensor:
        """logits_out: see model.forward."""
        if self.dp_attention:
            raise RuntimeError("with data-parallel attention a step needs its whole plan: use forward_plan")
        if batch.page_size != self.page_size:
            raise ValueError(f"plan page_size {batch.page_size} != pool page_size {self.page_size}")
        return self.model(batch, self.pool, float_logits=float_logits, logits_out=logits_out)

    @torch.no_grad()
    def forward_plan(self, plan: Plan, patch=None) -> torch.Tensor:
        """One validated plan -> the logits of its logit rows, in plan order, on every rank. Under
        data-parallel attention the plan is the combined one (global page ids and slots); this rank
        runs attention on its own requests and every collective of the step. patch: input tokens
        already on the device (worker/batch.InputPatch, indexing the plan's input_ids; under
        data-parallel attention each rank applies the part of its own requests)."""
        if not self.dp_attention:
            return self.forward(build_forward_batch(plan, self.device, patch))
        if plan.page_size != self.page_size:
            raise ValueError(f"plan page_size {plan.page_size} != pool page_size {self.page_size}")
        dp = DPStep.from_plan(plan, self.tp, self.num_pages, self.device)
        batch = None
        if dp.local_plan.num_reqs:
            local_patch = patch.for_requests(plan, dp.mine) if patch is not None else None
            batch = build_forward_batch(dp.local_plan, self.device, local_patch)
        return self.model(batch, self.pool, dp)
