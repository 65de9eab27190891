"""CUDA graphs for decode steps: the forward pass captured once per (batch bucket, context bucket)
at startup and replayed for every decode step that fits, instead of a few hundred kernel launches.

A graph replays fixed kernels on fixed addresses, so each one reads a fixed-shape batch from
static buffers the step's plan is copied into (one host-to-device copy a step):

    input_ids, positions, out_slots, seq_lens   [bs]          (padded rows: token 0, position 0,
    page_table                                  [bs, L / ps]   seq_len 1, scratch page)

and expands the page table into kv_slots on the device with a fixed span of L slots per request
(positions past a request's end point at the pool's scratch page). The batch is marked
static_kv_len = L, so the indexer takes its row metadata from the device. Padded rows write their
KV to the scratch page and their logits are dropped; real rows' logits come out in plan order.

Only plans of the kind the graphs were captured for replay: decode (one token per request),
every request sampling and none asking for prompt logprobs, at most max_bs requests, every context
within the largest L. Anything else runs eagerly.

Under tensor parallelism (NCCL) the all-reduces and the logits all-gather are captured with the
rest: every rank captures the same graphs in the same order and, since every rank receives the
same plans and picks a graph from the plan alone, replays the same graph for the same step, so
the collectives inside pair up as they do eagerly. The warm-up forwards before each capture have
already created the NCCL communicator (it cannot be created inside a capture).

Under data-parallel attention (model/dp_attention.py) a graph's batch is this rank's requests
(local page ids), padded to the bucket of the busiest rank's count: every rank derives the same
bucket from the plan, so the all-gathers and reduce-scatters around the MLPs move bs rows per rank
in every replay, and the logits of all ranks come back as rank blocks of bs rows, put in plan
order after the replay. Batch buckets are then per rank. Graphs are only built when every kernel backend
the model uses is graph-safe (kernels.registry.graph_safe): a host synchronisation inside a
capture fails or, worse, bakes one step's data into every replay.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..kernels.registry import graph_safe
from ..model.dp_attention import DPStep, before_in_rank, local_plan
from ..protocol.messages import Plan
from ..protocol.validate import request_ranks
from .batch import ForwardBatch
from .host_to_device import upload

# Context buckets start here (or at the model's max context if smaller) and double up to it. A
# graph's indexer scores and top-k run over its whole bucket, so short contexts want small ones.
MIN_LEN_BUCKET = 1024


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, every multiple of 16 up to 256, then every multiple of 64 up to max_bs (and
    max_bs itself). Padding a batch of 257 to 320 wastes little of a step whose weights dominate,
    and the coarser steps keep the capture count (and startup time) down at large max_bs."""
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    out = small + list(range(16, min(max_bs, 256) + 1, 16)) + list(range(320, max_bs, 64))
    return sorted({b for b in out if b < max_bs} | {max_bs})


def len_buckets(max_context: int, page_size: int) -> list[int]:
    """Per-request kv spans: powers of two from MIN_LEN_BUCKET up to max_context, in whole pages."""
    whole = lambda n: -(-n // page_size) * page_size  # noqa: E731
    out, n = [], min(MIN_LEN_BUCKET, max_context)
    while n < max_context:
        out.append(whole(n))
        n *= 2
    return sorted(set(out + [whole(max_context)]))


def graph_blockers(runner) -> list[str]:
    """Why decode graphs cannot be used with this runner (empty: they can)."""
    reasons = []
    if runner.device.type != "cuda":
        reasons.append(f"the device is {runner.device.type}, not cuda")
    if runner.tp.size > 1:
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_initialized() else None
        if backend != "nccl":
            over = backend or "no process group"
            reasons.append(f"tensor parallelism over {over}: only NCCL collectives are captured")
    for kind, name in sorted(runner.model.backends.items()):
        if not graph_safe(kind, name):
            reasons.append(f"the {kind} backend {name!r} is not graph-safe (it synchronises with the host)")
    quantized_moe = any(
        getattr(getattr(layer.mlp, "w13", None), "quantized", False) for layer in runner.model.model.layers
    )
    if quantized_moe and runner.model.backends.get("moe_experts") in ("torch", "torch_dense"):
        reasons.append("quantised experts are dequantised per step for the torch MoE (torch.unique)")
    return reasons


def plan_fits(plan: Plan, max_bs: int, max_len: int, per_rank: np.ndarray | None = None) -> bool:
    """Whether a plan can replay a decode graph (see the module docstring). per_rank: under
    data-parallel attention, each rank's request count (max_bs then bounds the largest)."""
    n = plan.num_reqs
    most = n if per_rank is None else int(per_rank.max(initial=0))
    return (
        plan.mode == "decode"
        and 0 < n
        and most <= max_bs
        and plan.num_tokens == n
        and bool(plan.sample.all())
        and not plan.prompt_logprobs.any()
        and int(plan.cached_lens.max()) + 1 <= max_len
    )


class _Graph:
    def __init__(self, bs: int, length: int, n_pages: int):
        self.bs, self.len, self.n_pages = bs, length, n_pages
        self.words = 4 * bs + bs * n_pages  # int64 words of static input
        self.graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Captures decode graphs for a ModelRunner and replays them (see the module docstring)."""

    def __init__(self, runner, max_bs: int, max_len: int | None = None, log=print, capture: bool | None = None,
                 bs_list: list[int] | None = None):  # fmt: skip
        """max_len: the longest context a graph covers (default the model's); longer contexts
        run eagerly. Every context bucket multiplies the graphs captured.
        capture=False (the default off CUDA) builds no graphs: run() then executes the same static
        batch eagerly, which is how CPU tests check the padded layout and buffers.
        bs_list: the batch buckets to capture instead of batch_buckets(max_bs); max_bs is then
        its largest."""
        self.runner = runner
        # Data-parallel attention: a graph's batch is each rank's (bs rows per rank, padded), and
        # it returns the logits of all ranks' rows, rank r's at [r * bs, (r + 1) * bs).
        self.dp = runner.dp_size if getattr(runner, "dp_attention", False) else 1
        self.ps = runner.page_size
        self.scratch_page = runner.pool.scratch_page
        self.bs_buckets = sorted(set(bs_list)) if bs_list else batch_buckets(max_bs)
        self.max_bs = max_bs = self.bs_buckets[-1]
        lens = len_buckets(min(max_len or runner.max_context, runner.max_context), self.ps)
        self.len_buckets = lens
        self.max_len = lens[-1]
        words = max_bs * (4 + lens[-1] // self.ps)
        dev = runner.device
        # Static input: one int64 buffer; each graph views its first `words` as its own layout.
        self.static = torch.zeros(words, dtype=torch.int64, device=dev)
        # Every graph ends by copying its logits here: one [max_bs, vocab] buffer for all graphs
        # rather than one per graph (at a 150K vocabulary those add up to gigabytes). In the model's
        # dtype, as lm_head computes them: run() returns a float32 copy of the rows, or (for the
        # executor's sampler, which reads them before the next replay) the rows themselves.
        logits_dtype = runner.model.lm_head.weight.dtype
        self.out = torch.zeros(max_bs * self.dp, runner.vocab_size, dtype=logits_dtype, device=dev)
        # Two pinned staging buffers, alternated, so that the host never rewrites one whose copy
        # may still be pending.
        cuda = dev.type == "cuda"
        self.staging = [torch.zeros(words, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.copied = [None, None]
        self.turn = 0
        self.graphs = {(b, n): _Graph(b, n, n // self.ps) for b in self.bs_buckets for n in lens}
        self.capture_s = 0.0
        self.capture_bytes = 0
        self.replays = 0
        if cuda if capture is None else capture:
            self._capture(log)

    # ---- building the static batch (inside the capture) ------------------------------------------

    def _views(self, g: _Graph):
        bs = g.bs
        s = self.static[: g.words]
        return s[:bs], s[bs : 2 * bs], s[2 * bs : 3 * bs], s[3 * bs : 4 * bs], s[4 * bs :].view(bs, g.n_pages)

    def _forward(self, g: _Graph, out: torch.Tensor | None = None) -> torch.Tensor:
        """The static batch's logits; out: a buffer lm_head may write them into (model.forward)."""
        bs, length, dev = g.bs, g.len, self.runner.device
        input_ids, positions, out_slots, seq_lens, page_table = self._views(g)
        pos = torch.arange(length, device=dev)
        slots = page_table[:, pos // self.ps] * self.ps + pos % self.ps
        scratch = self.scratch_page * self.ps
        kv_slots = torch.where(pos[None, :] < seq_lens[:, None], slots, scratch).reshape(-1)
        reqs = torch.arange(bs + 1, device=dev)
        batch = ForwardBatch(
            mode="decode", num_reqs=bs, num_tokens=bs, page_size=self.ps,
            input_ids=input_ids, positions=positions, token_req=reqs[:bs],
            query_start=reqs.to(torch.int32), cached_lens=(seq_lens - 1).to(torch.int32),
            seq_lens=seq_lens.to(torch.int32), out_slots=out_slots,
            kv_start=(reqs * length).to(torch.int32), kv_slots=kv_slots, logits_index=reqs[:bs],
            query_start_host=list(range(bs + 1)), seq_lens_host=[length] * bs, cached_lens_host=[length - 1] * bs,
            static_kv_len=length,
        )  # fmt: skip
        if self.dp == 1:
            return self.runner.forward(batch, float_logits=False, logits_out=out)
        # Every rank runs bs rows (its requests, then padding), so every collective's block is bs
        # rows and the logits come back in rank blocks of bs (the plan order is restored in run()).
        n = self.dp
        dp = DPStep(group=self.runner.tp, local_plan=None, tokens=[bs] * n, logit_rows=[bs] * n,
                    logit_order=torch.arange(n * bs, device=dev))  # fmt: skip
        return self.runner.model(batch, self.runner.pool, dp, float_logits=False)

    def _fill_idle(self, g: _Graph) -> None:
        """Every row a padded one (what capture and warm-up run on)."""
        host = self.staging[0][: g.words].numpy()
        self._pack(host, g, None)
        self.static[: g.words].copy_(self.staging[0][: g.words])

    # ---- capture ------------------------------------------------------------------------------------

    def _capture(self, log) -> None:
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        # Entering a capture empties the allocator's cache; empty it first, or the blocks freed
        # there (load-time temporaries) make the capture's own cost come out negative.
        torch.cuda.empty_cache()
        reserved0 = torch.cuda.memory_reserved(dev)
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Under tensor parallelism the process group's watchdog thread queries the events of
        # earlier collectives while we capture; "thread_local" keeps those calls legal (only this
        # thread's unsafe calls break a capture), where "global" would fail the capture on them.
        mode = "thread_local" if self.runner.tp.size > 1 else "global"
        side = torch.cuda.Stream(dev)
        # Largest first: later (smaller) graphs reuse the pool's blocks.
        for key in sorted(self.graphs, reverse=True):
            g = self.graphs[key]
            self._fill_idle(g)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles Triton kernels, settles allocator and cuBLAS state
                    self._forward(g)
            torch.cuda.current_stream(dev).wait_stream(side)
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph, pool=pool, capture_error_mode=mode):
                # lm_head writes into the shared buffer where it can (one rank); else one copy.
                out = self.out[: g.bs * self.dp]
                logits = self._forward(g, out)
                if logits.data_ptr() != out.data_ptr():
                    out.copy_(logits)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        # What the capture kept: the graphs' shared pool and allocator blocks grown on the way.
        self.capture_bytes = torch.cuda.memory_reserved(dev) - reserved0
        log(
            f"captured {len(self.graphs)} decode CUDA graphs (batch {self.bs_buckets}, context {self.len_buckets}) "
            f"in {self.capture_s:.1f} s, {self.capture_bytes / 2**20:.0f} MiB"
        )

    # ---- replay -------------------------------------------------------------------------------------

    def _ranks(self, plan: Plan) -> np.ndarray | None:
        """Each request's rank under data-parallel attention (None without it)."""
        return request_ranks(plan, self.runner.num_pages) if self.dp > 1 else None

    def _per_rank(self, ranks: np.ndarray | None) -> np.ndarray | None:
        return None if ranks is None else np.bincount(ranks, minlength=self.dp)[: self.dp]

    def fits(self, plan: Plan) -> bool:
        return plan_fits(plan, self.max_bs, self.max_len, self._per_rank(self._ranks(plan)))

    def _pick(self, plan: Plan, ranks: np.ndarray | None) -> _Graph:
        """The same graph on every rank: batch bucket of the largest rank's requests, context bucket
        of the plan's longest context."""
        per_rank = self._per_rank(ranks)
        n = plan.num_reqs if per_rank is None else int(per_rank.max())
        longest = int(plan.cached_lens.max()) + 1
        bs = next(b for b in self.bs_buckets if b >= n)
        length = next(x for x in self.len_buckets if x >= longest)
        return self.graphs[(bs, length)]

    def _pack(self, host: np.ndarray, g: _Graph, plan: Plan | None) -> None:
        """The plan's rows into g's static layout (host int64 [g.words]); other rows padded."""
        bs, n_pages = g.bs, g.n_pages
        n = 0 if plan is None else plan.num_reqs
        input_ids, positions, out_slots, seq_lens = (host[k * bs : (k + 1) * bs] for k in range(4))
        page_table = host[4 * bs : g.words].reshape(bs, n_pages)
        input_ids[n:] = 0
        positions[n:] = 0
        out_slots[n:] = self.scratch_page * self.ps
        seq_lens[n:] = 1
        page_table[n:] = self.scratch_page
        if n:
            input_ids[:n] = plan.input_ids
            positions[:n] = plan.positions
            out_slots[:n] = plan.out_slots
            seq_lens[:n] = plan.cached_lens.astype(np.int64) + 1
            # Request i's first n_pages pages (a request may hold fewer: the rest stay scratch).
            start = plan.page_start[:-1].astype(np.int64)
            have = np.minimum(np.diff(plan.page_start).astype(np.int64), n_pages)
            col = np.arange(n_pages)
            take = col[None, :] < have[:, None]
            src = np.minimum(start[:, None] + col[None, :], max(len(plan.page_table) - 1, 0))
            page_table[:n] = np.where(take, plan.page_table[src] if len(plan.page_table) else 0, self.scratch_page)

    def run(self, plan: Plan, patch=None, float32: bool = True) -> torch.Tensor:
        """Logits float32 [num_reqs, vocab] of a plan that fits, in plan order (a fresh tensor).
        patch: input tokens already on the device (worker/batch.InputPatch); a decode plan's token
        i is request i, which the static layout keeps at input_ids[i] (under data-parallel
        attention the layout holds this rank's requests, so the patch is cut to those).
        float32=False: the rows in the model's dtype, as lm_head computed them, without the float32
        copy; after a replay they are a view of the graphs' shared output buffer, valid until the
        next run() (work queued on this stream before it reads them safely)."""
        ranks = self._ranks(plan)
        g = self._pick(plan, ranks)
        k = self.turn
        self.turn ^= 1
        if self.copied[k] is not None:
            self.copied[k].synchronize()  # the copy that last read this staging buffer is done
        mine, order = plan, None
        if ranks is not None:
            # This rank packs its own requests (local page ids); the logits of request i sit at
            # rank(i) * bs + (its index among its rank's requests).
            mine = local_plan(plan, ranks, self.runner.tp.rank, self.runner.num_pages)
            index = ranks * g.bs + before_in_rank(ranks, np.ones(len(ranks), dtype=np.int64), self.dp)
            order = upload(index, self.runner.device)
            if patch is not None:
                patch = patch.for_requests(plan, ranks == self.runner.tp.rank)
        self._pack(self.staging[k][: g.words].numpy(), g, mine)
        self.static[: g.words].copy_(self.staging[k][: g.words], non_blocking=True)
        if patch is not None:
            patch.apply(self.static[: g.bs])  # input_ids are the layout's first bs words
        if g.graph is None:  # not captured: the same static batch, eagerly
            out = self._forward(g)
        else:
            ev = torch.cuda.Event()
            ev.record()
            self.copied[k] = ev
            g.graph.replay()
            self.replays += 1
            out = self.out[: g.bs * self.dp]
        # A float32 copy unless the caller reads the rows before the next replay overwrites them.
        if order is None:
            rows = out[: plan.num_reqs]
            return rows.to(torch.float32, copy=True) if float32 else rows
        rows = out.index_select(0, order)
        return rows.float() if float32 else rows
