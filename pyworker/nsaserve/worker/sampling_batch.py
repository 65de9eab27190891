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

    # Token history of the rows that have a penalty, as (row, token) pairs; a token that
    # occurs k times occurs k times here. `generated` marks tokens after the prompt.
    penalty_rows: torch.Tensor  # int64 [P], the rows with a penalty (sorted)
    history_row: torch.Tensor  # int64 [H], index into penalty_rows
    history_token: torch.Tensor  # int64 [H]
    history_generated: torch.Tensor  # f32 [H], 1.0 for generated tokens, 0.0 for prompt tokens
    max_history_token: int  # -1 when there is no history; checked against the vocabulary

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

    @staticmethod
    def from_plan(plan: Plan, device: torch.device | str) -> SamplingBatch:
        sel = np.flatnonzero(plan.sample).astype(np.int64)
        S = len(sel)

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.array(a)).to(device=device, dtype=dtype)

        temp = plan.temperature[sel].astype(np.float32)
        greedy = ~(temp >= GREEDY_TEMPERATURE)  # NaN counts as greedy
        top_k = plan.top_k[sel].astype(np.int64)
        top_k[top_k < 0] = 0
        top_p = plan.top_p[sel].astype(np.float32)
        min_p = np.clip(plan.min_p[sel].astype(np.float32), 0.0, 1.0)
        rep = plan.repetition_penalty[sel].astype(np.float32)
        freq = plan.frequency_penalty[sel].astype(np.float32)
        pres = plan.presence_penalty[sel].astype(np.float32)
        # Filters cannot change a greedy row's token (the top token always survives them).
        k_active = (top_k > 0) & ~greedy
        p_active = (top_p < 1.0) & ~greedy
        kp_rows = np.flatnonzero(k_active | p_active)

        # One host->device copy for all per-row floats instead of one per field.
        floats = dev(
            np.stack([np.where(greedy, 1.0, temp), top_p, min_p, rep, freq, pres]).astype(np.float32), torch.float32
        )

        # The position of the token being sampled = the position after the request's last
        # token this step. A seeded request draws the same noise for it however it is batched.
        last_tok = plan.query_start[1:][sel].astype(np.int64) - 1
        positions = plan.positions[last_tok].astype(np.int64) + 1
        seeded_mask = plan.has_seed[sel].astype(bool) & ~greedy
        seeded_rows = np.flatnonzero(seeded_mask)
        gen_seeds = row_seeds(plan.seed[sel][seeded_rows], positions[seeded_rows])
        seeded = list(zip(seeded_rows.tolist(), gen_seeds.tolist()))

        pen_rows, h_row, h_tok, h_gen = _penalty_history(plan, sel, rep, freq, pres)

        tlp = plan.top_logprobs[sel].astype(np.int32)
        lp_rows = np.flatnonzero(tlp >= 0)

        return SamplingBatch(
            num_rows=S,
            req_index=sel,
            greedy=dev(greedy, torch.bool),
            temperature=floats[0],
            top_k=dev(top_k, torch.int64),
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            frequency_penalty=floats[4],
            presence_penalty=floats[5],
            penalty_rows=dev(pen_rows, torch.int64),
            history_row=dev(h_row, torch.int64),
            history_token=dev(h_tok, torch.int64),
            history_generated=dev(h_gen, torch.float32),
            max_history_token=int(h_tok.max()) if len(h_tok) else -1,
            seeded=seeded,
            top_logprobs=tlp,
            logprob_rows=dev(lp_rows, torch.int64),
            max_top_logprobs=int(tlp.max()) if S and tlp.max() > 0 else 0,
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            any_top_p=bool(p_active.any()),
            top_p_without_k=bool((p_active & ~k_active).any()),
            top_k_or_p_rows=dev(kp_rows, torch.int64),
            top_k_or_p_all=len(kp_rows) == S,
            max_top_k=int(top_k[k_active].max()) if k_active.any() else 0,
            any_min_p=bool(((min_p > 0) & ~greedy).any()),
        )


def _penalty_history(plan: Plan, sel: np.ndarray, rep, freq, pres):
    """(penalty rows, pair row, pair token, pair is-generated) for the rows with a penalty.

    Vectorised gather of variable-length history slices: no per-request loop.
    """
    has_pen = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
    pen_rows = np.flatnonzero(has_pen)
    req = sel[pen_rows]
    start = plan.history_start[:-1][req].astype(np.int64)
    lens = plan.history_start[1:][req].astype(np.int64) - start
    total = int(lens.sum())
    pair_row = np.repeat(np.arange(len(req), dtype=np.int64), lens)
    seg_start = np.repeat(np.cumsum(lens) - lens, lens)
    offset = np.arange(total, dtype=np.int64) - seg_start  # index within the request's history
    tokens = plan.history[np.repeat(start, lens) + offset].astype(np.int64)
    generated = offset >= np.repeat(plan.history_prompt_lens[req].astype(np.int64), lens)
    keep = tokens >= 0  # a negative id cannot index the logits; it has nothing to penalise
    return pen_rows, pair_row[keep], tokens[keep], generated[keep].astype(np.float32)
