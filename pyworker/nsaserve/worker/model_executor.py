"""The real executor: the model forward on every rank, then sampling on rank 0."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

from ..model.dense_prefill import dense_prefill_on
from ..protocol.messages import Plan, PromptLogprobs, StepResult
from . import compile_watch
from .batch import InputPatch, prompt_logprob_rows, sample_rows
from .penalty_history import PenaltyHistories
from .pipeline import LaunchedStep
from .sampler import SamplingBatch, prompt_logprobs, sample
from .sampling_results import copy_to_host, prompt_entries, sampled_entries
from .step_log import DeviceMarks, StepLog


def resolve_model_path(path: str | None) -> str:
    if not path:
        raise FileNotFoundError("no model path given")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path} does not exist")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model path {path} has no config.json")
    return path


class ModelExecutor:
    def __init__(self, runner, device: torch.device, graphs=None):
        self.runner = runner
        self.device = device
        self.graphs = graphs  # DecodeGraphs, or None: every step runs eagerly
        self.model_id = runner.model_id
        self.num_pages = runner.num_pages
        self.page_size = runner.page_size
        self.max_context = runner.max_context
        self.vocab_size = runner.vocab_size
        # Data-parallel attention: the router's page ids span dp_size pools of num_pages (validation).
        self.dp_size = getattr(runner, "dp_size", 1)
        dense = bool(getattr(getattr(runner, "model", None), "dense_prefill", False))
        self.step_log = StepLog.from_env(runner.config.index_topk, dense, device)  # benchmarks only
        self._last_finish = 0.0  # perf_counter() at the last finish()
        self.histories = PenaltyHistories()  # rank 0's penalty histories (worker/penalty_history.py)

    @classmethod
    def from_args(cls, args) -> ModelExecutor:
        path = resolve_model_path(args.model_path)
        from ..model.runner import ModelRunner

        if args.device == "cuda":
            device = torch.device("cuda", args.rank % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        torch.manual_seed(args.seed)
        runner = ModelRunner(
            path,
            device=device,
            dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
            kv_cache_dtype=args.kv_cache_dtype,
            num_pages=args.num_pages,
            page_size=args.page_size,
            mem_fraction_static=args.mem_fraction_static,
            tp_rank=args.rank,
            tp_size=args.tp_size,
            load_format=getattr(args, "load_format", "safetensors"),
            dp_attention=getattr(args, "enable_dp_attention", False),
            dense_prefill=dense_prefill_on(getattr(args, "dense_prefill", "auto"), device),
        )
        moe_backend = getattr(args, "moe_backend", "auto")
        if moe_backend == "auto":  # the Triton expert kernels read NVFP4 stacks only
            moe_backend = "triton" if device.type == "cuda" and _has_nvfp4_experts(runner) else "torch"
        for kind in ("moe_route", "moe_experts"):  # --moe-backend picks both MoE kernels
            runner.set_backend(kind, moe_backend)
        attention_backend = getattr(args, "attention_backend", "auto")
        indexer_backend = getattr(args, "indexer_backend", "auto")
        runner.set_backend("attention", attention_backend)
        runner.set_backend("indexer", attention_backend if indexer_backend == "auto" else indexer_backend)
        for kind in ("rmsnorm", "rope", "kv_store", "index_key_store", "router_logits", "silu_mul"):  # small ops follow the device
            runner.set_backend(kind, "auto")
        executor = cls(runner, device, decode_graphs(runner, args))
        if getattr(args, "warmup_tokens", 0) > 0 and device.type == "cuda":
            # After the graphs: the warm-up's activations come out of the memory serving will use.
            from .warmup import WarmupShape, warm_up

            per_rank = -(-args.warmup_batch // runner.dp_size)
            shape = WarmupShape(args.warmup_tokens, per_rank, runner.max_context, runner.config.index_topk)
            warm_up(runner, shape, log=_rank0_log(runner))
        return executor

    def run(self, plan: Plan, is_rank0: bool) -> StepResult:
        return self.finish(self.launch(plan, is_rank0))

    def launch_is_quick(self, plan: Plan) -> bool:
        """Whether to launch `plan` before finishing the step in flight (worker/main.py's
        serve_pipelined). On a GPU, yes: a launch only queues work (measured on the H200 with
        every step launched ahead, eager prompt steps included). On the CPU a launch runs the
        whole step, which would hold the previous step's tokens back for all of it."""
        return self.device.type != "cpu"

    def launch(
        self, plan: Plan, is_rank0: bool, patch: InputPatch | None = None, after_forward=None, late_masks=None
    ) -> LaunchedStep:
        """Queues the step's device work (forward, sampling and the copy of its tokens, and
        logprobs where asked, to pinned host memory) without waiting for it. patch: input tokens
        already on the device (the previous step's samples, worker/pipeline.py). after_forward():
        called once the forward is queued, before the sampling's host work; the pipelined loop
        sends the previous step's result there, so it reaches the router that much sooner.
        late_masks(plan) -> (plan, errors): after that, the step's late structured-output masks
        (worker/main.py's late_masks_merger: rank 0 waits for them while the forward runs);
        requests whose mask is unusable sample unmasked and their tokens are not sent."""
        t0 = time.perf_counter()
        watch = compile_watch.active()
        if watch is not None:
            watch.plan = plan  # named in its log line if the step compiles anything
        marks = DeviceMarks() if self.step_log is not None and is_rank0 and self.device.type == "cuda" else None
        graph = self.graphs is not None and self.graphs.fits(plan)
        if marks is not None:
            marks.forward_queued()
        if graph:
            # A decode step: one row per request, all sampling. The rows stay in the graphs' output
            # buffer (model dtype): the sampler below reads them on this stream before the next
            # replay can overwrite them, and upcasts where it computes (the pick, penalties,
            # logprobs), so the float32 copy of every row (at 1024 rows and GLM-5's vocabulary,
            # 634 MB written a step) is skipped.
            logits = self.graphs.run(plan, patch, float32=False)
        else:
            logits = self.runner.forward_plan(plan, patch)
        if after_forward is not None:
            after_forward()
        mask_errors: list[tuple[int, str]] = []
        if late_masks is not None:
            plan, mask_errors = late_masks(plan)
        # The sampling parameters are built while the forward runs: their uploads go through
        # pinned memory (host_to_device.upload), so nothing here waits for the device.
        # Every plan goes through the histories on rank 0, in order, sampling or not (its
        # `released` ids and segments update what is held).
        whole, history_errors = self.histories.resolve(plan) if is_rank0 else (plan, [])
        n_sample = len(sample_rows(plan)) if is_rank0 else 0
        sb = SamplingBatch.from_plan(whole, self.device, patch) if n_sample else None
        prompt_rows = list(prompt_logprob_rows(plan)) if is_rank0 else []
        if graph and prompt_rows:
            logits = logits.float()  # kept past the launch: a copy of its own
        step = LaunchedStep(
            plan=plan, is_rank0=is_rank0, t0=t0, graph=graph, sb=sb, prompt_rows=prompt_rows, on_cpu=self.device.type == "cpu",
            failed=history_errors + mask_errors,
        )  # fmt: skip
        if not is_rank0:
            step.compiles = watch.take() if watch is not None else (0, 0.0)
            return step
        step.marks = marks
        # [rows, vocab] float32: kept past the launch only for prompt logprobs (a pipelined step's
        # logits would otherwise live beside the next step's).
        step.logits = logits if prompt_rows else None
        if n_sample:
            step.sampled = sample(logits[:n_sample], sb)
            if self.device.type == "cuda" and not prompt_rows:
                # The tokens (and logprobs where asked) go to pinned memory, waited for in
                # finish(), not here: the worker can queue the next step first.
                step.host, step.copied = copy_to_host(step.sampled, bool((sb.top_logprobs >= 0).any()))
        if marks is not None:
            marks.end_queued()
        if watch is not None:
            step.compiles = watch.take()
        return step

    def finish(self, step: LaunchedStep) -> StepResult:
        """Waits for a launched step's results and builds what rank 0 sends."""
        plan = step.plan
        result = StepResult(step=plan.step)
        if not step.is_rank0:
            return result
        if step.sampled is not None:
            if step.copied is not None:
                waited = time.perf_counter()
                step.copied.synchronize()
                if step.marks is not None:
                    step.marks.host["wait"] = time.perf_counter() - waited
            result.sampled = sampled_entries(plan, step.sb, step.host if step.host is not None else step.sampled)
        if step.failed:  # their rows were sampled with the rest; their tokens are not sent
            failed = {r for r, _ in step.failed}
            result.sampled = [e for e in result.sampled if e[0] not in failed]
            result.errors += step.failed
        row = step.sb.num_rows if step.sb is not None else 0
        for i, token_rows in step.prompt_rows:
            result.prompt_logprobs.append(self._prompt_logprobs(plan, i, step.logits[row : row + len(token_rows)]))
            row += len(token_rows)
        step.logits = None
        # From the step's launch, or from the previous step's result when the step was launched
        # before it (pipelined: it was queued behind that step on the device).
        now = time.perf_counter()
        result.forward_ms = (now - max(step.t0, self._last_finish)) * 1e3
        self._last_finish = now
        if self.step_log is not None:
            self.step_log.record(plan, result.forward_ms, step.graph, step.marks, step.compiles)
        return result

    def _prompt_logprobs(self, plan: Plan, i: int, rows: torch.Tensor) -> PromptLogprobs:
        """Row k predicts the token at position cached_len + k + 1: the next token of this chunk,
        or for the last row the first token of the next chunk (`next_prompt_token`)."""
        start, end = int(plan.query_start[i]), int(plan.query_start[i + 1])
        chunk = plan.input_ids[start:end].astype(np.int64)
        nxt = int(plan.next_prompt_token[i])
        targets = np.concatenate([chunk[1:], [nxt]]) if nxt >= 0 else chunk[1:]
        k = max(0, int(plan.top_logprobs[i]))
        lp, top_ids, top_lps = prompt_logprobs(rows[: len(targets)], torch.from_numpy(targets).to(rows.device), k)
        return PromptLogprobs(int(plan.req_ids[i]), int(plan.cached_lens[i]) + 1, targets.tolist(), prompt_entries(lp, top_ids, top_lps))


def _rank0_log(runner):
    def log(message: str) -> None:
        if runner.tp.rank == 0:
            print(f"[nsaserve worker] {message}", file=sys.stderr, flush=True)

    return log


def decode_graphs(runner, args):
    """Decode CUDA graphs for this runner, unless disabled, not on CUDA, or blocked by a kernel
    backend that is not graph-safe (said once on stderr)."""
    if getattr(args, "disable_cuda_graph", True) or runner.device.type != "cuda":
        return None
    from .cuda_graphs import DecodeGraphs, graph_blockers

    log = _rank0_log(runner)

    blockers = graph_blockers(runner)
    if blockers:
        log("CUDA graphs off: " + "; ".join(blockers))
        return None
    sizes = getattr(args, "cuda_graph_bs", None)
    max_bs = max(sizes) if sizes else args.cuda_graph_max_bs
    return DecodeGraphs(runner, max_bs, getattr(args, "cuda_graph_max_context", None), log=log, bs_list=sizes)


def _has_nvfp4_experts(runner) -> bool:
    from ..kernels.quant import NVFP4

    return any(getattr(getattr(layer.mlp, "w13", None), "precision", None) == NVFP4 for layer in runner.model.model.layers)
