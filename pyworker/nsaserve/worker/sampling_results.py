"""Sampler outputs as the protocol's result entries (host side, once per step).

Each tensor crosses to the host in one copy; the per-request loop then only slices numpy rows.
"""

from __future__ import annotations

import numpy as np
import torch

from ..protocol.messages import Plan, TokenLogprobs
from .sampler import SampleOutput
from .sampling_batch import SamplingBatch


def sampled_entries(plan: Plan, sb: SamplingBatch, out: SampleOutput) -> list[tuple[int, int, TokenLogprobs | None]]:
    """(request id, token, logprobs or None) per sampling row, in plan order, for `StepResult.sampled`.

    A request that asked for n top logprobs gets the first n of the K columns.
    """
    tokens = out.tokens.cpu().numpy()
    if not (sb.top_logprobs >= 0).any():  # no row asked for logprobs: one copy back, not four
        return token_entries(plan, tokens)
    req_ids = plan.req_ids[sb.req_index]
    lp = out.logprobs.cpu().numpy()
    ids = out.top_ids.cpu().numpy()
    vals = out.top_logprobs.cpu().numpy()
    entries = []
    for j in range(sb.num_rows):
        n = int(sb.top_logprobs[j])
        lps = None if n < 0 else TokenLogprobs(float(lp[j]), _pairs(ids[j, :n], vals[j, :n]))
        entries.append((int(req_ids[j]), int(tokens[j]), lps))
    return entries


def copy_to_host(out: SampleOutput, with_logprobs: bool) -> tuple[SampleOutput, torch.cuda.Event]:
    """Starts copying a CUDA step's sampler output to pinned host memory, queued behind the
    sampler; returns the host copy and an event that marks the copies done. With the copies
    queued at launch, waiting for them later waits for this step alone, not for work queued after
    it (worker/pipeline.py launches the next step before it finishes this one). Without
    logprobs only the tokens cross (the other fields are left on the device, unread)."""

    def pinned(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    if with_logprobs:
        host = SampleOutput(pinned(out.tokens), pinned(out.logprobs), pinned(out.top_ids), pinned(out.top_logprobs))
    else:
        host = SampleOutput(pinned(out.tokens), out.logprobs, out.top_ids, out.top_logprobs)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def token_entries(plan: Plan, tokens: np.ndarray) -> list[tuple[int, int, None]]:
    """(request id, token, None) per sampling row, from the sampled tokens already on the host."""
    req_ids = plan.req_ids[np.flatnonzero(plan.sample)]
    return [(int(r), int(t), None) for r, t in zip(req_ids.tolist(), tokens.tolist())]


def prompt_entries(logprobs: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> list[TokenLogprobs]:
    """`prompt_logprobs`'s tensors as one `TokenLogprobs` per prompt token, for `PromptLogprobs.entries`."""
    lp = logprobs.cpu().numpy()
    ids = top_ids.cpu().numpy()
    vals = top_logprobs.cpu().numpy()
    return [TokenLogprobs(float(lp[i]), _pairs(ids[i], vals[i])) for i in range(len(lp))]


def _pairs(ids: np.ndarray, vals: np.ndarray) -> list[tuple[int, float]]:
    return list(zip(ids.tolist(), vals.tolist()))
