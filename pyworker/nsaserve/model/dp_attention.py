"""Data-parallel attention: one step's layout over the ranks, and the collectives around the MLPs.

With --enable-dp-attention (dp size = tp size) every rank holds the whole attention (all heads) and
its own KV pool of P pages; the router's page ids are global, rank r owning [r*P, (r+1)*P), and a
request lives on the rank that owns its pages. Every rank receives the same combined plan and
derives from it alone (DPStep.from_plan, no communication):
- its own requests, as a plan with page ids and slots local to its pool (it runs attention on
  these only, so attention needs no collective and no rank keeps another rank's KV);
- every rank's token count and logit-row count, so that all ranks agree on the padded block sizes
  of the collectives below without exchanging them.

The MLPs, shared and routed experts stay tensor/expert parallel over all ranks (parallel.py), so
around each MLP the ranks' tokens meet: all-gather the MLP inputs (each rank's block padded to the
largest token count), every rank runs its MLP share on all tokens, and a reduce-scatter sums the
shares and hands each rank the rows of its own tokens. Only the MLP output crosses ranks: the
residual stream and the norms stay on the token's rank. At the end the final-norm rows the sampler
needs are all-gathered the same way and put in plan order, and lm_head stays vocab-parallel, so
every rank returns the full logits of every logit row of the combined plan, as a TP forward does.

A rank without requests in a step still joins every collective (with a block of zero rows): the
collectives are matched by call order across ranks, so every rank makes every call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from ..protocol.messages import Plan
from ..protocol.validate import request_ranks, select
from ..worker.host_to_device import upload
from .parallel import TPGroup


def local_plan(plan: Plan, ranks: np.ndarray, rank: int, num_pages: int) -> Plan:
    """The requests of `rank`, in plan order, with page ids and slots local to its pool."""
    sub = select(plan, ranks == rank)
    page_off, slot_off = rank * num_pages, rank * num_pages * plan.page_size
    return replace(
        sub,
        page_table=(sub.page_table.astype(np.int64) - page_off).astype(sub.page_table.dtype),
        out_slots=(sub.out_slots.astype(np.int64) - slot_off).astype(sub.out_slots.dtype),
    )


def before_in_rank(ranks: np.ndarray, counts: np.ndarray, size: int) -> np.ndarray:
    """For each request, the sum of `counts` over the earlier requests of its rank."""
    out = np.zeros(len(ranks), dtype=np.int64)
    for r in range(size):
        mine = np.flatnonzero(ranks == r)
        c = counts[mine]
        out[mine] = np.cumsum(c) - c
    return out


def logit_layout(plan: Plan, ranks: np.ndarray, size: int) -> tuple[list[int], np.ndarray]:
    """(logit rows of each rank, and for each logit row of the combined plan, in its order, the row
    of the gathered blocks [rank r's rows at r * max_rows ...] that holds it).

    A plan's logit rows (worker/batch.py) are the sampling rows of its requests in order, then the
    prompt-logprob rows of its requests in order. A rank's local plan keeps its requests' order, so
    a request's row there is counted among the earlier requests of the same rank."""
    qlen = np.diff(plan.query_start).astype(np.int64)
    samp = plan.sample.astype(bool)
    prompt = plan.prompt_logprobs.astype(bool)
    n_samp = np.bincount(ranks[samp], minlength=size)[:size]
    prompt_rows = np.where(prompt, qlen, 0)
    n_prompt = np.bincount(ranks, weights=prompt_rows, minlength=size)[:size].astype(np.int64)
    rows = (n_samp + n_prompt).astype(np.int64)
    max_rows = int(rows.max(initial=0))
    samp_before = before_in_rank(ranks, samp.astype(np.int64), size)
    prompt_before = before_in_rank(ranks, prompt_rows, size)
    base = ranks * max_rows
    parts = [(base + samp_before)[samp]]
    for i in np.flatnonzero(prompt):
        r = ranks[i]
        parts.append(base[i] + n_samp[r] + prompt_before[i] + np.arange(qlen[i], dtype=np.int64))
    order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return rows.tolist(), order.astype(np.int64)


def all_gather_blocks(x: torch.Tensor, rows: int, size: int) -> torch.Tensor:
    """Every rank's x [n_r, H] (n_r <= rows) -> [size * rows, H], rank r's block at r * rows,
    zero-padded. One output tensor on CUDA (all_gather_into_tensor); gloo takes the list form."""
    if x.shape[0] == rows:  # the busiest rank, and every rank in a decode graph: no padding copy
        padded = x.contiguous()
    else:
        padded = x.new_zeros(rows, *x.shape[1:])
        padded[: x.shape[0]] = x
    if x.is_cuda:
        out = x.new_empty(size * rows, *x.shape[1:])
        dist.all_gather_into_tensor(out, padded)
        return out
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded)
    return torch.cat(parts)


def reduce_scatter_blocks(y: torch.Tensor, rank: int, size: int, n: int) -> torch.Tensor:
    """Sum y [size * rows, H] over the ranks and keep this rank's block, trimmed to n rows.

    NCCL: reduce_scatter_tensor. Other backends (gloo, CPU tests) may lack it: an all-reduce and a
    slice give the same sum, moving size times the data."""
    rows = y.shape[0] // size
    if y.is_cuda:
        out = y.new_empty(rows, *y.shape[1:])
        dist.reduce_scatter_tensor(out, y.contiguous())
        return out[:n]
    y = y.contiguous()
    dist.all_reduce(y)
    return y[rank * rows : rank * rows + n]


@dataclass
class DPStep:
    """One step's data-parallel layout, derived from the combined plan alone (equal on every rank)."""

    group: TPGroup
    local_plan: Plan  # this rank's requests, page ids and out_slots local to its pool
    tokens: list[int]  # tokens of each rank this step
    logit_rows: list[int]  # logit rows of each rank this step
    logit_order: torch.Tensor  # int64 [S]: gathered row of each logit row of the combined plan, in plan order
    mine: np.ndarray | None = None  # bool per request of the combined plan: on this rank (local_plan's)

    @classmethod
    def from_plan(cls, plan: Plan, group: TPGroup, num_pages: int, device: torch.device) -> DPStep:
        """num_pages: pages of one rank's pool (P)."""
        ranks = request_ranks(plan, num_pages)
        qlen = np.diff(plan.query_start).astype(np.int64)
        tokens = np.bincount(ranks, weights=qlen, minlength=group.size)[: group.size].astype(np.int64).tolist()
        rows, order = logit_layout(plan, ranks, group.size)
        return cls(
            group=group,
            local_plan=local_plan(plan, ranks, group.rank, num_pages),
            tokens=tokens,
            logit_rows=rows,
            logit_order=upload(order, device),
            mine=ranks == group.rank,
        )

    @property
    def max_tokens(self) -> int:
        return max(self.tokens)

    @property
    def local_tokens(self) -> int:
        return self.tokens[self.group.rank]

    def mlp(self, mlp, x: torch.Tensor, kernels) -> torch.Tensor:
        """The MLP (dense or MoE, its `partial`: this rank's share before the sum) on the tokens of
        all ranks; returns the summed output of this rank's tokens [local_tokens, H]."""
        g = self.group
        xs = all_gather_blocks(x, self.max_tokens, g.size)
        return reduce_scatter_blocks(mlp.partial(xs, kernels), g.rank, g.size, self.local_tokens)

    def gather_logit_rows(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's final-norm logit rows [S_r, H] -> every rank's, in plan order [S, H]."""
        gathered = all_gather_blocks(h, max(self.logit_rows), self.group.size)
        return gathered.index_select(0, self.logit_order)
