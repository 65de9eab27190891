"""Plan validation on receipt: a malformed plan fails only the requests it got wrong.

Two levels:
- structural damage (array lengths, offsets, mode) makes the whole plan unreadable, so every
  request in it fails (`ProtocolError`);
- per-request faults (pages outside the pool, slots that disagree with the page table, two
  requests writing one slot, a malformed previous-step reference) fail those requests; the
  rest of the step runs. Under data-parallel attention (dp_size > 1) the page ids span dp_size
  pools of num_pages each, and a request whose pages or out_slots are not all in one rank's pool
  fails alone; the decision uses the plan alone, so every rank makes the same one. Whether a
  reference names a row the previous step really sampled for that request is the worker's check
  (`worker/prev_step.py`): only it knows that step.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .arrays import ProtocolError
from .messages import Plan

PER_REQUEST = (
    "req_ids",
    "cached_lens",
    "sample",
    "prompt_logprobs",
    "next_prompt_token",
    "input_prev_row",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "has_seed",
    "top_logprobs",
    "history_prompt_lens",
    "history_reset",
    "mask_late",
)
# offsets field -> the flat arrays it indexes
OFFSETS = {
    "query_start": ("input_ids",),
    "page_start": ("page_table",),
    "history_start": ("history",),
    "bias_start": ("bias_token", "bias_value"),
    "mask_start": ("mask_words",),
}
PER_TOKEN = ("input_ids", "positions", "out_slots")


def implied_mode(query_lens: np.ndarray) -> str:
    """A one-token request is decode-shaped, any other prefill-shaped (same rule as the router)."""
    if len(query_lens) == 0:
        return "idle"
    ones = int((query_lens == 1).sum())
    return "decode" if ones == len(query_lens) else "prefill" if ones == 0 else "mixed"


def check_structure(plan: Plan) -> None:
    n = plan.num_reqs
    if plan.page_size <= 0:
        raise ProtocolError(f"page_size must be positive, got {plan.page_size}")
    for name in PER_REQUEST:
        if len(getattr(plan, name)) != n:
            raise ProtocolError(f"{name} has {len(getattr(plan, name))} entries for {n} requests")
    for name, flats in OFFSETS.items():
        off = getattr(plan, name)
        for flat in flats:
            total = len(getattr(plan, flat))
            if len(off) != n + 1 or off[0] != 0 or off[-1] != total or np.any(np.diff(off) < 0):
                raise ProtocolError(f"{name} is not monotonic offsets 0..{total} over {n} requests")
    for name in PER_TOKEN:
        if len(getattr(plan, name)) != plan.num_tokens:
            raise ProtocolError(f"{name} has {len(getattr(plan, name))} entries for {plan.num_tokens} tokens")
    mode = implied_mode(np.diff(plan.query_start))
    if plan.mode != mode:
        raise ProtocolError(f"mode {plan.mode!r} contradicts the requests, which make it {mode!r}")


def request_ranks(plan: Plan, num_pages: int) -> np.ndarray:
    """Under data-parallel attention, the rank each request lives on: the owner of its first page
    (num_pages: one rank's pool). The faults below fail a request with pages on another rank."""
    if len(plan.page_table) == 0:
        return np.zeros(plan.num_reqs, dtype=np.int64)
    first = np.minimum(plan.page_start[:-1], len(plan.page_table) - 1)
    return plan.page_table[first].astype(np.int64) // num_pages


def request_faults(plan: Plan, num_pages: int, vocab_size: int | None = None, dp_size: int = 1) -> dict[int, str]:
    """Index of each faulty request -> why. Assumes `check_structure` passed. With `vocab_size`,
    token ids are checked too (one outside the embedding table would fail the whole step).
    num_pages: pages of one rank's pool; dp_size ranks (data-parallel attention) own
    [r * num_pages, (r + 1) * num_pages) each."""
    n, ps = plan.num_reqs, plan.page_size
    faults: dict[int, str] = {}
    if n == 0:
        return faults

    def flag(mask: np.ndarray, why: str) -> None:
        for i in np.flatnonzero(mask):
            faults.setdefault(int(i), why)

    qlen = np.diff(plan.query_start)
    cached = plan.cached_lens.astype(np.int64)
    seq = cached + qlen
    npages = np.diff(plan.page_start)
    flag(qlen <= 0, "no tokens to run")
    flag(cached < 0, "negative cached_len")
    flag(npages < -(-seq // ps), "its pages cannot hold its tokens")
    refs = plan.input_prev_row >= 0
    flag(plan.input_prev_row < -1, "input_prev_row below -1")
    flag(refs & (plan.step < 1), "input_prev_row without a previous step")
    neg = np.bincount(np.repeat(np.arange(n), qlen)[plan.input_ids < 0], minlength=n) > 0
    flag(refs & ((qlen != 1) | ~neg), "input_prev_row needs exactly one input token, -1")
    flag(~refs & neg, "a negative input token")
    reset = plan.history_reset != 0
    flag(plan.history_reset > 1, "history_reset other than 0 and 1")
    # Only a reset carries the whole history to check the prompt length against.
    flag(
        (plan.history_prompt_lens < 0) | (reset & (plan.history_prompt_lens > np.diff(plan.history_start))),
        "history_prompt_len out of range",
    )
    bias_req = np.repeat(np.arange(n), np.diff(plan.bias_start))
    same_req = bias_req[1:] == bias_req[:-1]
    unordered = np.flatnonzero(same_req & (plan.bias_token[1:] <= plan.bias_token[:-1]))
    flag(np.bincount(bias_req[unordered], minlength=n) > 0, "logit_bias token ids not distinct and ascending")
    flag(np.bincount(bias_req[~np.isfinite(plan.bias_value)], minlength=n) > 0, "a logit_bias value that is not finite")

    mask_len = np.diff(plan.mask_start)
    flag((mask_len > 0) & (plan.sample == 0), "an allowed-token mask on a row that samples nothing")
    # A masked request must allow some token (of the vocabulary, when known): bits of word k
    # stand for tokens 32k..32k+31, so word k keeps its lowest (limit - 32k) bits.
    mask_req = np.repeat(np.arange(n), mask_len)
    word_index = np.arange(len(plan.mask_words), dtype=np.int64) - plan.mask_start[mask_req]
    words = plan.mask_words.astype(np.int64)
    if vocab_size is not None:
        bits = np.clip(vocab_size - 32 * word_index, 0, 32)
        words = words & ((np.int64(1) << bits) - 1)
    allows = np.bincount(mask_req[words != 0], minlength=n) > 0
    flag((mask_len > 0) & ~allows, "an allowed-token mask that allows no token")
    flag(plan.mask_late > 1, "mask_late other than 0 and 1")
    flag((plan.mask_late != 0) & ((plan.sample == 0) | (mask_len > 0)), "mask_late on a row that samples nothing or has its mask")

    page_req = np.repeat(np.arange(n), npages)
    total_pages = num_pages * dp_size
    bad_page = (plan.page_table < 0) | (plan.page_table >= total_pages)
    flag(np.bincount(page_req[bad_page], minlength=n) > 0, f"page id outside the pool of {total_pages} pages")
    tok_req = np.repeat(np.arange(n), qlen)
    if dp_size > 1:
        # The rank of a request is that of its first page; every page and slot must be on it.
        page_rank = plan.page_table.astype(np.int64) // num_pages
        req_rank = request_ranks(plan, num_pages)
        flag(
            np.bincount(page_req[page_rank != req_rank[page_req]], minlength=n) > 0,
            f"its pages span more than one rank's pool of {num_pages} pages (data-parallel attention)",
        )
        slot_rank = plan.out_slots.astype(np.int64) // (num_pages * ps)
        flag(
            np.bincount(tok_req[slot_rank != req_rank[tok_req]], minlength=n) > 0,
            "out_slots outside its rank's pool (data-parallel attention)",
        )

    if vocab_size is not None:
        # A -1 waiting for the previous step's token (overlap) is checked above, not here.
        outside = ((plan.input_ids < 0) & ~refs[tok_req]) | (plan.input_ids >= vocab_size)
        flag(np.bincount(tok_req[outside], minlength=n) > 0, f"token id outside the vocabulary of {vocab_size}")
        hist_req = np.repeat(np.arange(n), np.diff(plan.history_start))
        outside = (plan.history < 0) | (plan.history >= vocab_size)
        flag(np.bincount(hist_req[outside], minlength=n) > 0, "history token id outside the vocabulary")
        outside = (plan.bias_token < 0) | (plan.bias_token >= vocab_size)
        flag(np.bincount(bias_req[outside], minlength=n) > 0, "logit_bias token id outside the vocabulary")
        nxt = plan.next_prompt_token
        flag((nxt < -1) | (nxt >= vocab_size), "next_prompt_token outside the vocabulary")
    pos = plan.positions.astype(np.int64)
    expect_pos = cached[tok_req] + (np.arange(plan.num_tokens) - plan.query_start[tok_req])
    flag(np.bincount(tok_req[pos != expect_pos], minlength=n) > 0, "positions do not follow cached_len")

    # Slot each token must write according to the request's own page table.
    ok_req = np.ones(n, dtype=bool)
    ok_req[list(faults)] = False
    tok_ok = ok_req[tok_req]
    page_idx = plan.page_start[tok_req[tok_ok]] + pos[tok_ok] // ps
    expect_slot = plan.page_table[page_idx].astype(np.int64) * ps + pos[tok_ok] % ps
    wrong = np.zeros(plan.num_tokens, dtype=bool)
    wrong[tok_ok] = plan.out_slots[tok_ok] != expect_slot
    flag(np.bincount(tok_req[wrong], minlength=n) > 0, "out_slots disagree with its page table")

    # No two tokens of a step may write one slot (it would corrupt a live request's KV).
    slots = plan.out_slots
    order = np.argsort(slots, kind="stable")
    dup = np.zeros(plan.num_tokens, dtype=bool)
    same = slots[order][1:] == slots[order][:-1]
    dup[order[1:][same]] = True
    dup[order[:-1][same]] = True
    flag(np.bincount(tok_req[dup], minlength=n) > 0, "writes a KV slot another token of this step writes")
    return faults


def select(plan: Plan, keep: np.ndarray) -> Plan:
    """The sub-plan of the requests where `keep` is true (offsets rebuilt)."""
    if keep.all():
        return plan
    out = {}
    for name in PER_REQUEST:
        out[name] = getattr(plan, name)[keep]
    for off_name, flat_names in OFFSETS.items():
        off = getattr(plan, off_name)
        lens = np.diff(off)
        mask = np.repeat(keep, lens)
        for flat_name in flat_names:
            out[flat_name] = getattr(plan, flat_name)[mask]
        out[off_name] = np.concatenate([[0], np.cumsum(lens[keep])]).astype(off.dtype)
    tok_mask = np.repeat(keep, np.diff(plan.query_start))
    out["positions"] = plan.positions[tok_mask]
    out["out_slots"] = plan.out_slots[tok_mask]
    new = replace(plan, **out)
    new.mode = implied_mode(np.diff(new.query_start))
    return new


def validate_plan(
    plan: Plan, num_pages: int, vocab_size: int | None = None, dp_size: int = 1
) -> tuple[Plan, list[tuple[int, str]]]:
    """Returns the runnable sub-plan and `(request id, reason)` for every request it dropped.
    num_pages and dp_size: see request_faults.

    Raises `ProtocolError` when the plan is structurally broken (then every request fails).
    """
    check_structure(plan)
    faults = request_faults(plan, num_pages, vocab_size, dp_size)
    if not faults:
        return plan, []
    keep = np.ones(plan.num_reqs, dtype=bool)
    keep[list(faults)] = False
    errors = [(int(plan.req_ids[i]), f"invalid plan: {why}") for i, why in sorted(faults.items())]
    return select(plan, keep), errors


__all__ = ["validate_plan", "check_structure", "request_faults", "select", "implied_mode"]
