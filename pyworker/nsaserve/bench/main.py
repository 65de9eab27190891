"""`nsaserve bench`: build the dataset, warm up, run each concurrency level, report."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import resource
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .client import HttpClient, ProtocolError
from .datasets import Conversation, random_dataset, shared_prefix_dataset, warmup_dataset
from .metrics import summarize
from .openai_api import ApiOptions
from .plot import matplotlib_available, plot_sweep
from .report import document, format_run, format_sweep, write_json
from .runner import arrival_times, run_load
from .server_metrics import parse_counters, prefix_hit_rate


class BenchError(RuntimeError):
    """A problem reported in one line before exiting non-zero."""


def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def vocab_size(args: argparse.Namespace) -> int | None:
    if args.random_vocab_size is not None:
        return args.random_vocab_size
    if args.tokenizer:
        config = Path(args.tokenizer) / "config.json"
        try:
            return int(json.loads(config.read_text())["vocab_size"])
        except (OSError, KeyError, ValueError) as e:
            raise BenchError(f"cannot read vocab_size from {config}: {e}") from e
    return None


def prompt_vocab(args: argparse.Namespace) -> int | None:
    """The vocabulary size to draw token ids from, or None for text prompts."""
    chat = args.backend == "openai-chat"
    if args.prompt_type == "text" or (args.prompt_type == "auto" and chat):
        return None
    if chat:
        raise BenchError("--backend openai-chat sends text; use --prompt-type text or auto")
    vocab = vocab_size(args)
    if vocab is None and args.prompt_type == "token-ids":
        raise BenchError("token-id prompts need --random-vocab-size or --tokenizer MODEL_DIR")
    return vocab


# Random streams: one per (seed, sweep level, purpose). Each level gets fresh prompts, else a
# later level would find the earlier level's prompts in the server's prefix cache.
DATASET, WARMUP, ARRIVALS = 0, 1, 2


def rng_for(args: argparse.Namespace, level: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng([args.seed, level, purpose])


def build_dataset(args: argparse.Namespace, rng: np.random.Generator, num_prompts: int, vocab: int | None) -> list[Conversation]:
    if args.dataset_name == "random":
        return random_dataset(rng, num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, vocab)
    return shared_prefix_dataset(
        rng, num_prompts, args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len, args.gsp_num_turns, vocab
    )


async def scrape_counters(client: HttpClient) -> dict[str, float] | None:
    try:
        status, text = await client.get_text("/metrics")
    except (OSError, ProtocolError, ValueError):
        return None
    return parse_counters(text) if status == 200 else None


async def served_model(client: HttpClient) -> str:
    try:
        status, text = await client.get_text("/v1/models")
        if status != 200:
            raise ValueError(f"HTTP {status}")
        return json.loads(text)["data"][0]["id"]
    except (OSError, ProtocolError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"cannot read the model name from /v1/models ({type(e).__name__}: {e}); pass --model") from e


async def run_level(
    client: HttpClient,
    opts: ApiOptions,
    args: argparse.Namespace,
    vocab: int | None,
    level: int,
    max_concurrency: int | None,
    num_prompts: int,
) -> dict:
    conversations = build_dataset(args, rng_for(args, level, DATASET), num_prompts, vocab)
    if args.warmup_requests > 0:
        warm = warmup_dataset(rng_for(args, level, WARMUP), conversations[0].turns[0], args.warmup_requests, vocab)
        results, _ = await run_load(client, opts, warm, [0.0] * len(warm), max_concurrency)
        if not any(r.ok for r in results):
            raise BenchError(f"every warm-up request failed: {results[0].error}")
    starts = arrival_times(rng_for(args, level, ARRIVALS), len(conversations), args.request_rate)
    n_requests = sum(len(c.turns) for c in conversations)
    before = await scrape_counters(client)
    with tqdm(total=n_requests, disable=args.disable_tqdm, desc=f"concurrency {max_concurrency or 'unlimited'}", unit="req") as bar:
        results, duration = await run_load(client, opts, conversations, starts, max_concurrency, lambda r: bar.update(1))
    after = await scrape_counters(client)
    return {
        "base_url": base_url(args),
        "model": opts.model,
        "endpoint": opts.path,
        "max_concurrency": max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "num_conversations": len(conversations),
        "num_requests": n_requests,
        "prefix_hit_rate": prefix_hit_rate(before, after),
        # With a concurrency limit and no arrival process, the first max_concurrency requests are
        # one burst; the ones after it join a running batch (their TTFT is reported apart).
        "summary": summarize(
            results, duration, first_wave=max_concurrency if max_concurrency and math.isinf(args.request_rate) else 0
        ),
    }


def api_options(args: argparse.Namespace, model: str) -> ApiOptions:
    extra = {}
    if args.extra_request_body:
        extra = json.loads(args.extra_request_body)
        if not isinstance(extra, dict):
            raise BenchError("--extra-request-body must be a JSON object")
    return ApiOptions(
        model=model,
        chat=args.backend == "openai-chat",
        stream=not args.disable_stream,
        ignore_eos=not args.disable_ignore_eos,
        temperature=args.temperature,
        extra_body=extra,
        timeout_s=args.request_timeout,
    )


def levels(args: argparse.Namespace) -> list[tuple[int | None, int]]:
    """(max concurrency, prompts) for each run."""
    if not args.concurrency:
        return [(args.max_concurrency, args.num_prompts)]
    per = args.prompts_per_concurrency
    return [(c, per * c if per else args.num_prompts) for c in args.concurrency]


async def bench(args: argparse.Namespace) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = HttpClient(base_url(args), headers)
    try:
        vocab = prompt_vocab(args)
        print(f"prompts: {'random token ids below ' + str(vocab) if vocab else 'random words'}", file=sys.stderr)
        opts = api_options(args, args.model or await served_model(client))
        runs = []
        for level, (max_concurrency, num_prompts) in enumerate(levels(args)):
            run = await run_level(client, opts, args, vocab, level, max_concurrency, num_prompts)
            print(format_run(run), flush=True)
            runs.append(run)
        return runs
    finally:
        await client.close()


def json_args(args: argparse.Namespace) -> dict:
    """The flags as JSON values (an infinite rate becomes "inf": JSON has no infinity)."""
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items() if k != "func"}


def raise_open_file_limit() -> None:
    """One connection per request in flight: 1024 of them exceed the usual soft limit of 1024
    open files, so lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_bench(args: argparse.Namespace) -> int:
    if args.concurrency and args.max_concurrency:
        print("nsaserve bench: give --concurrency (a sweep) or --max-concurrency, not both", file=sys.stderr)
        return 2
    raise_open_file_limit()
    try:
        runs = asyncio.run(bench(args))
    except (BenchError, ProtocolError, ValueError, OSError) as e:
        print(f"nsaserve bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nsaserve bench: interrupted", file=sys.stderr)
        return 130
    if len(runs) > 1:
        print(format_sweep(runs))
    if args.output_file:
        doc = document(json_args(args), runs)
        write_json(args.output_file, doc)
        print(f"results: {args.output_file}")
        if args.concurrency:
            if matplotlib_available():
                png = str(Path(args.output_file).with_suffix(".png"))
                plot_sweep(runs, png, doc["command"])
                print(f"plot: {png}")
            else:
                print("matplotlib is not installed (pip install 'nsaserve[bench]'): no plot written")
    return 0 if any(r["summary"]["completed"] for r in runs) else 1
