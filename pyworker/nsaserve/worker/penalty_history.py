"""Penalty histories held on rank 0 between steps, so a plan carries only what is new.

A penalised request's sampler needs its whole history (prompt and generated tokens) every step.
Resending it in every plan made plans O(requests x context): 8.6 MB a step at 1024 requests of
2,048 tokens, encoded by the router and decoded by every rank, when only rank 0 samples. So the
router sends a request's whole history once (`history_reset` = 1) and afterwards only the tokens
since (one per decode step, none for a step planned ahead before the last token is known), and
names the requests that left (`released`) so their histories can go (docs/protocol.md).

`resolve` turns a received plan into one whose history arrays hold every penalised sampling
row's whole history, with history_reset 1 everywhere: the sampler and its reference read plans
of that form and need not know about any of this.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..protocol.arrays import I32, U8
from ..protocol.messages import Plan


class _Tokens:
    """One request's history: an int32 buffer that doubles when full (appends are amortised O(1))."""

    def __init__(self, tokens: np.ndarray):
        self.buf = np.array(tokens, dtype=I32)
        self.len = len(self.buf)

    def extend(self, tokens: np.ndarray) -> None:
        need = self.len + len(tokens)
        if need > len(self.buf):
            grown = np.empty(max(need, 2 * len(self.buf), 16), dtype=I32)
            grown[: self.len] = self.buf[: self.len]
            self.buf = grown
        self.buf[self.len : need] = tokens
        self.len = need

    def view(self) -> np.ndarray:
        return self.buf[: self.len]


class PenaltyHistories:
    """Rank 0's histories by request id. Plans must be resolved once each, in step order (a
    plan's segments extend what the plans before it left)."""

    def __init__(self):
        self._held: dict[int, _Tokens] = {}

    def __len__(self) -> int:
        return len(self._held)

    def release(self, req_ids) -> None:
        for r in np.asarray(req_ids).tolist():
            self._held.pop(int(r), None)

    def resolve(self, plan: Plan) -> tuple[Plan, list[tuple[int, str]]]:
        """(`plan` with whole histories, errors). A penalised sampling row that extends a history
        this worker does not hold fails (an error for its request; its penalties then see
        nothing, and its result is dropped by the caller)."""
        self.release(plan.released)
        penalised = (plan.sample != 0) & plan.has_penalty()
        reset = plan.history_reset != 0
        if not penalised.any() and not reset.any() and not len(plan.history):
            return plan, []  # the common case: nothing held, nothing to hold
        seg_start = plan.history_start.astype(np.int64)
        touched = np.flatnonzero(reset | (np.diff(seg_start) > 0))
        for i in touched.tolist():
            seg = plan.history[seg_start[i] : seg_start[i + 1]]
            rid = int(plan.req_ids[i])
            held = self._held.get(rid)
            if reset[i] or held is None:
                # A segment without a reset for an unknown request is an error, reported below.
                if reset[i]:
                    self._held[rid] = _Tokens(seg)
            else:
                held.extend(seg)

        errors: list[tuple[int, str]] = []
        parts: list[np.ndarray] = []
        lengths = np.zeros(plan.num_reqs, dtype=np.int64)
        for i in np.flatnonzero(penalised).tolist():
            held = self._held.get(int(plan.req_ids[i]))
            if held is None:
                errors.append((int(plan.req_ids[i]), "penalty history extends one this worker does not hold (no reset sent)"))
                continue
            parts.append(held.view())
            lengths[i] = held.len
        history = np.concatenate(parts) if parts else np.zeros(0, dtype=I32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(I32)
        whole = replace(plan, history_start=offsets, history=history, history_reset=np.ones(plan.num_reqs, dtype=U8))
        return whole, errors


__all__ = ["PenaltyHistories"]
