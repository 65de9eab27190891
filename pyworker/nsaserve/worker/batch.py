"""ForwardBatch: a validated plan turned into device tensors, once per step.

This is the plan/run split: everything the layers need about the batch's shape and KV addresses
is computed here, on the host and then on the device, and every layer of the forward pass
reuses it. Attention kernels never look at the plan or at Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..protocol.messages import Plan

NUMPY_OF = {torch.int64: np.int64, torch.int32: np.int32}


@dataclass
class ForwardBatch:
    mode: str  # "prefill" | "decode" | "mixed"
    num_reqs: int
    num_tokens: int
    page_size: int

    input_ids: torch.Tensor  # int64 [T], tokens run this step, requests concatenated
    positions: torch.Tensor  # int64 [T]
    token_req: torch.Tensor  # int64 [T], request index of each token
    query_start: torch.Tensor  # int32 [n+1], offsets of each request's tokens (cu_seqlens_q)
    cached_lens: torch.Tensor  # int32 [n], tokens already in the KV cache before this step
    seq_lens: torch.Tensor  # int32 [n], cached_lens + new tokens
    out_slots: torch.Tensor  # int64 [T], KV slot each new token's latent and indexer key go to
    # Physical slot of every logical position 0..seq_len-1 of every request, concatenated:
    # request i's positions live in kv_slots[kv_start[i]:kv_start[i+1]]. Expanded from the
    # plan's page table here, once; the indexer's top-k positions map through it.
    kv_start: torch.Tensor  # int32 [n+1] (cu_seqlens_k)
    kv_slots: torch.Tensor  # int64 [sum(seq_lens)]
    # Rows of the hidden states whose logits the sampler needs, and which request each is:
    # the last token of every request that samples, then every token of requests that want
    # prompt logprobs (see logits_index_for).
    logits_index: torch.Tensor  # int64 [S]

    # Host copies for code that loops over requests (reference kernels on CPU).
    query_start_host: list[int]
    seq_lens_host: list[int]
    cached_lens_host: list[int]


def sample_rows(plan: Plan) -> np.ndarray:
    """Token index of the last token of each request that samples this step."""
    last = plan.query_start[1:].astype(np.int64) - 1
    return last[plan.sample.astype(bool)]


def prompt_logprob_rows(plan: Plan) -> list[tuple[int, np.ndarray]]:
    """(request index, token indices) of every request that asked for prompt logprobs."""
    out = []
    for i in np.flatnonzero(plan.prompt_logprobs):
        out.append((int(i), np.arange(plan.query_start[i], plan.query_start[i + 1], dtype=np.int64)))
    return out


def build_forward_batch(plan: Plan, device: torch.device) -> ForwardBatch:
    n, ps = plan.num_reqs, plan.page_size
    qs = plan.query_start.astype(np.int64)
    qlen = np.diff(qs)
    cached = plan.cached_lens.astype(np.int64)
    seq = cached + qlen
    kv_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(seq, out=kv_start[1:])

    # Expand pages to per-position slots: position p of request i is in page
    # page_table[page_start[i] + p // ps] at offset p % ps.
    total = int(kv_start[-1])
    kv_req = np.repeat(np.arange(n), seq)
    kv_pos = np.arange(total, dtype=np.int64) - kv_start[kv_req]
    page = plan.page_table[plan.page_start[kv_req].astype(np.int64) + kv_pos // ps].astype(np.int64)
    kv_slots = page * ps + kv_pos % ps

    rows = [sample_rows(plan)] + [r for _, r in prompt_logprob_rows(plan)]
    logits_index = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        # np.array copies: plan arrays are read-only views of the received message, and the
        # host copy is a few KB even for a 1024-request decode step.
        host = torch.from_numpy(np.array(a, dtype=NUMPY_OF[dtype]))
        return host.to(device=device, non_blocking=True)

    return ForwardBatch(
        mode=plan.mode,
        num_reqs=n,
        num_tokens=plan.num_tokens,
        page_size=ps,
        input_ids=dev(plan.input_ids, torch.int64),
        positions=dev(plan.positions, torch.int64),
        token_req=dev(np.repeat(np.arange(n), qlen), torch.int64),
        query_start=dev(qs, torch.int32),
        cached_lens=dev(cached, torch.int32),
        seq_lens=dev(seq, torch.int32),
        out_slots=dev(plan.out_slots, torch.int64),
        kv_start=dev(kv_start, torch.int32),
        kv_slots=dev(kv_slots, torch.int64),
        logits_index=dev(logits_index, torch.int64),
        query_start_host=qs.tolist(),
        seq_lens_host=seq.tolist(),
        cached_lens_host=cached.tolist(),
    )
