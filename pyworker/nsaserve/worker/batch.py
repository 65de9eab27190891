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
from .host_to_device import upload

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

    # Set by CUDA-graph decode batches (worker/cuda_graphs.py): every request's span of kv_slots
    # is this long (kv_start[i] = i * static_kv_len; slots past its seq_len point at a scratch
    # slot), so the host lists above are placeholders and the indexer takes its per-row
    # metadata from the device ("indexer_rows").
    static_kv_len: int | None = None


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


@dataclass
class StagedPlan:
    """The host half of building a batch: small arrays, already on the device."""

    plan: Plan
    tensors: dict[str, torch.Tensor]
    total_kv: int
    host: dict[str, list[int]]


def stage_plan(plan: Plan, device: torch.device) -> StagedPlan:
    """Host work, O(requests + pages + new tokens): derive the few per-request arrays the
    device needs and copy them over. Nothing here grows with the context length."""
    n = plan.num_reqs
    qs = plan.query_start.astype(np.int64)
    qlen = np.diff(qs)
    cached = plan.cached_lens.astype(np.int64)
    seq = cached + qlen
    kv_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(seq, out=kv_start[1:])
    rows = [sample_rows(plan)] + [r for _, r in prompt_logprob_rows(plan)]
    logits_index = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return upload(a, device, NUMPY_OF[dtype])

    tensors = {
        "input_ids": dev(plan.input_ids, torch.int64),
        "positions": dev(plan.positions, torch.int64),
        "token_req": dev(np.repeat(np.arange(n), qlen), torch.int64),
        "query_start": dev(qs, torch.int32),
        "cached_lens": dev(cached, torch.int32),
        "seq_lens": dev(seq, torch.int64),
        "out_slots": dev(plan.out_slots, torch.int64),
        "kv_start": dev(kv_start, torch.int64),
        "page_start": dev(plan.page_start, torch.int64),
        "page_table": dev(plan.page_table, torch.int64),
        "logits_index": dev(logits_index, torch.int64),
    }
    host = {"query_start": qs.tolist(), "seq_lens": seq.tolist(), "cached_lens": cached.tolist()}
    return StagedPlan(plan, tensors, int(kv_start[-1]), host)


@dataclass
class InputPatch:
    """Input tokens that are on the device, not in the plan: the previous step's samples, for
    requests whose input the plan left at -1 (overlap references, worker/pipeline.py)."""

    token_index: np.ndarray  # int64 [R], indices into the plan's input_ids
    tokens: torch.Tensor  # int64 [R], on the step's device

    def apply(self, input_ids: torch.Tensor) -> None:
        """In stream order, after input_ids' host-to-device copy: no host synchronisation."""
        index = upload(self.token_index, input_ids.device)
        input_ids.index_copy_(0, index, self.tokens.to(input_ids.dtype))

    def for_requests(self, plan: Plan, keep: np.ndarray) -> InputPatch | None:
        """The patch of select(plan, keep)'s input_ids, or None when it has nothing to patch
        (data-parallel attention: each rank runs its own requests, in plan order, as a plan of
        their own). A kept request's tokens sit at its start in the sub-plan plus their offset."""
        qs = plan.query_start.astype(np.int64)
        req = np.searchsorted(qs, self.token_index, side="right") - 1
        mine = keep[req]
        if not mine.any():
            return None
        kept_len = np.where(keep, np.diff(qs), 0)
        sub_start = np.cumsum(kept_len) - kept_len
        index = self.token_index[mine] - qs[req[mine]] + sub_start[req[mine]]
        return InputPatch(index, self.tokens.index_select(0, upload(np.flatnonzero(mine), self.tokens.device)))


def build_forward_batch(plan: Plan, device: torch.device, patch: InputPatch | None = None) -> ForwardBatch:
    """Stages the plan, then expands the page table into per-position slots on the device
    (O(total context), so it never runs on the host's critical path on a GPU)."""
    st = stage_plan(plan, device)
    t = st.tensors
    if patch is not None:
        patch.apply(t["input_ids"])
    return ForwardBatch(
        mode=plan.mode,
        num_reqs=plan.num_reqs,
        num_tokens=plan.num_tokens,
        page_size=plan.page_size,
        input_ids=t["input_ids"],
        positions=t["positions"],
        token_req=t["token_req"],
        query_start=t["query_start"],
        cached_lens=t["cached_lens"],
        seq_lens=t["seq_lens"].to(torch.int32),
        out_slots=t["out_slots"],
        kv_start=t["kv_start"].to(torch.int32),
        kv_slots=expand_slots(t["page_table"], t["page_start"], t["seq_lens"], t["kv_start"], plan.page_size, st.total_kv),
        logits_index=t["logits_index"],
        query_start_host=st.host["query_start"],
        seq_lens_host=st.host["seq_lens"],
        cached_lens_host=st.host["cached_lens"],
    )


def expand_slots(
    page_table: torch.Tensor, page_start: torch.Tensor, seq_lens: torch.Tensor, kv_start: torch.Tensor, page_size: int, total: int
) -> torch.Tensor:
    """Physical slot of every logical position of every request, on the device: position p of
    request i lives in page page_table[page_start[i] + p // page_size] at offset p % page_size.
    `total` (known on the host) keeps repeat_interleave from synchronising with the device."""
    n = seq_lens.numel()
    kv_req = torch.repeat_interleave(torch.arange(n, device=seq_lens.device), seq_lens, output_size=total)
    pos = torch.arange(total, device=seq_lens.device) - kv_start[kv_req]
    return page_table[page_start[kv_req] + torch.div(pos, page_size, rounding_mode="floor")] * page_size + pos % page_size
