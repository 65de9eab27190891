"""Triton sparse MLA decode against the torch reference on fresh random inputs.

Runs on the GPU where there is one (GLM-5 / DeepSeek-V3.2 shapes), else in Triton's CPU
interpreter at small shapes; skipped where Triton is not installed.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are built
pytest.importorskip("triton")

from nsaserve.kernels import kv_cache_format as fmt  # noqa: E402
from nsaserve.kernels.indexer import topk_to_slots  # noqa: E402
from nsaserve.kernels.registry import available, get_backend  # noqa: E402
from nsaserve.kernels.sparse_mla import sparse_mla_torch  # noqa: E402
from nsaserve.kernels.triton_sparse_mla import sparse_mla_decode, sparse_mla_prefill  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"


def make_case(tokens, heads, rank, rope, topk, fp8, seed):
    """Random queries, a latent cache, and per-token logical top-k lists (with -1 padding)."""
    g = torch.Generator().manual_seed(seed)
    ctx = 3 * topk  # each token's request has this many cached positions
    num_slots = tokens * ctx + 7
    kv_slots = torch.randperm(num_slots, generator=g)[: tokens * ctx]  # scattered physical slots
    cache = fmt.alloc_latent(num_slots, rank, rope, fp8, torch.bfloat16, "cpu")
    c = torch.randn(num_slots, rank, generator=g)
    k_pe = torch.randn(num_slots, rope, generator=g)
    fmt.write_latent(cache, torch.arange(num_slots), c, k_pe)
    pos = torch.stack([torch.randperm(ctx, generator=g)[:topk] for _ in range(tokens)])
    for t in range(tokens):  # some tokens use fewer than topk entries
        pos[t, topk - (t * 37) % (topk // 2) :] = -1
    base = torch.arange(tokens) * ctx
    q_lat = torch.randn(tokens, heads, rank, generator=g).bfloat16()
    q_pe = torch.randn(tokens, heads, rope, generator=g).bfloat16()
    return q_lat, q_pe, cache, pos, base, kv_slots


def rel_err(got, want):
    return float((got - want).norm() / want.norm())


def test_registered():
    assert "triton" in available("attention")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [64, 128] if GPU else [16, 24])
@pytest.mark.parametrize("logical", [False, True])
def test_matches_reference(fp8, heads, logical):
    if GPU:
        tokens, rank, rope, topk = 5, 512, 64, 2048
    else:
        tokens, rank, rope, topk = 3, 256, 32, 48
    q_lat, q_pe, cache, pos, base, kv_slots = make_case(tokens, heads, rank, rope, topk, fp8, seed=heads + fp8)
    scale = 0.0625
    slots = topk_to_slots(pos, base, kv_slots)
    want = sparse_mla_torch(q_lat, q_pe, cache, slots, scale)
    d = lambda t: t.to(DEV)  # noqa: E731
    if logical:
        got = sparse_mla_decode(d(q_lat), d(q_pe), d(cache), d(pos), scale, token_kv_base=d(base), kv_slots=d(kv_slots))
    else:
        got = get_backend("attention", "triton")(d(q_lat), d(q_pe), d(cache), d(slots), scale)
    got = got.cpu()
    # The registry backend answers in the model's dtype (q_lat's), the kernel in float32 by default.
    assert got.shape == want.shape and got.dtype == (torch.float32 if logical else q_lat.dtype)
    got = got.float()
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2  # bf16 operands (P and, for fp8, the dequantised latent)


@pytest.mark.parametrize("fp8", [False, True])
def test_whole_context_rows_give_the_same_with_the_hint(fp8):
    """Rows that are each query's whole causal context, -1 padded (what the indexer's short-circuit
    and a decode graph's bucket give): the registry backend with whole_contexts=True (decode then
    ends each row at its last valid entry) equals it without, and the torch reference."""
    tokens, heads, rank, rope, topk = (4, 16, 256, 32, 48) if not GPU else (6, 64, 512, 64, 2048)
    q_lat, q_pe, cache, _, base, kv_slots = make_case(tokens, heads, rank, rope, topk, fp8, seed=21 + fp8)
    cols = torch.arange(topk)
    lens = torch.tensor([1, topk // 3, topk // 2 + 5, topk - 1, topk, 7][:tokens])
    pos = torch.where(cols[None, :] < lens[:, None], cols[None, :], -1)  # contexts 0..len-1, then -1
    slots = topk_to_slots(pos, base, kv_slots)
    want = sparse_mla_torch(q_lat, q_pe, cache, slots, 0.0625)
    d = lambda t: t.to(DEV)  # noqa: E731
    backend = get_backend("attention", "triton")
    plain = backend(d(q_lat), d(q_pe), d(cache), d(slots), 0.0625).float().cpu()
    hinted = backend(d(q_lat), d(q_pe), d(cache), d(slots), 0.0625, whole_contexts=True).float().cpu()
    assert torch.equal(hinted, plain)
    assert rel_err(hinted, want) < 1e-2
    assert torch.equal(sparse_mla_torch(q_lat, q_pe, cache, slots, 0.0625, whole_contexts=True), want)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("prefill", [False, True])
def test_model_dtype_output_is_the_float32_output_rounded(fp8, splits, prefill):
    """out_dtype=bf16 (what the model takes) is the float32 result rounded to bf16, bit for bit:
    in the kernel's own store and in the split combine."""
    tokens, heads, rank, rope, topk = (3, 16, 256, 32, 48) if not GPU else (5, 64, 512, 64, 2048)
    q_lat, q_pe, cache, pos, base, kv_slots = make_case(tokens, heads, rank, rope, topk, fp8, seed=7 + fp8)
    d = lambda t: t.to(DEV)  # noqa: E731
    slots = d(topk_to_slots(pos, base, kv_slots))
    run = sparse_mla_prefill if prefill else sparse_mla_decode
    kw = {} if prefill else {"num_splits": splits}
    args = (d(q_lat), d(q_pe), d(cache), slots, 0.0625)
    full = run(*args, **kw)
    half = run(*args, out_dtype=torch.bfloat16, **kw)
    assert full.dtype == torch.float32 and half.dtype == torch.bfloat16
    assert torch.equal(half.cpu(), full.to(torch.bfloat16).cpu())


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("logical", [False, True])
@pytest.mark.parametrize("variant", ["prefetch", "prefetch_split3", "prefetch_trim", "indirect_s3", "mask_all"])
def test_variants_match_reference(fp8, logical, variant):
    # The launch options the benchmark compares (slots loaded a block ahead or not; the loop ended at
    # the last valid entry), on -1 padded lists, with and without the fused slot transform.
    if GPU:
        tokens, heads, rank, rope, topk, bn = 6, 64, 512, 64, 2048, 32
    else:
        tokens, heads, rank, rope, topk, bn = 3, 16, 128, 32, 48, 16
    q_lat, q_pe, cache, pos, base, kv_slots = make_case(tokens, heads, rank, rope, topk, fp8, seed=3 + fp8)
    slots = topk_to_slots(pos, base, kv_slots)
    want = sparse_mla_torch(q_lat, q_pe, cache, slots, 0.0625)
    d = lambda t: t.to(DEV)  # noqa: E731
    opts = {"block_n": bn, "num_stages": 3}
    opts["prefetch"] = variant != "indirect_s3"  # indirect: the slots loaded in the block that uses them
    if variant == "prefetch_split3":
        opts["num_splits"] = 3
    elif variant == "prefetch_trim":
        opts["trim"] = True  # the loop bound from the last valid entry (compiled only; on CPU, masks)
    elif variant == "mask_all":
        opts.update(mask_all=True, trim=True)  # -1 entries' scale and k_pe loads masked as well
    if logical:
        got = sparse_mla_decode(
            d(q_lat), d(q_pe), d(cache), d(pos), 0.0625, token_kv_base=d(base), kv_slots=d(kv_slots), **opts
        )
    else:
        got = sparse_mla_decode(d(q_lat), d(q_pe), d(cache), d(slots), 0.0625, **opts)
    got = got.cpu()
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_counts_agree(num_splits):
    # One program per token (no merge), and an uneven split whose last part is short.
    tokens, heads, rank, rope, topk = (4, 64, 512, 64, 2048) if GPU else (2, 16, 128, 16, 40)
    q_lat, q_pe, cache, pos, base, kv_slots = make_case(tokens, heads, rank, rope, topk, True, seed=7)
    slots = topk_to_slots(pos, base, kv_slots)
    want = sparse_mla_torch(q_lat, q_pe, cache, slots, 0.1)
    d = lambda t: t.to(DEV)  # noqa: E731
    got = sparse_mla_decode(d(q_lat), d(q_pe), d(cache), d(slots), 0.1, num_splits=num_splits, block_n=16)
    assert rel_err(got.cpu(), want) < 1e-2


def prefill_case(prompt, cached, heads, rank, rope, topk, fp8, seed):
    """One request's prompt chunk: token i (position cached + i) selects min(topk, pos + 1) of its
    causal positions in ascending order, then -1 (as the indexer emits them)."""
    g = torch.Generator().manual_seed(seed)
    ctx = cached + prompt
    num_slots = ctx + 11
    kv_slots = torch.randperm(num_slots, generator=g)[:ctx]
    cache = fmt.alloc_latent(num_slots, rank, rope, fp8, torch.bfloat16, "cpu")
    fmt.write_latent(
        cache,
        torch.arange(num_slots),
        torch.randn(num_slots, rank, generator=g),
        torch.randn(num_slots, rope, generator=g),
    )
    pos = torch.full((prompt, topk), -1, dtype=torch.int64)
    for i in range(prompt):
        p = cached + i
        chosen = torch.randperm(p + 1, generator=g)[: min(topk, p + 1)].sort().values
        pos[i, : chosen.numel()] = chosen
    base = torch.zeros(prompt, dtype=torch.int64)
    q_lat = torch.randn(prompt, heads, rank, generator=g).bfloat16()
    q_pe = torch.randn(prompt, heads, rope, generator=g).bfloat16()
    return q_lat, q_pe, cache, pos, base, kv_slots


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("logical", [False, True])
@pytest.mark.parametrize("pipelined", [False, True])
def test_prefill_matches_reference(fp8, logical, pipelined):
    # GLM-5 shapes on the GPU (a chunk crossing top-k); a tiny model's (rope 8: padded to an MMA K) on CPU.
    if GPU:
        prompt, cached, heads, rank, rope, topk = 320, 1800, 64, 512, 64, 2048
    else:
        prompt, cached, heads, rank, rope, topk = 20, 4, 4, 32, 8, 24
    q_lat, q_pe, cache, pos, base, kv_slots = prefill_case(prompt, cached, heads, rank, rope, topk, fp8, seed=11 + fp8)
    slots = topk_to_slots(pos, base, kv_slots)
    want = sparse_mla_torch(q_lat, q_pe, cache, slots, 0.0625)
    d = lambda t: t.to(DEV)  # noqa: E731
    # pipelined (the default): slots a block ahead, the loop ended at the last valid entry; else the
    # indirect load with skip_empty's branch around each block.
    kw = {} if pipelined else {"prefetch": False}
    if logical:
        got = sparse_mla_prefill(
            d(q_lat), d(q_pe), d(cache), d(pos), 0.0625, token_kv_base=d(base), kv_slots=d(kv_slots), **kw
        )
    else:
        if not GPU or not pipelined:
            kw["block_n"] = 64 if GPU else 16
        got = sparse_mla_prefill(d(q_lat), d(q_pe), d(cache), d(slots), 0.0625, **kw)
    got = got.cpu()
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2


def test_backend_takes_the_prefill_path(monkeypatch):
    # Enough tokens that the registry backend switches to the prefill launch: same result.
    from nsaserve.kernels import triton_sparse_mla

    monkeypatch.setattr(triton_sparse_mla, "PREFILL_TOKENS", 4)
    q_lat, q_pe, cache, pos, base, kv_slots = prefill_case(6, 10, 4, 32, 8, 8, True, seed=5)
    slots = topk_to_slots(pos, base, kv_slots)
    want = sparse_mla_torch(q_lat, q_pe, cache, slots, 0.2)
    d = lambda t: t.to(DEV)  # noqa: E731
    got = get_backend("attention", "triton")(d(q_lat), d(q_pe), d(cache), d(slots), 0.2)
    assert rel_err(got.cpu(), want) < 1e-2
