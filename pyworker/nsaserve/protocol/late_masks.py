"""A step's late masks (the `masks` message) merged into its plan, checked like the plan's own.

Under overlap scheduling the router plans step N+1 while step N runs. A request under a
structured output needs, for N+1, the mask its grammar allows after the token it samples in N,
which the router learns only when N's result comes back. Such rows arrive with `mask_late` set
and no mask; once the router has committed N it sends rank 0 a `masks` message for N+1, which
rank 0 merges here before it builds N+1's sampling (its forward already queued).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .messages import LateMasks, Plan


def allows_a_token(words: np.ndarray, vocab_size: int | None) -> bool:
    """Whether a mask allows some token of the vocabulary (word k holds tokens 32k..32k+31)."""
    if vocab_size is None:
        return bool((words != 0).any())
    bits = np.clip(vocab_size - 32 * np.arange(len(words), dtype=np.int64), 0, 32)
    return bool(((words.astype(np.int64) & ((np.int64(1) << bits) - 1)) != 0).any())


def late_rows(plan: Plan) -> np.ndarray:
    """The rows of `plan` whose masks come in a `masks` message."""
    return np.flatnonzero(plan.mask_late != 0)


def apply_late_masks(plan: Plan, late: LateMasks, vocab_size: int | None = None) -> tuple[Plan, list[tuple[int, str]]]:
    """`plan` with the late rows' masks in place (and `mask_late` cleared), and the requests whose
    mask is unusable: (request id, why). Those rows stay in the step, unmasked; their tokens
    must not be sent. A late row the message leaves out samples unmasked; a listed request that
    is not a late row of this plan is ignored (it may have been dropped on receipt)."""
    rows = late_rows(plan)
    if len(rows) == 0:
        return plan, []
    given = late.masks() if late.step == plan.step else {}
    errors: list[tuple[int, str]] = []
    lens = np.diff(plan.mask_start).astype(np.int64)
    parts = [plan.mask_words[plan.mask_start[i] : plan.mask_start[i + 1]] for i in range(plan.num_reqs)]
    for i in rows:
        rid = int(plan.req_ids[i])
        words = given.get(rid)
        if words is None or len(words) == 0:
            continue
        if not allows_a_token(words, vocab_size):
            errors.append((rid, "invalid masks message: an allowed-token mask that allows no token"))
            continue
        parts[i] = words
        lens[i] = len(words)
    start = np.concatenate([[0], np.cumsum(lens)]).astype(plan.mask_start.dtype)
    words = np.concatenate(parts).astype(plan.mask_words.dtype) if len(parts) else plan.mask_words[:0]
    return replace(plan, mask_start=start, mask_words=words, mask_late=np.zeros_like(plan.mask_late)), errors


__all__ = ["allows_a_token", "apply_late_masks", "late_rows"]
