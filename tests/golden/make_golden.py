"""Writes the golden protocol vectors: for each message, NAME.json (its logical content) and
NAME.msgpack (its exact bytes). Both `cargo test` (router/tests/golden_vectors.rs) and pytest
(tests/protocol/test_golden.py) rebuild each message from the JSON, encode it and require the
same bytes, and decode the bytes back to the same content, so the two codecs cannot drift.

Regenerate only on a protocol change (with a version bump): python tests/golden/make_golden.py
"""

from __future__ import annotations

import json
from pathlib import Path

from golden_codec import build_message

HERE = Path(__file__).parent

PAGE = 4  # a small page size keeps the vectors readable


def req(
    id, input_ids, cached_len, pages, *, sample=True, prompt_logprobs=False, next_prompt_token=-1, input_prev_row=-1, history=(), history_prompt_len=0, history_reset=False, allowed_tokens=None, mask_late=False, **sampling
):
    slots = [pages[(cached_len + k) // PAGE] * PAGE + (cached_len + k) % PAGE for k in range(len(input_ids))]
    return {
        "id": id,
        "input_ids": list(input_ids),
        "cached_len": cached_len,
        "pages": list(pages),
        "out_slots": slots,
        "sample": sample,
        "prompt_logprobs": prompt_logprobs,
        "next_prompt_token": next_prompt_token,
        "input_prev_row": input_prev_row,
        "history": list(history),
        "history_prompt_len": history_prompt_len,
        "history_reset": history_reset,
        "allowed_tokens": allowed_tokens,
        "mask_late": mask_late,
        "sampling": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "seed": None,
            "top_logprobs": None,
            "logit_bias": [],
            **sampling,
        },
    }


MESSAGES = {
    "plan_idle": {"kind": "plan", "step": 0, "page_size": PAGE, "requests": [], "released": []},
    "plan_decode": {
        "kind": "plan",
        "step": 41,
        "page_size": PAGE,
        "requests": [
            req(7, [11], 5, [3, 9], temperature=0.0, logit_bias=[[0, -100.0]]),
            req(2**40 + 3, [500], 8, [1, 2, 6], temperature=0.7, top_p=0.9, top_k=40, seed=1234, top_logprobs=2),
            # Planned while step 40 ran (overlap): its input is what row 3 of step 40 samples.
            req(12, [-1], 6, [4, 11], input_prev_row=3),
            # Penalised, its history sent before: only the token since (the workers hold the rest).
            req(13, [8], 9, [12, 13, 14], repetition_penalty=1.2, history=[8], history_prompt_len=4),
            # Structured output: only tokens 1, 33 and 64 (and nothing past token 95) may follow.
            req(14, [9], 3, [15], allowed_tokens=[2, 2, 1]),
            # Structured output planned while step 40 ran: its mask follows in a masks message.
            req(15, [-1], 2, [0], input_prev_row=4, mask_late=True),
        ],
        # Requests that ended since step 40: the workers drop their histories.
        "released": [5, 2**40 + 9],
    },
    # The founding crash's batch: a prefix-cached prefill, a fresh prefill (no cached prefix,
    # yet every field present) and a decode in one step, plus a non-final chunk that samples
    # nothing and a request whose penalties need its history.
    "plan_mixed": {
        "kind": "plan",
        "step": 2,
        "page_size": PAGE,
        "requests": [
            req(1, [5, 6, 7], 8, [0, 4, 10], prompt_logprobs=True, top_logprobs=0),
            req(2, [1, 2, 3, 4, 5, 6], 0, [5, 8], sample=False, prompt_logprobs=True, next_prompt_token=77),
            req(3, [9], 2, [7], repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=-0.25, history=[4, 4, 9], history_prompt_len=2, history_reset=True, min_p=0.05, logit_bias=[[4, -2.5], [9, 100.0]]),
        ],
        "released": [],
    },
    "result": {
        "kind": "result",
        "step": 2,
        "sampled": [
            {"req_id": 1, "token": 42, "logprob": -0.5, "top": [[42, -0.5]]},
            {"req_id": 3, "token": 7, "logprob": None, "top": []},
        ],
        "prompt_logprobs": [
            {"req_id": 1, "first_pos": 8, "tokens": [5, 6, 7], "entries": [[-1.25, [[5, -1.25], [9, -2.0]]], [-0.125, []], [-3.0, [[1, -0.25]]]]},
        ],
        "errors": [[2, "invalid plan: page id outside the pool of 16 pages"]],
        "forward_ms": 1.5,
    },
    "result_empty": {"kind": "result", "step": 9, "sampled": [], "prompt_logprobs": [], "errors": [], "forward_ms": 0.0},
    # Step 41's late masks, sent to rank 0 once step 40 is committed: request 15 may sample
    # tokens 0 and 40 only.
    "masks": {"kind": "masks", "step": 41, "masks": [[15, [1, 256]]]},
    "hello": {"kind": "hello", "version": 6, "rank": 1, "tp_size": 2, "pid": 4242, "model_id": "embedded", "num_pages": 1024, "page_size": 64, "max_context": 4096, "vocab_size": 512},
    "heartbeat": {"kind": "heartbeat", "rank": 0, "step": 77},
    "fatal": {"kind": "fatal", "rank": 1, "message": "model path /nonexistent does not exist"},
    "shutdown": {"kind": "shutdown"},
}


def main() -> None:
    for name, content in MESSAGES.items():
        (HERE / f"{name}.json").write_text(json.dumps(content, indent=1) + "\n")
        (HERE / f"{name}.msgpack").write_bytes(build_message(content))
    print(f"wrote {len(MESSAGES)} golden vectors to {HERE}")


if __name__ == "__main__":
    main()
