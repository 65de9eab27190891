"""Linear layers whose weights stay quantised in memory: NVFP4 (W4A16) and 128x128 block FP8.

forward() dequantises the weight to the compute dtype and multiplies in that dtype (the torch
reference; a fused kernel replaces dense_weight() + F.linear without changing what is stored).
Parameter names are the checkpoint's (weight, weight_scale, weight_scale_2 / weight_scale_inv), so
the loader maps names one to one. NVFP4's input_scale is listed in IGNORED_SUFFIXES: the loader
accepts it when present and reads past it (it only matters to W4A4 kernels).

Tensor-parallel slices (shard_dim as in linear.Linear) are taken from the packed tensors directly
when the split lands on the format's scale-group boundaries:
- NVFP4: output rows split anywhere (weight_scale has one row per output row); input columns split
  on multiples of 16 inputs = 8 packed bytes = one weight_scale column.
- FP8 block: rows and columns on multiples of 128 (one weight_scale_inv entry per 128x128 block).
In both, the tensor's end counts as a boundary (the last block may be partial).
A split off those boundaries is not refused: quantized_linear() then builds the module whole, and
after loading it is dequantised once and replaced by a dense Linear holding only this rank's slice
(see slice_after_load). That costs the memory saving of that module on that rank; real models split
on boundaries (their per-rank head and intermediate sizes are multiples of 128), tiny ones may not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.quant import FP8_BLOCK, NVFP4, dequantize_fp8_block, dequantize_nvfp4, module_tensors
from ..kernels.quant.fp8_block import FP8_BLOCK as FP8_BLOCK_SIZE
from ..kernels.quant.nvfp4 import NVFP4_GROUP_SIZE
from .linear import Linear, empty_param


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _on_boundaries(total: int, start: int, length: int, group: int) -> bool:
    return start % group == 0 and (length % group == 0 or start + length == total)


def _group_shard(dim: int, start: int, length: int, group: int) -> tuple[int, int, int]:
    """The slice of a per-`group` scale tensor that covers elements [start, start + length)."""
    return dim, start // group, _ceil_div(length, group)


class QuantLinear(nn.Module, ABC):
    """Common part: the shape bookkeeping of a (possibly sliced) quantised Linear."""

    PRECISION: str
    ROW_GROUP: int  # output rows per scale entry
    COL_GROUP: int  # input columns per scale entry
    IGNORED_SUFFIXES = ()

    # (shard_dim, start, length) to keep after loading when this rank's split is off the scale-group
    # boundaries; the module then holds the whole tensor until the loader calls to_dense_slice().
    slice_after_load: tuple[int, int, int] | None = None

    def __init__(self, in_features, out_features, *, dtype, device, shard_dim=None, start=0, length=None):
        super().__init__()
        self.dtype = dtype
        self.in_features, self.out_features = in_features, out_features
        self.rows, self.cols = out_features, in_features
        if shard_dim == 0:
            self.rows = length
        elif shard_dim == 1:
            self.cols = length
        self.shard = None if shard_dim is None else (shard_dim, start, length)
        self._allocate(device)

    @classmethod
    def slice_on_boundaries(cls, in_features, out_features, shard_dim, start, length) -> bool:
        total = (out_features, in_features)[shard_dim]
        group = (cls.ROW_GROUP, cls.COL_GROUP)[shard_dim]
        return _on_boundaries(total, start, length, group)

    @abstractmethod
    def _allocate(self, device) -> None:
        """Create the format's parameters for [self.rows, self.cols], with their tp_shard."""

    @abstractmethod
    def dense_weight(self) -> torch.Tensor:
        """W [rows, cols] dequantised to self.dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.dtype), self.dense_weight())

    def to_dense_slice(self) -> Linear:
        """This rank's slice of the dequantised weight as a dense Linear (see slice_after_load)."""
        dim, start, length = self.slice_after_load
        dense = Linear(
            self.in_features, self.out_features, dtype=self.dtype, device=self.weight.device,
            shard_dim=dim, start=start, length=length,
        )  # fmt: skip
        dense.weight.data.copy_(self.dense_weight().narrow(dim, start, length))
        return dense


class Nvfp4Linear(QuantLinear):
    """weight uint8 [out, in/2] (low nibble = even input), weight_scale e4m3 [out, in/16],
    weight_scale_2 fp32 scalar."""

    PRECISION = NVFP4
    ROW_GROUP, COL_GROUP = 1, NVFP4_GROUP_SIZE
    IGNORED_SUFFIXES = module_tensors(NVFP4)[1]

    def _allocate(self, device) -> None:
        if self.in_features % NVFP4_GROUP_SIZE:
            raise ValueError(f"NVFP4 needs in_features divisible by {NVFP4_GROUP_SIZE}, got {self.in_features}")
        w_shard = s_shard = self.shard
        if self.shard is not None and self.shard[0] == 1:
            _, start, length = self.shard
            w_shard = (1, start // 2, length // 2)  # two e2m1 codes per byte
            s_shard = _group_shard(1, start, length, NVFP4_GROUP_SIZE)
        self.weight = empty_param([self.rows, self.cols // 2], torch.uint8, device, w_shard)
        self.weight_scale = empty_param(
            [self.rows, self.cols // NVFP4_GROUP_SIZE], torch.float8_e4m3fn, device, s_shard
        )
        self.weight_scale_2 = empty_param([], torch.float32, device)

    def dense_weight(self) -> torch.Tensor:
        return dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, self.dtype)


class Fp8BlockLinear(QuantLinear):
    """weight e4m3 [out, in], weight_scale_inv fp32 [ceil(out/128), ceil(in/128)] (multiplies)."""

    PRECISION = FP8_BLOCK
    ROW_GROUP = COL_GROUP = FP8_BLOCK_SIZE

    def _allocate(self, device) -> None:
        s_shard = None
        if self.shard is not None:
            s_shard = _group_shard(*self.shard, FP8_BLOCK_SIZE)
        self.weight = empty_param([self.rows, self.cols], torch.float8_e4m3fn, device, self.shard)
        self.weight_scale_inv = empty_param(
            [_ceil_div(self.rows, FP8_BLOCK_SIZE), _ceil_div(self.cols, FP8_BLOCK_SIZE)], torch.float32, device, s_shard
        )

    def dense_weight(self) -> torch.Tensor:
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.dtype)


QUANT_LINEARS = {NVFP4: Nvfp4Linear, FP8_BLOCK: Fp8BlockLinear}


def quantized_linear(
    precision: str, in_features, out_features, *, dtype, device, shard_dim=None, start=0, length=None
) -> QuantLinear:
    """The quantised Linear for `precision`, sliced in its packed form when the split allows it,
    otherwise whole with slice_after_load set (see the module docstring)."""
    cls = QUANT_LINEARS[precision]
    if shard_dim is None or cls.slice_on_boundaries(in_features, out_features, shard_dim, start, length):
        return cls(
            in_features, out_features, dtype=dtype, device=device, shard_dim=shard_dim, start=start, length=length
        )
    module = cls(in_features, out_features, dtype=dtype, device=device)
    module.slice_after_load = (shard_dim, start, length)
    return module
