"""Flags of `nsaserve bench`. Names follow sglang.bench_serving where one exists, so commands
carry over (note the range ratio has sglang's meaning, not vLLM's)."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  # 1k/1k random token-id prompts (lengths 800..1024), 64 in flight, 2x64 warm-up requests
  nsaserve bench --tokenizer MODEL_DIR --random-input-len 1024 --random-output-len 1024 \\
      --random-range-ratio 0.8 --num-prompts 640 --max-concurrency 64 --warmup-requests 128

  # concurrency sweep, 10 prompts per unit of concurrency, JSON + PNG
  nsaserve bench --tokenizer MODEL_DIR --random-range-ratio 0.8 --concurrency 64,256,512,1024 \\
      --prompts-per-concurrency 10 --output-file results/sweep.json

  # 4-turn chats behind a 2048-token system prompt, 32 users at once; reports the prefix hit rate
  nsaserve bench --backend openai-chat --dataset-name shared-prefix --num-prompts 128 --max-concurrency 32
"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the flag help, and the examples kept as written."""


def positive_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:30000; overrides --host and --port")
    s.add_argument("--host", default="127.0.0.1", help="server host, when no --base-url")
    s.add_argument("--port", type=int, default=30000, help="server port, when no --base-url")
    s.add_argument("--backend", choices=["openai", "openai-chat"], default="openai", help="openai: /v1/completions; openai-chat: /v1/chat/completions (text prompts)")
    s.add_argument("--model", default=None, help="model name to send; None: the first one /v1/models lists")
    s.add_argument("--api-key", default=None, help="send 'Authorization: Bearer <key>'")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", choices=["random", "shared-prefix"], default="random", help="random: independent prompts; shared-prefix: multi-turn conversations behind one system prompt")
    d.add_argument("--num-prompts", type=int, default=1000, help="requests (random) or conversations (shared-prefix)")
    d.add_argument("--random-input-len", type=int, default=1024, help="longest prompt, in tokens (random)")
    d.add_argument("--random-output-len", type=int, default=1024, help="longest output, in tokens (random)")
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths are uniform in [max(1, floor(ratio*len)), len] (sglang's definition: 0 gives a mean of about len/2, 1 gives exactly len)")
    d.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="tokens of the system prompt every conversation shares (shared-prefix)")
    d.add_argument("--gsp-question-len", type=int, default=128, help="tokens of each user message (shared-prefix)")
    d.add_argument("--gsp-output-len", type=int, default=256, help="tokens of each reply (shared-prefix)")
    d.add_argument("--gsp-num-turns", type=int, default=4, help="turns per conversation (shared-prefix)")
    d.add_argument("--prompt-type", choices=["auto", "token-ids", "text"], default="auto", help="token-ids: random token ids (exact lengths, needs the vocabulary size); text: random words; auto: token ids when the vocabulary size is known and the backend is openai, else text")
    d.add_argument("--random-vocab-size", type=int, default=None, help="token ids are drawn below this; None: vocab_size from --tokenizer's config.json")
    d.add_argument("--tokenizer", default=None, help="model directory whose config.json gives the vocabulary size for token-id prompts")
    d.add_argument("--seed", type=int, default=1, help="seed for prompts, lengths and arrival times")

    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=float, default=float("inf"), help="new requests (conversations) per second, Poisson arrivals; inf sends them all at once")
    lo.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (conversations, for shared-prefix); None: no limit")
    lo.add_argument("--concurrency", type=positive_int_list, default=None, help="sweep: comma-separated --max-concurrency levels, run one after another, e.g. 64,256,512,1024")
    lo.add_argument("--prompts-per-concurrency", type=int, default=None, help="in a sweep, send this many prompts per unit of concurrency at each level; None: --num-prompts at every level")
    lo.add_argument("--warmup-requests", type=int, default=1, help="requests sent (and not measured) before each run, with their own random prompts")
    lo.add_argument("--disable-ignore-eos", action="store_true", help="let generation stop at EOS (output lengths are then not exact)")
    lo.add_argument("--disable-stream", action="store_true", help="non-streaming requests (TTFT is then the whole latency, no ITL)")
    lo.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    lo.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body")
    lo.add_argument("--request-timeout", type=float, default=None, help="seconds before a request counts as failed; None: no limit")

    o = p.add_argument_group("output")
    o.add_argument("--output-file", default=None, help="write the results as JSON here (a sweep also writes a PNG plot next to it)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
