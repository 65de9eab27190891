"""Dense (MHA-form) attention for prompt steps whose every context fits the indexer's top-k.

When no context exceeds index_topk, sparse attention selects every causal position, so it is plain
causal attention, and the non-absorbed form is cheaper for long prompt chunks: per head it attends
over keys [W_UK c | k_pe] (nope + rope dims) and values W_UV c (v dims) instead of the latent's
rank + rope and rank dims, at the price of expanding each context token's latent through kv_b_proj
once. SGLang takes this path for such prefills ("MHA one shot"). Per (query, key) pair and head:
absorbed 2 (R + P + R) FLOPs (1088 at GLM-5 and DeepSeek-V3.2 shapes), dense 2 (nope + P + v)
(GLM-5 1024, DeepSeek-V3.2 640); per context token and head the expansion costs 2 R (nope + v).

Same math as the absorbed path in attention.py: q_nope . (W_UK c) = (q_nope W_UK) . c, and
softmax(s) (c W_UV^T) = (softmax(s) c) W_UV^T. The latents are read back from the cache (the new
tokens' too, after their store), as the sparse kernels read them, so an fp8 cache rounds alike.

dense_requests is the host-side choice, made once per step and per request (StepMeta): with the
model's dense_prefill switch on, in an eager step (not a CUDA-graph decode), request i attends
densely when its context L_i fits the top-k and it brings enough new tokens q_i for the expansion
of its context to pay: per request, dense costs L_i E + q_i L_i D against q_i L_i S sparse (E the
expansion per context token, D and S the dense and absorbed cost per (query, key) pair), so dense
wins from q_i > E / (S - D) = DENSE_MIN_QUERIES. The other requests of the step (decode rows,
short chunks, contexts past the top-k) stay on the sparse path in the same step: the attention
splits the step's tokens between the two. DENSE_MIN_QUERIES is an estimate from the kernels'
measured rates (sparse MLA ~155 TFLOP/s in prefill, bf16 GEMMs ~600, causal attention assumed
~300). Measured where whole steps were dense (prompts of 1000 new tokens, fresh or after 1000
cached): 6-17% faster steps. Until 2026-12-01 the choice was one per step, on the sum over its
requests, so a prompt step with a few hundred decode rows beside it expanded those rows'
contexts too (a thousand context tokens through kv_b_proj for one query token each) and ran one
attention call per decode row: the likely cost behind the 512-prompt burst's worse TTFT with
dense attention on (bench/results/2026-12-01-glm5-shaped-h200-worker-pipeline.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.kv_cache_format import gather_latent

# New tokens of a request from which its prompt attends in the dense form.
DENSE_MIN_QUERIES = 72


# The --dense-prefill settings (serve_args.py and worker/main.py list them too: no torch import there).
DENSE_PREFILL_SETTINGS = ("auto", "on", "off")


def dense_prefill_on(setting: str, device: torch.device) -> bool:
    """The worker's --dense-prefill switch: "on", "off", or "auto", which is on for CUDA devices.
    Measured on the H200 (GLM-5 shapes, bench/results/2026-12-01-step-profile-dense-prefill): a
    16 x 1000-token prefill step 384 -> 355 ms, 16 x 1000 new after 1000 cached 500 -> 416 ms, one
    1000-token prompt 37.9 -> 35.8 ms. On CPU the sparse path stays the default (not measured)."""
    if setting not in DENSE_PREFILL_SETTINGS:
        raise ValueError(f"--dense-prefill takes auto, on or off, got {setting!r}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def dense_requests(query_start: list[int], seq_lens: list[int], index_topk: int) -> list[int]:
    """The requests (indices, in order) of an eager step that attend densely, switch aside: those
    with at least DENSE_MIN_QUERIES new tokens and a context within the top-k."""
    return [
        i for i, length in enumerate(seq_lens)
        if length <= index_topk and query_start[i + 1] - query_start[i] >= DENSE_MIN_QUERIES
    ]  # fmt: skip


# Context tokens whose keys and values one GEMM expands at most (a group of requests; a longer
# context has a group of its own): bounds the transient [H, N, nope + v] tensors (~470 MB at GLM-5
# shapes) however many requests a step holds.
GROUP_CONTEXT_TOKENS = 8192


def _groups(
    query_start: list[int], seq_lens: list[int], requests: list[int] | None = None
) -> list[list[tuple[int, int, int, int]]]:
    """Requests with new tokens (of `requests`, default all) as (q0, q1, kv start, context length),
    in groups of consecutive requests of at most GROUP_CONTEXT_TOKENS context tokens (one request
    alone may exceed it)."""
    chosen = None if requests is None else set(requests)
    groups: list[list[tuple[int, int, int, int]]] = []
    kv0 = total = 0
    for i, length in enumerate(seq_lens):
        q0, q1 = query_start[i], query_start[i + 1]
        if q1 > q0 and (chosen is None or i in chosen):
            if not groups or total + length > GROUP_CONTEXT_TOKENS or groups[-1][-1][2] + groups[-1][-1][3] != kv0:
                groups.append([])
                total = 0
            groups[-1].append((q0, q1, kv0, length))
            total += length
        kv0 += length
    return groups


def dense_attention(
    q: torch.Tensor,  # [T, H, nope + P] model dtype, the rope part roped
    w_uk: torch.Tensor,  # [H, nope, R]
    w_uv: torch.Tensor,  # [H, v, R]
    latent_cache: torch.Tensor,  # one layer's latent cache (kernels/kv_cache_format)
    batch,  # ForwardBatch with host lists
    softmax_scale: float,
    requests: list[int] | None = None,  # only these requests' tokens (default: every request's)
    out: torch.Tensor | None = None,  # [T, H, v] to write their rows into (default: a new tensor)
) -> torch.Tensor:
    """-> o [T, H, v] in q's dtype: each request's new tokens attend causally (bottom-right
    aligned: query j of a chunk after c cached tokens sees positions 0..c + j) over its context.
    With `requests`, only their rows of o are written."""
    # Imported here, not with the model: importing torch.nn.attention.bias makes torch create its
    # compile cache directory under TMPDIR, which a server that never takes this path must not leave.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    # Not cuDNN's attention: it builds an execution plan for each new sequence length, and a server
    # meets hundreds of prompt lengths (flash attention and the memory-efficient kernel are compiled
    # ahead; math is the fallback for shapes neither takes).
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    num_tokens, heads, qk_dim = q.shape
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    dtype = q.dtype
    o = out if out is not None else q.new_empty(num_tokens, heads, w_uv.shape[1])
    q_by_head = q.transpose(0, 1)  # [H, T, nope + P], a view
    qs, lens = batch.query_start_host, batch.seq_lens_host
    with sdpa_kernel(backends):
        for group in _groups(qs, lens, requests):
            kv0, kv1 = group[0][2], group[-1][2] + group[-1][3]
            # The group's contexts expanded by two GEMMs ([H, N, nope] and [H, N, v] over its N
            # context tokens): one GEMM shape per group, not a new one with every prompt length
            # (steps of a new prompt length ran 10-35 ms slower the first time on the H200).
            c, k_pe = gather_latent(latent_cache, batch.kv_slots[kv0:kv1], rank)  # [N, R], [N, P] float32
            c = c.to(dtype)
            # The keys as attention reads them, [H, N, nope + P]: the expansion GEMM writes the nope
            # part in place and the shared rope part is copied beside it, instead of concatenating
            # both per request.
            k_all = c.new_empty(heads, kv1 - kv0, qk_dim)
            torch.bmm(c.expand(heads, -1, -1), w_uk.transpose(1, 2), out=k_all[..., :nope])
            k_all[..., nope:] = k_pe.to(dtype)
            v_all = torch.matmul(c, w_uv.transpose(1, 2))
            for q0, q1, start, length in group:
                at = slice(start - kv0, start - kv0 + length)
                att = F.scaled_dot_product_attention(
                    q_by_head[:, q0:q1].unsqueeze(0), k_all[:, at].unsqueeze(0), v_all[:, at].unsqueeze(0),
                    attn_mask=causal_lower_right(q1 - q0, length), scale=softmax_scale,
                )  # fmt: skip
                o[q0:q1] = att[0].transpose(0, 1)
    return o
