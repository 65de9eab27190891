"""Builds each weight holder in the precision the checkpoint stores it in.

Layers ask by checkpoint module name ("model.layers.3.self_attn.q_a_proj"); the checkpoint's
quantisation scheme (kernels.quant.QuantScheme, from config.json / hf_quant_config.json) answers
bf16, nvfp4 or fp8_block, and the matching Linear / expert stack is allocated directly in that
format, so a quantised model never exists in bf16 in memory, not even while loading.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.quant import BF16, QuantScheme
from .expert_stack import ExpertStack
from .linear import Linear
from .quant_linear import quantized_linear


@dataclass(frozen=True)
class WeightFactory:
    dtype: torch.dtype  # compute dtype: dense weights are stored in it, quantised ones dequantise to it
    device: torch.device
    scheme: QuantScheme = field(default_factory=QuantScheme)

    def linear(self, name: str, in_features: int, out_features: int, *, dtype=None, shard_dim=None, start=0,
               length=None):  # fmt: skip
        """`dtype` overrides the compute dtype (the float32 indexer weights_proj, never quantised)."""
        kw = dict(dtype=dtype or self.dtype, device=self.device, shard_dim=shard_dim, start=start, length=length)
        precision = self.scheme.precision_of(name)
        if precision == BF16:
            return Linear(in_features, out_features, **kw)
        return quantized_linear(precision, in_features, out_features, **kw)

    def experts(self, prefix: str, num_experts: int, num_local: int, parts: tuple[str, ...], rows: int,
                in_features: int) -> ExpertStack:  # fmt: skip
        """One stack for `parts` of every local expert ("{prefix}experts.{e}.{part}"); they share one
        tensor, so every expert of the layer must be stored in the same precision."""
        found: dict[str, str] = {}
        for e in range(num_experts):
            for part in parts:
                name = f"{prefix}experts.{e}.{part}"
                found.setdefault(self.scheme.precision_of(name), name)
        if len(found) > 1:
            raise ValueError(
                "routed experts of one layer must share one precision to be stacked, found "
                + ", ".join(f"{p} (e.g. {n})" for p, n in sorted(found.items()))
            )
        (precision,) = found
        return ExpertStack(
            precision, parts, rows, in_features, num_local, dtype=self.dtype, device=self.device, num_experts=num_experts
        )
