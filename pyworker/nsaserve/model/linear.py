"""Weight holders that know which slice of the checkpoint tensor they hold.

`tp_shard = (dim, start, length)` names this rank's slice of the checkpoint tensor along `dim`
(PyTorch layout [out, in]); the loader reads exactly that slice. Quantised weights (NVFP4,
block FP8) live in quant_linear.py with the same interface: forward(x) and dense_weight().
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def empty_param(shape, dtype, device, shard: tuple[int, int, int] | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.tp_shard = shard
    return p


class Linear(nn.Module):
    """y = x W^T, W [out, in]; `shard_dim` 0 splits outputs (column parallel), 1 inputs (row parallel)."""

    def __init__(self, in_features, out_features, *, dtype, device, shard_dim=None, start=0, length=None):
        super().__init__()
        shape = [out_features, in_features]
        shard = None
        if shard_dim is not None:
            shard = (shard_dim, start, length)
            shape[shard_dim] = length
        self.weight = empty_param(shape, dtype, device, shard)

    def dense_weight(self) -> torch.Tensor:
        """W [out, in] in the compute dtype (callers that need the matrix itself, e.g. MLA absorption)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


def stacked_weight(stacked: torch.Tensor | None, *linears: Linear) -> torch.Tensor:
    """The weights of `linears` (plain Linears of one dtype and input width) stacked along the
    output dim, for one GEMM where there were several. Made on first use (after loading) and then
    returned as long as it is still what the modules hold: the modules' weights become views of
    it, so it costs no memory and in-place writes to either side (the loader's copies) show in
    both. If a module's weight was replaced since, it is stacked again."""
    first = linears[0].weight
    if stacked is not None and first.data_ptr() == stacked.data_ptr():
        return stacked
    stacked = torch.cat([m.weight.detach() for m in linears])
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = stacked[row : row + n]
        row += n
    return stacked


class Norm(nn.Module):
    """A norm's replicated weight (and bias for LayerNorm); the math lives in kernels.norms."""

    def __init__(self, dim, *, dtype, device, bias=False):
        super().__init__()
        self.weight = empty_param([dim], dtype, device)
        if bias:
            self.bias = empty_param([dim], dtype, device)
