"""Tensor-parallel bookkeeping: which slice of a weight this rank holds, and the two collectives.

Layout (rank r of N):
- MLA heads: q_b_proj / kv_b_proj rows of heads [r*H/N, (r+1)*H/N); o_proj the matching input
  columns; o_proj output is all-reduced. q_a_proj, kv_a_proj and the latent KV cache are replicated
  (one latent head).
- Indexer: REPLICATED on every rank (all its weights, its key cache, its scores). Every rank sees
  identical hidden states (they come out of all-reduces) and runs the identical deterministic
  kernel, so all ranks pick identical top-k indices without any communication.
- Routed experts: rank r owns experts [r*E/N, (r+1)*E/N) (expert parallel inside the TP group);
  the router is replicated. Shared experts and dense MLPs split their intermediate dim. One
  all-reduce per MLP sums routed + shared partials.
- Embedding replicated; lm_head vocab-parallel, logits all-gathered so every rank returns the full
  vocabulary.
- Quantised weights follow the same layout. NVFP4 / FP8 tensors are sliced in their packed form
  when the split lands on scale-group boundaries (16 inputs for NVFP4, 128x128 blocks for FP8),
  otherwise that module is dequantised at load and sliced (quant_linear.py); experts are never
  sliced (expert parallel).

Data-parallel attention (--enable-dp-attention, dp size = tp size): attention layers get a group
of one (attention_group), so they hold every head and their KV pool is this rank's own; each rank
runs attention on its own requests only. The MLPs, experts and lm_head keep the layout above; the
hidden states move between the two layouts in dp_attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total` items; must divide evenly."""
        if total % self.size:
            raise ValueError(f"{what} = {total} is not divisible by tp_size = {self.size}")
        n = total // self.size
        return self.rank * n, n

    def split_padded(self, total: int) -> tuple[int, int, int]:
        """(start, length, padded share) for a split that need not divide evenly (the vocabulary)."""
        share = -(-total // self.size)
        start = min(self.rank * share, total)
        return start, min(share, total - start), share

    def attention_group(self, dp_attention: bool) -> TPGroup:
        """The group attention layers split their heads over: this one, or, under data-parallel
        attention, a group of one (all heads, whole weights, no collective inside attention)."""
        return TPGroup(0, 1) if dp_attention else self

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t)
        return t

    def all_gather_rows(self, t: torch.Tensor, share: int, total: int) -> torch.Tensor:
        """Concatenate each rank's [N, len_r] along dim 1 (each padded to `share`) -> [N, total].

        On CUDA the ranks' shares land in one [size, N, share] tensor (all_gather_into_tensor): a
        single output buffer is what a CUDA graph capture can hold; gloo takes the list form."""
        if self.size == 1:
            return t
        padded = torch.zeros(t.shape[0], share, dtype=t.dtype, device=t.device)
        padded[:, : t.shape[1]] = t
        if t.is_cuda:
            parts = torch.empty(self.size, *padded.shape, dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(parts, padded)
            return parts.permute(1, 0, 2).reshape(t.shape[0], -1)[:, :total]
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        return torch.cat(parts, dim=1)[:, :total]
