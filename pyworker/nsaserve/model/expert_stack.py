"""The routed experts this rank owns, stacked into one tensor set per projection group, in the
checkpoint's precision: w13 = [gate_proj rows; up_proj rows], w2 = [down_proj rows].

Expert parallel: a rank holds whole experts, so nothing inside an expert is ever sliced. Layouts
(E = local experts, R = rows of one part, P = parts in the group: 2 for w13, 1 for w2):

    bf16       weight [E, P*R, in]
    nvfp4      weight uint8 [E, P*R, in/2], weight_scale e4m3 [E, P*R, in/16],
               weight_scale_2 fp32 [E, P]   (gate and up keep their own global scale: exports
               usually share one, but nothing in the format requires it)
    fp8_block  weight e4m3 [E, P*R, in], weight_scale_inv fp32 [E, P, ceil(R/128), ceil(in/128)]
               (block scales per part: when R is not a multiple of 128, gate's last row block and
               up's first one are different blocks on disk and must stay so)

dense(local_ids) dequantises only the listed experts -> [n, P*R, in] in the compute dtype; the
MoE calls it for the experts that received tokens, a bounded number at a time.

NVFP4 stacks can be re-laid out in place for the W4A16 MoE kernel (to_kernel_layout, see
quant.nvfp4.relayout_nvfp4: the same bytes, codes in another order within each 16-input group and
scales re-encoded; "tiled" then also stores each 16 rows x 256 inputs contiguously,
quant.nvfp4.tile_nvfp4); dense() reads every layout, so the torch reference stays exact.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.quant import BF16, FP8_BLOCK, NVFP4, dequantize_fp8_block, dequantize_nvfp4, module_tensors
from ..kernels.quant.fp8_block import FP8_BLOCK as FP8_BLOCK_SIZE
from ..kernels.quant.nvfp4 import (
    NVFP4_GROUP_SIZE,
    TILE_K,
    TILE_ROWS,
    relayout_nvfp4,
    tile_nvfp4,
    unrelayout_nvfp4,
    untile_nvfp4,
)
from .linear import empty_param


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# Layouts of an NVFP4 stack's bytes (kernel_layout): as on disk, re-laid out for the W4A16 kernel,
# or re-laid out and then tiled.
CHECKPOINT, RELAYOUT, TILED = "checkpoint", "relayout", "tiled"


class ExpertStack(nn.Module):
    """Stacked expert weights of one projection group; see the module docstring for the layouts."""

    def __init__(self, precision: str, parts: tuple[str, ...], rows: int, in_features: int, num_local: int, *,
                 dtype, device, num_experts: int | None = None):  # fmt: skip
        super().__init__()
        self.precision, self.parts, self.rows, self.in_features = precision, parts, rows, in_features
        self.dtype = dtype
        # The layer's routed experts on all ranks (num_local of them here): kernels size their
        # blocks by the rows a local expert can expect.
        self.num_experts = num_experts or num_local
        self.kernel_layout = CHECKPOINT  # or RELAYOUT / TILED: NVFP4 bytes re-laid out for the MoE kernel
        out = len(parts) * rows
        if precision == BF16:
            self.weight = empty_param([num_local, out, in_features], dtype, device)
        elif precision == NVFP4:
            if in_features % NVFP4_GROUP_SIZE:
                raise ValueError(f"NVFP4 experts need in_features divisible by {NVFP4_GROUP_SIZE}, got {in_features}")
            self.weight = empty_param([num_local, out, in_features // 2], torch.uint8, device)
            self.weight_scale = empty_param(
                [num_local, out, in_features // NVFP4_GROUP_SIZE], torch.float8_e4m3fn, device
            )
            self.weight_scale_2 = empty_param([num_local, len(parts)], torch.float32, device)
        elif precision == FP8_BLOCK:
            self.weight = empty_param([num_local, out, in_features], torch.float8_e4m3fn, device)
            blocks = [_ceil_div(rows, FP8_BLOCK_SIZE), _ceil_div(in_features, FP8_BLOCK_SIZE)]
            self.weight_scale_inv = empty_param([num_local, len(parts), *blocks], torch.float32, device)
        else:
            raise ValueError(f"unknown expert precision {precision!r}")

    @property
    def quantized(self) -> bool:
        return self.precision != BF16

    def targets(self, expert_prefix: str, local: int | None) -> dict:
        """checkpoint name -> (param, index) for one expert ("...mlp.experts.{e}."), or None for
        each name when another rank owns the expert."""
        out = {}
        for p, part in enumerate(self.parts):
            rows = slice(p * self.rows, (p + 1) * self.rows)
            for suffix in module_tensors(self.precision)[0]:
                param = getattr(self, suffix)
                # Per-part tensors (global scale, block scales) are indexed by part, the others by rows.
                index = (local, p) if suffix in ("weight_scale_2", "weight_scale_inv") else (local, rows)
                out[f"{expert_prefix}{part}.{suffix}"] = None if local is None else (param, index)
        return out

    def ignored(self, expert_prefix: str) -> list[str]:
        """Names that may be present on disk for one expert and are read past (NVFP4 input_scale)."""
        return [f"{expert_prefix}{part}.{s}" for part in self.parts for s in module_tensors(self.precision)[1]]

    def can_tile(self) -> bool:
        """Whether the stack is whole tiles of TILE_ROWS rows (in every part) x TILE_K inputs."""
        return self.precision == NVFP4 and self.rows % TILE_ROWS == 0 and self.in_features % TILE_K == 0

    @torch.no_grad()
    def to_kernel_layout(self, layout: str = RELAYOUT) -> None:
        """Re-lay out NVFP4 codes and block scales in place (layout RELAYOUT or TILED), a few experts
        at a time (no second copy of the stack); nothing to do for other precisions or when the
        stack has left the checkpoint layout already. Not inside a CUDA graph capture (the capture
        would replay it)."""
        if layout not in (RELAYOUT, TILED):
            raise ValueError(f"unknown kernel layout {layout!r}")
        if self.precision != NVFP4 or self.kernel_layout != CHECKPOINT:
            return
        if layout == TILED and not self.can_tile():
            raise ValueError(f"{self.rows} rows x {self.in_features} inputs are not whole {TILE_ROWS} x {TILE_K} tiles")
        if self.weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("re-lay out the NVFP4 experts before capturing a CUDA graph")
        n = self.weight.shape[0]
        step = max(1, 32768 // self.weight.shape[1])  # about 32K rows a call (fewer, larger launches)
        for e in range(0, n, step):
            w, s = relayout_nvfp4(self.weight[e : e + step], self.weight_scale[e : e + step])
            if layout == TILED:
                w, s = tile_nvfp4(w, s)
            self.weight[e : e + step].copy_(w)
            self.weight_scale[e : e + step].view(torch.uint8).copy_(s)
        self.kernel_layout = layout

    def nvfp4_checkpoint_layout(self, local_ids, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and block scales of the listed experts' rows in the checkpoint layout (rows: one
        part's, which in the tiled layout are whole tile rows since can_tile held)."""
        w, s = self.weight[local_ids, rows], self.weight_scale[local_ids, rows]
        if self.kernel_layout == CHECKPOINT:
            return w, s
        s = s.view(torch.uint8)
        if self.kernel_layout == TILED:
            w, s = untile_nvfp4(w, s)
        return unrelayout_nvfp4(w, s)

    def dense(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Weights of the listed local experts, dequantised: [len(local_ids), P*R, in] in self.dtype."""
        if self.precision == BF16:
            return self.weight[local_ids]
        pieces = []
        for p in range(len(self.parts)):
            rows = slice(p * self.rows, (p + 1) * self.rows)
            if self.precision == NVFP4:
                scale_2 = self.weight_scale_2[local_ids, p].view(-1, 1, 1)
                w = dequantize_nvfp4(*self.nvfp4_checkpoint_layout(local_ids, rows), scale_2, self.dtype)
            else:
                w = dequantize_fp8_block(self.weight[local_ids, rows], self.weight_scale_inv[local_ids, p], self.dtype)
            pieces.append(w)
        return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]

    def dense_bytes_per_expert(self) -> int:
        return len(self.parts) * self.rows * self.in_features * torch.empty((), dtype=self.dtype).element_size()
