"""SamplingBatch: the sampling parameters of one step, packed into device tensors once.

Rows are the requests that produce a token this step (`plan.sample == 1`), in plan order.
Everything the sampler needs to decide on the host (which rows need sorting, which are seeded,
how many top logprobs to return) is decided here, so `sample` never waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..protocol.messages import Plan
from .batch import InputPatch
from .host_to_device import upload
from .sampling_noise import row_seeds

# Below this temperature a request is sampled greedily: dividing logits by a smaller number
# can overflow float32, and the distribution is a point mass to float precision anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingBatch:
    num_rows: int  # S
    req_index: np.ndarray  # int64 [S], the plan's request index of each row (host)

    greedy: torch.Tensor  # bool [S]
    temperature: torch.Tensor  # f32 [S], 1.0 on greedy rows so the division is harmless
    top_k: torch.Tensor  # int64 [S], 0 = off
    top_p: torch.Tensor  # f32 [S], >= 1 = off
    min_p: torch.Tensor  # f32 [S], clamped to [0, 1]; 0 = off
    repetition_penalty: torch.Tensor  # f32 [S], 1 = off
    frequency_penalty: torch.Tensor  # f32 [S]
    presence_penalty: torch.Tensor  # f32 [S]

    # Token history of the rows that have a penalty, as the "penalties" kernels take it
    # (kernels/penalties.py): row p's tokens are history[start[p] : start[p] + length[p]], the
    # first prompt_len[p] of them prompt tokens, then pending[p] (a generated token, or -1). Ids
    # outside the vocabulary are kept and ignored by the penalties (they have no logit).
    penalty_rows: torch.Tensor  # int64 [P], the rows with a penalty (sorted)
    history: torch.Tensor  # int32 [*], the plan's flat history array (int64 when empty)
    history_start: torch.Tensor  # int64 [P]
    history_len: torch.Tensor  # int64 [P]
    history_prompt: torch.Tensor  # int64 [P]
    history_pending: torch.Tensor  # int64 [P], -1 = none
    history_first: torch.Tensor  # int64 [P], the exclusive sum of length + 1
    history_entries: int  # sum of history_len (host)
    history_max: int  # largest history_len (host)

    # logit_bias as (row, token, bias) triples, added to the raw logits before the penalties.
    bias_row: torch.Tensor  # int64 [B]
    bias_token: torch.Tensor  # int64 [B]
    bias_value: torch.Tensor  # f32 [B]

    # Structured output: the rows with an allowed-token mask, and their bitmask words (the plan's
    # u32 words as int32 bit patterns, zero-padded to the longest; bit t % 32 of word t // 32
    # allows token t, and tokens past the words are out).
    mask_rows: torch.Tensor  # int64 [M]
    mask_words: torch.Tensor  # int32 [M, W]

    # (row, generator seed) of every seeded row that samples randomly; the generator seed
    # depends only on the request's seed and the position of the token being sampled.
    seeded: list[tuple[int, int]]

    top_logprobs: np.ndarray  # int32 [S] (host), -1 = no logprobs
    logprob_rows: torch.Tensor  # int64 [R], rows that asked for logprobs
    max_top_logprobs: int  # K of the output: the most top logprobs any row asked for

    # Host-side flags so `sample` can skip whole stages without reading the device.
    all_greedy: bool
    any_greedy: bool
    any_top_p: bool
    top_p_without_k: bool  # some row has top-p but no top-k: its threshold needs a full sort
    top_k_or_p_rows: torch.Tensor  # int64, rows with top-k or top-p active
    top_k_or_p_all: bool  # every row has one: work on the whole batch, no row gather
    max_top_k: int  # largest active top_k (0 if none)
    any_min_p: bool

    @property
    def adjusts_logits(self) -> bool:
        """Whether some row has a logit_bias, a penalty or an allowed-token mask (host-known sizes:
        no device read)."""
        return self.penalty_rows.numel() > 0 or self.bias_token.numel() > 0 or self.mask_rows.numel() > 0

    @staticmethod
    def from_plan(plan: Plan, device: torch.device | str, patch: InputPatch | None = None) -> SamplingBatch:
        """Host work is O(requests); the token history is expanded on the device.

        A penalised request planned ahead (input_prev_row >= 0) has a history without its pending
        token, the one it runs this step (docs/protocol.md): that token is appended here as a
        generated one, from `patch` (the previous step's samples, on the device) where the
        pipelined worker left the plan's input at -1, else from the plan's resolved input_ids.
        """
        sel = np.flatnonzero(plan.sample).astype(np.int64)
        S = len(sel)

        temp = plan.temperature[sel].astype(np.float32)
        greedy = ~(temp >= GREEDY_TEMPERATURE)  # NaN counts as greedy
        top_k = np.maximum(plan.top_k[sel].astype(np.int64), 0)
        top_p = plan.top_p[sel].astype(np.float32)
        min_p = np.clip(plan.min_p[sel].astype(np.float32), 0.0, 1.0)
        rep = plan.repetition_penalty[sel].astype(np.float32)
        freq = plan.frequency_penalty[sel].astype(np.float32)
        pres = plan.presence_penalty[sel].astype(np.float32)
        # Filters cannot change a greedy row's token (the top token always survives them).
        k_active = (top_k > 0) & ~greedy
        p_active = (top_p < 1.0) & ~greedy
        kp_rows = np.flatnonzero(k_active | p_active)
        tlp = plan.top_logprobs[sel].astype(np.int32)
        lp_rows = np.flatnonzero(tlp >= 0)
        pen_rows = np.flatnonzero(plan.has_penalty()[sel])

        # Per-row values and index lists travel in two host->device copies, not one per field.
        per_row = np.stack([np.where(greedy, 1.0, temp), top_p, min_p, rep, freq, pres, top_k, greedy]).astype(
            np.float32
        )
        f = _to_device(per_row, device)
        pen_req = sel[pen_rows]
        h_start = plan.history_start[:-1][pen_req].astype(np.int64)
        h_len = plan.history_start[1:][pen_req].astype(np.int64) - h_start
        h_prompt = plan.history_prompt_lens[pen_req].astype(np.int64)
        h_first = np.cumsum(h_len + 1) - (h_len + 1)
        lists = (kp_rows, lp_rows, pen_rows, h_start, h_len, h_prompt, h_first)
        ints = torch.split(_to_device(np.concatenate(lists).astype(np.int64), device), [len(a) for a in lists])

        # The position of the token being sampled = the position after the request's last
        # token this step. A seeded request draws the same noise for it however it is batched.
        last_tok = plan.query_start[1:][sel].astype(np.int64) - 1
        positions = plan.positions[last_tok].astype(np.int64) + 1
        seeded_rows = np.flatnonzero(plan.has_seed[sel].astype(bool) & ~greedy)
        gen_seeds = row_seeds(plan.seed[sel][seeded_rows], positions[seeded_rows])

        b_row, b_tok, b_val = _bias_triples(plan, sel, device)
        m_rows, m_words = _token_masks(plan, sel, device)
        history = _to_device(plan.history, device) if len(pen_rows) else ints[3][:0]
        pending = np.flatnonzero(plan.input_prev_row[pen_req] >= 0)
        if len(pending) == len(pen_rows):  # every penalised row appends one (pipelined decode)
            h_pending = _pending_tokens(plan, pen_req, device, patch)
        else:
            h_pending = torch.full((len(pen_rows),), -1, dtype=torch.int64, device=ints[3].device)
            if len(pending):
                h_pending[upload(pending.astype(np.int64), device)] = _pending_tokens(plan, pen_req[pending], device, patch)
        return SamplingBatch(
            num_rows=S,
            req_index=sel,
            greedy=f[7] > 0,
            temperature=f[0],
            top_k=f[6].long(),
            top_p=f[1],
            min_p=f[2],
            repetition_penalty=f[3],
            frequency_penalty=f[4],
            presence_penalty=f[5],
            penalty_rows=ints[2],
            history=history,
            history_start=ints[3],
            history_len=ints[4],
            history_prompt=ints[5],
            history_pending=h_pending,
            history_first=ints[6],
            history_entries=int(h_len.sum()),
            history_max=int(h_len.max()) if len(h_len) else 0,
            bias_row=b_row,
            bias_token=b_tok,
            bias_value=b_val,
            mask_rows=m_rows,
            mask_words=m_words,
            seeded=list(zip(seeded_rows.tolist(), gen_seeds.tolist())),
            top_logprobs=tlp,
            logprob_rows=ints[1],
            max_top_logprobs=int(tlp.max()) if S and tlp.max() > 0 else 0,
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            any_top_p=bool(p_active.any()),
            top_p_without_k=bool((p_active & ~k_active).any()),
            top_k_or_p_rows=ints[0],
            top_k_or_p_all=len(kp_rows) == S,
            max_top_k=int(top_k[k_active].max()) if k_active.any() else 0,
            any_min_p=bool(((min_p > 0) & ~greedy).any()),
        )


def _to_device(a: np.ndarray, device) -> torch.Tensor:
    return upload(a, device)


def _bias_triples(plan: Plan, sel: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, token, bias) of every logit_bias entry of the sampling rows `sel`, on the device."""
    start = plan.bias_start[:-1][sel].astype(np.int64)
    length = plan.bias_start[1:][sel].astype(np.int64) - start
    total = int(length.sum())
    if total == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty, torch.zeros(0, dtype=torch.float32, device=device)
    rows = np.repeat(np.arange(len(sel), dtype=np.int64), length)
    # Entry k of row r sits at start[r] + k of the plan's flat arrays.
    at = np.repeat(start - (np.cumsum(length) - length), length) + np.arange(total, dtype=np.int64)
    return upload(rows, device), upload(plan.bias_token[at], device, np.int64), upload(plan.bias_value[at], device)


def _token_masks(plan: Plan, sel: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, words [M, W]) of the sampling rows `sel` that carry an allowed-token mask."""
    start = plan.mask_start[:-1][sel].astype(np.int64)
    length = plan.mask_start[1:][sel].astype(np.int64) - start
    rows = np.flatnonzero(length > 0)
    width = int(length.max()) if len(rows) else 0
    words = np.zeros((len(rows), width), dtype=np.uint32)
    for k, r in enumerate(rows):  # one slice per constrained row: O(constrained rows) host work
        words[k, : length[r]] = plan.mask_words[start[r] : start[r] + length[r]]
    return upload(rows.astype(np.int64), device), upload(words.view(np.int32), device)


def _pending_tokens(plan: Plan, reqs: np.ndarray, device, patch: InputPatch | None) -> torch.Tensor:
    """The input token of each of `reqs` (requests that reference the previous step's sample):
    int64 on `device`, from the patch where it holds the request's input, else the plan's."""
    pos = plan.query_start[reqs].astype(np.int64)  # each runs exactly one token, by reference
    tok = upload(plan.input_ids[pos].astype(np.int64), device)
    if patch is not None and len(patch.token_index):
        k = np.searchsorted(patch.token_index, pos).clip(0, len(patch.token_index) - 1)
        hit = patch.token_index[k] == pos
        if hit.any():
            take = upload(k[hit], patch.tokens.device)
            tok.index_copy_(0, upload(np.flatnonzero(hit), device), patch.tokens.index_select(0, take).to(device))
    return tok
