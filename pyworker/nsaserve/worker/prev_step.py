"""The previous step's sampled tokens, for a plan that references them (overlap scheduling).

With overlap the router plans step N+1 before step N's result is back, so a request whose next
input is the token it samples in N carries `input_prev_row` (its row in N's plan) and an input
token of -1. The worker fills the token in before the step runs. Every rank must run the same
token and fail the same requests: rank 0 sampled the tokens (its result carried them, so they
are on the host already); the other ranks of a tensor-parallel group get them with one small
broadcast from rank 0, only on steps that reference them. Executors that sample on every rank
without a process group (the null executor) use their own, identical, tokens.

A reference fails only its request when it does not name a row of step N that sampled a token
for that same request (a wrong row, another request, a failed or missing step N).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..protocol.messages import Plan, StepResult
from ..protocol.validate import select


@dataclass
class SampledRows:
    """What one step sampled, by row of its plan as received (before validation dropped any)."""

    step: int
    req_ids: np.ndarray  # u64 [n]
    tokens: np.ndarray  # int64 [n]; -1 where the row sampled nothing or failed


def sampled_rows(plan: Plan, result: StepResult) -> SampledRows:
    by_id = {int(rid): int(tok) for rid, tok, _ in result.sampled}
    tokens = np.array([by_id.get(int(r), -1) for r in plan.req_ids], dtype=np.int64)
    return SampledRows(plan.step, np.asarray(plan.req_ids), tokens)


def group_size() -> int:
    """Ranks in the torch.distributed group (1 when there is none)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 1
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def broadcast_tokens(tokens: np.ndarray, is_rank0: bool) -> np.ndarray:
    """Rank 0's `tokens` on every rank (every rank passes an array of the same length)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.from_numpy(tokens).to(device) if is_rank0 else torch.empty(len(tokens), dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return t.cpu().numpy()


class PrevStep:
    """Remembers the last step's sampled rows and resolves the next plan's references."""

    def __init__(self, is_rank0: bool, broadcast=None):
        self.is_rank0 = is_rank0
        self.last: SampledRows | None = None
        # Group size > 1: the tokens come from rank 0 (tests may pass their own broadcast).
        self.broadcast = broadcast

    def forget(self) -> None:
        """An unreadable plan: nothing may reference the step before it."""
        self.last = None

    def record(self, plan: Plan, result: StepResult | None) -> None:
        self.last = sampled_rows(plan, result or StepResult(step=plan.step))

    def tokens_for(self, plan: Plan) -> np.ndarray | None:
        """The previous step's tokens as rank 0 sampled them, or None when there is no
        previous step to reference. Collective across ranks: every rank calls it for the same
        plan, so every rank takes the same branch."""
        last = self.last
        if last is None or last.step + 1 != plan.step:
            return None
        broadcast = self.broadcast
        if broadcast is None and group_size() > 1:
            broadcast = broadcast_tokens
        if broadcast is None:
            return last.tokens
        return broadcast(last.tokens, self.is_rank0)

    def resolve(self, full: Plan, runnable: Plan) -> tuple[Plan, list[tuple[int, str]]]:
        """`runnable` with every reference filled in, and the requests whose reference is bad.

        `full` is the plan as received: whether the step references anything is decided on it,
        so that every rank agrees on whether to broadcast."""
        if not (full.input_prev_row >= 0).any():
            return runnable, []
        tokens = self.tokens_for(full)
        refs = np.flatnonzero(runnable.input_prev_row >= 0)
        if len(refs) == 0:
            return runnable, []
        ok = np.zeros(len(refs), dtype=bool)
        filled = np.full(len(refs), -1, dtype=np.int64)
        if tokens is not None:
            r, same = same_request_rows(self.last.req_ids, runnable, refs)
            filled = np.where(same, tokens[r] if len(tokens) else -1, -1)
            ok = same & (filled >= 0)
        input_ids = np.array(runnable.input_ids, dtype=np.int32)
        input_ids[runnable.query_start[refs[ok]]] = filled[ok]
        return drop_bad_refs(replace(runnable, input_ids=input_ids), refs, ok)


REF_ERROR = "invalid plan: input_prev_row names no token the previous step sampled for it"


def same_request_rows(last_req_ids: np.ndarray, plan: Plan, refs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For `plan`'s referencing rows `refs`: the previous step's rows they name (0 where out of
    range), and whether each names an existing row of the same request."""
    rows = plan.input_prev_row[refs].astype(np.int64)
    in_range = rows < len(last_req_ids)
    r = np.where(in_range, rows, 0)
    same = in_range & (last_req_ids[r] == plan.req_ids[refs]) if len(last_req_ids) else in_range
    return r, same


def drop_bad_refs(plan: Plan, refs: np.ndarray, ok: np.ndarray) -> tuple[Plan, list[tuple[int, str]]]:
    """`plan` without the requests of its references that are not ok, and their errors."""
    if ok.all():
        return plan, []
    bad = refs[~ok]
    keep = np.ones(plan.num_reqs, dtype=bool)
    keep[bad] = False
    return select(plan, keep), [(int(plan.req_ids[i]), REF_ERROR) for i in bad]


__all__ = ["PrevStep", "SampledRows", "sampled_rows", "broadcast_tokens"]
