"""The `nsaserve` command line: `nsaserve serve ...`, `nsaserve bench ...` (and `nsaserve version`)."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .bench.args import EXAMPLES, HelpFormatter, add_bench_arguments
from .serve_args import add_serve_arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nsaserve", description="Serve GLM-5 / DeepSeek-V3.2 sparse-attention MoE models.")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="start the router and the tensor-parallel workers, and serve the OpenAI-compatible API",
        description="Start the router (HTTP, tokenization, scheduling) and --tp worker processes, then serve "
        "the OpenAI-compatible API until Ctrl-C or SIGTERM. With no --model-path, serves the tiny embedded model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_arguments(serve)
    bench = sub.add_parser(
        "bench",
        help="measure an OpenAI-compatible server under load (throughput, TTFT, TPOT, ITL, latency)",
        description="Send a generated workload (random prompts, or multi-turn conversations behind a shared\n"
        "system prompt) to an OpenAI-compatible server at a request rate or concurrency, then report\n"
        "throughput, latency percentiles, failures and the server's prefix-cache hit rate.\n"
        "--concurrency runs a sweep.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    add_bench_arguments(bench)
    sub.add_parser("version", help="print the version")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        print(f"nsaserve {__version__}")
        return 0
    if args.command == "bench":
        from .bench.main import run_bench

        return run_bench(args)
    from .serve import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
