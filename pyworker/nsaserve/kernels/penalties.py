"""Repetition (HF style) and frequency / presence (OpenAI style) penalties, in place on float32 logits.

Kind "penalties": (flat [S * V + 1] float32: the [S, V] logits row-major, then one spare slot that
absorbs writes which must not land, vocab V, history int64 (the plan's flat history array),
rows [P] (the penalised rows), start [P] and length [P] (each row's history in `history`),
prompt_len [P] (its first prompt_len entries are prompt tokens, the rest generated), pending [P]
(one more generated token per row, the one the pipelined worker appends, or -1), first [P] (the
row's first slot in a per-entry scratch: the exclusive sum of length + 1), repetition / frequency /
presence [S] float32, history_entries (the sum of `length`) and max_length (its largest), both
known on the host) -> None, the penalties applied in place.

For each distinct (row, token) of the history with the token in the vocabulary:
    x = logit > 0 ? logit / repetition : logit * repetition      (prompt and generated tokens)
    x = x - (frequency * count + presence * (count > 0))          (count: generated occurrences)
Every output is a pure function of its own logit and count, so the result does not depend on the
history's order; ids outside the vocabulary (and pending -1) are ignored.

The reference below expands the histories into (row, token) pairs on the device and sorts them to
find each distinct pair and its count (about fifty small launches); the "triton" backend
(triton_penalties.py) does it in one launch. (Counting into dense [rows, vocab] tensors cost a
dozen passes over the logits: 7.7 ms at 1024 rows of 1,200 tokens on an H200.)
"""

from __future__ import annotations

import torch

from .registry import register


def expand_history(history, start, length, prompt_len, pending, history_entries: int):
    """(index into the penalised rows, token, is-generated float32) of every entry: each row's
    history in order, then every row's pending token (-1 where it has none). history_entries
    (the sum of `length`, known on the host) fixes every size, so nothing waits for the device."""
    P = length.numel()
    device = length.device
    idx = torch.repeat_interleave(torch.arange(P, device=device), length, output_size=history_entries)
    seg_start = torch.cumsum(length, 0) - length
    offset = torch.arange(history_entries, device=device) - seg_start[idx]
    token = history[start[idx] + offset].long() if history_entries else torch.zeros(0, dtype=torch.int64, device=device)
    generated = (offset >= prompt_len[idx]).float()
    mine = torch.arange(P, device=device)
    return (
        torch.cat([idx, mine]),
        torch.cat([token, pending.long()]),
        torch.cat([generated, torch.ones(P, dtype=torch.float32, device=device)]),
    )


@register("penalties", "torch")
def penalties_torch(
    flat, vocab, history, rows, start, length, prompt_len, pending, first, rep, freq, pres, history_entries, max_length
) -> None:
    if rows.numel() == 0:
        return
    V = vocab
    SV = flat.numel() - 1
    idx, tok, gen = expand_history(history, start, length, prompt_len, pending, history_entries)
    row = rows.index_select(0, idx)
    valid = (tok >= 0) & (tok < V)
    key = torch.where(valid, row * V + tok.clamp(0, V - 1), SV)  # invalid ids sort last
    key, order = key.sort()
    firsts = torch.ones_like(valid)
    firsts[1:] = key[1:] != key[:-1]
    pair = firsts.cumsum(0) - 1  # the distinct pair each entry belongs to
    gen = gen.index_select(0, order)
    count = torch.zeros(key.numel(), dtype=torch.float32, device=key.device).index_add_(0, pair, gen)
    count = count.index_select(0, pair)  # exact: sums of 0s and 1s
    erow = row.index_select(0, order)
    r = rep.index_select(0, erow)
    f = freq.index_select(0, erow)
    q = pres.index_select(0, erow)
    x = flat.index_select(0, key.clamp(max=SV - 1))
    x = torch.where(x > 0, x / r, x * r)
    x = x - (f * count + q * (count > 0).float())
    flat.index_put_((torch.where(firsts & (key < SV), key, SV),), x)
