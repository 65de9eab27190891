"""Flags of `nsaserve serve`. Names follow SGLang's where one exists, so commands carry over."""

from __future__ import annotations

import argparse

# The "indexer" kernel backends of kernels/registry.py (a test keeps the two lists equal; the
# registry is not imported here, so that parsing flags never imports torch).
INDEXER_BACKENDS = ("torch", "triton", "torch_fp8q", "triton_fp8q")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument(
        "--model-path",
        "--model",
        dest="model_path",
        default=None,
        help="Hugging Face model directory (config.json, safetensors, tokenizer.json). Default: the embedded tiny model.",
    )
    m.add_argument("--served-model-name", default=None, help="model name the API reports and accepts (default: the directory name)")
    m.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto", help="weight and activation dtype; auto = the config's torch_dtype")
    m.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto", help="KV cache storage; auto = the model dtype")
    m.add_argument(
        "--load-format",
        choices=["safetensors", "random"],
        default="safetensors",
        help="random: weights drawn on the device by the GLM-5-shaped generator (seed 0) for the config in --model-path; "
        "nothing is read from disk but config and tokenizer. For benchmarks.",
    )
    m.add_argument("--context-length", type=int, default=None, help="prompt plus completion tokens at most (default: the model's own limit)")
    m.add_argument(
        "--sampling-defaults",
        choices=["model", "openai"],
        default="model",
        help="values of the sampling fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty): "
        "model = those the model's generation_config.json sets, OpenAI's for the rest (as vLLM and SGLang do); "
        "openai = always OpenAI's. A request's own values always win",
    )
    m.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto", help="sparse MLA and lightning-indexer kernels; auto = triton on CUDA for bf16/fp16 models, else torch")
    m.add_argument(
        "--indexer-backend",
        choices=["auto", *INDEXER_BACKENDS],
        default="auto",
        help="lightning-indexer kernels (scores + top-k), instead of --attention-backend's; auto = the same as "
        "--attention-backend. The _fp8q backends round the query to fp8 against an fp8 index-key cache "
        "(--kv-cache-dtype fp8_e4m3), as DeepSeek-V3.2's own inference does: faster for long prompts (an 8K-token "
        "prompt's indexer layer 0.99 against 1.66 ms on an H200), while the default keeps float32-exact scores",
    )
    m.add_argument(
        "--dense-prefill",
        choices=("auto", "on", "off"),
        default="auto",
        help="dense (MHA-form) attention for prompt chunks of 72 or more tokens whose contexts fit the indexer's "
        "top-k, where sparse attention would select every position anyway (the step's other requests stay "
        "sparse); auto = on for CUDA devices, off on CPU",
    )
    m.add_argument("--model-executor", choices=["model", "null"], default="model", help="'null' returns deterministic tokens without running a model: only for measuring the router")

    r = p.add_argument_group("parallelism and devices")
    r.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1, help="tensor-parallel worker processes (one per GPU)")
    r.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="data-parallel attention (SGLang's meaning, dp size = tp): each rank holds full attention weights and "
        "its own KV pool and serves its own requests; MLPs and experts stay tensor/expert parallel. Cuts the "
        "replicated KV and attention work of large tp; needs --tp >= 2",
    )
    r.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available, else cpu")
    r.add_argument("--mem-fraction-static", type=float, default=0.85, help="GPU memory fraction for weights plus KV cache")
    r.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (default on CPU: 65536; on GPU: from free memory)")
    r.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    r.add_argument("--moe-backend", choices=["auto", "torch", "triton"], default="auto", help="MoE routing and routed experts: torch (reference) or triton (fused routing, NVFP4 W4A16 expert kernels; NVFP4 experts only); auto = triton on CUDA for NVFP4 experts, else torch")

    s = p.add_argument_group("scheduling")
    s.add_argument("--max-running-requests", type=int, default=256, help="requests decoding at once")
    s.add_argument("--max-queued-requests", type=int, default=4096, help="waiting requests beyond which new ones get 429")
    s.add_argument("--max-prefill-tokens", type=int, default=16384, help="prompt tokens per step")
    s.add_argument("--chunked-prefill-size", type=int, default=8192, help="split longer prompts into chunks of this size; -1 disables")
    s.add_argument("--disable-radix-cache", action="store_true", help="do not reuse cached prompt prefixes")
    s.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="order waiting and running requests by their `priority` field (larger first), arrival breaking ties; a waiting request that cannot be admitted preempts running ones less urgent by the threshold (without this flag `priority` is ignored)",
    )
    s.add_argument("--schedule-low-priority-values-first", action="store_true", help="with priority scheduling, smaller `priority` values go first")
    s.add_argument(
        "--priority-scheduling-preemption-threshold",
        type=int,
        default=10,
        help="how much more urgent a waiting request must be to preempt a running one",
    )
    s.add_argument("--disable-cuda-graph", action="store_true", help="run decode steps eagerly, without CUDA graphs")
    s.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None, help="the decode batch sizes captured as CUDA graphs, instead of the default buckets up to --cuda-graph-max-bs (each is one capture per context bucket; fewer shorten startup, a batch runs in the next size up; per rank with --enable-dp-attention)")
    s.add_argument("--cuda-graph-max-bs", type=int, default=256, help="largest decode batch captured as a CUDA graph (graphs need graph-safe kernel backends)")
    s.add_argument(
        "--cuda-graph-max-context",
        type=int,
        default=None,
        help="longest context (tokens) a decode CUDA graph covers; longer ones run eagerly (default: the context length)",
    )
    s.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="plan each step only after the previous step's result (by default the next one is planned while one runs)",
    )

    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (use 0.0.0.0 to listen on all interfaces)")
    h.add_argument("--port", type=int, default=30000, help="port to listen on (0: a free one, named in the ready line)")
    h.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on API requests")
    h.add_argument("--max-request-bytes", type=int, default=32 * 1024 * 1024, help="larger request bodies get 413")
    h.add_argument("--max-connections", type=int, default=4096, help="open connections at most; at the cap the longest-idle one is closed for a new one")
    h.add_argument("--header-timeout", type=float, default=15.0, help="seconds a client has to send its request headers")
    h.add_argument("--body-timeout", type=float, default=60.0, help="seconds a client has to send its request body (then 408)")
    h.add_argument("--keep-alive-timeout", type=float, default=10.0, help="seconds an idle connection stays open between requests (the header timeout caps it)")

    c = p.add_argument_group("chat output")
    c.add_argument(
        "--reasoning-parser",
        choices=["deepseek-r1", "deepseek-v3", "glm45"],
        default=None,
        help="return the model's <think>...</think> as reasoning_content (SGLang's names)",
    )
    c.add_argument(
        "--tool-call-parser",
        choices=["deepseekv32", "glm45", "glm47"],
        default=None,
        help="return the model's tool-call markup as tool_calls: glm45/glm47 for GLM-4.5/4.7/5, deepseekv32 for DeepSeek-V3.2",
    )

    w = p.add_argument_group("workers")
    w.add_argument("--worker-transport", choices=["ipc", "tcp"], default="ipc", help="ipc sockets in a private directory, or tcp for workers on other machines")
    w.add_argument("--worker-host", default="127.0.0.1", help="host the router binds its worker sockets on (tcp)")
    w.add_argument("--worker-base-port", type=int, default=31000, help="first of tp + 1 ports for the worker sockets (tcp)")
    w.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for every worker's hello")
    w.add_argument(
        "--skip-server-warmup",
        action="store_true",
        help="on GPUs, serve without first running one synthetic step of each shape bucket (prompt sizes, decode "
        "batch sizes) to compile the kernels; the first requests of each new size then wait for those compiles",
    )
    w.add_argument(
        "--disable-worker-pipeline",
        action="store_true",
        help="each worker finishes step N (its tokens back on the host) before launching step N+1; by default "
        "it launches N+1 first (the next plan's references to N's tokens resolved on the device), hiding the "
        "host work between steps",
    )
    w.add_argument("--heartbeat-timeout", type=float, default=5.0, help="a worker silent this long is declared dead")
    w.add_argument(
        "--restart-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after a worker dies or goes silent, restart the whole worker group and serve again (503 with Retry-After meanwhile)",
    )
    w.add_argument(
        "--max-worker-restarts",
        type=int,
        default=3,
        help="restarts allowed within 10 minutes; past that, serve stops restarting and answers 503 until stopped",
    )
    w.add_argument("--random-seed", type=int, default=0, help="seed for unseeded sampling")
    w.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")


def http_limits(args: argparse.Namespace) -> dict:
    """The router's configuration from the HTTP flags (and --context-length, which the router enforces)."""
    return {
        "max_request_bytes": args.max_request_bytes,
        "max_connections": args.max_connections,
        "header_timeout_s": args.header_timeout,
        "body_timeout_s": args.body_timeout,
        "keep_alive_timeout_s": args.keep_alive_timeout,
        "context_length": args.context_length,
    }
