"""Triton small ops (RMSNorm + residual, RoPE, KV and indexer-key stores, SiLU·mul) against their torch
references on fresh random inputs.

On the GPU at GLM-5 shapes; without one in Triton's CPU interpreter at small shapes (seconds).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are built
pytest.importorskip("triton")

from nsaserve.kernels import kv_cache_format as fmt  # noqa: E402
from nsaserve.kernels.quant import write_indexer_k, write_mla_kv  # noqa: E402
from nsaserve.kernels.registry import available, get_backend  # noqa: E402
from nsaserve.kernels.triton_kv_store import store_index_k, store_latent  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


def gen(seed):
    return torch.Generator(device=DEV).manual_seed(SEED + seed)


def rel_err(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed), device=DEV) * scale).to(dtype)


@pytest.mark.parametrize("kind", ["rmsnorm", "rope", "kv_store", "index_key_store", "silu_mul"])
def test_registered(kind):
    assert {"torch", "triton"} <= set(available(kind))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("hidden", [6144, 512] if GPU else [64, 96])
def test_rmsnorm(dtype, residual, hidden):
    rows = 37 if GPU else 5
    wide = randn(rows, hidden + 64, seed=1, dtype=dtype, scale=3.0)
    x = wide[:, :hidden]  # a strided slice, as the model's ckv[:, :R]
    w = randn(hidden, seed=2, dtype=dtype) + 1
    r = randn(rows, hidden, seed=3, dtype=dtype) if residual else None
    want = get_backend("rmsnorm", "torch")(x, w, 1e-5, r)
    got = get_backend("rmsnorm", "triton")(x, w, 1e-5, r)
    if residual:
        assert torch.equal(got[1], want[1]), f"seed {SEED}: the residual sum must be exact"
        got, want = got[0], want[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    # Only the summation order differs: float32 agrees to rounding, bf16 to one unit in a few elements.
    if dtype == torch.float32:
        assert rel_err(got, want) < 1e-6, SEED
    else:
        assert rel_err(got, want) < 4e-3, SEED
        assert (got == want).float().mean() > 0.98, SEED


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads", [64] if GPU else [None, 3])  # (fewer GPU compiles; 2-D runs on CPU)
@pytest.mark.parametrize("partial", [False, True])
def test_rope(dtype, interleaved, heads, partial):
    """Full: the rope part of a wider row, as MLA's q[..., nope:]. Partial: the first dims of
    whole rows roped, the rest passed through, as the indexer's q and k."""
    from nsaserve.kernels.rope import rope_cos_sin

    tokens, rope, nope = (41, 64, 192) if GPU else (6, 16, 8)
    rest = (64 if GPU else 24) if partial else 0  # (24: not a power of two, as a tiny model's 32 - 8)
    pos = torch.randint(0, 100000, (tokens,), generator=gen(4), device=DEV)
    inv_freq = 1e4 ** (-torch.arange(0, rope, 2, dtype=torch.float32, device=DEV) / rope)
    cos, sin = rope_cos_sin(pos, inv_freq, 1.3)
    width = rope + rest
    shape = (tokens, nope + width) if heads is None else (tokens, heads, nope + width)
    x = randn(*shape, seed=5, dtype=dtype)[..., nope:]
    want = get_backend("rope", "torch")(x, cos, sin, interleaved)
    got = get_backend("rope", "triton")(x, cos, sin, interleaved)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 4e-3), SEED
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.98, SEED


def _poisoned(shape, dtype, seed):
    """A cache full of random bytes (random finite values for float caches: NaN payloads do not
    compare equal), so that a write to the wrong place or a missed one shows."""
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen(seed), device=DEV, dtype=torch.uint8)
    return randn(*shape, seed=seed, dtype=dtype)


def _scattered_slots(n, num_slots, seed):
    return torch.randperm(num_slots, generator=gen(seed), device=DEV)[:n]


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_latent_store_matches_pool_format(fp8, dtype):
    n, num_slots, rank, rope = (300, 4096, 512, 64) if GPU else (5, 32, 64, 16)
    cache = fmt.alloc_latent(num_slots, rank, rope, fp8, dtype, DEV)
    cache.copy_(_poisoned(cache.shape, cache.dtype, 6))
    ckv = randn(n, rank + rope, seed=7, dtype=dtype, scale=2.0)
    c, k_pe = ckv[:, :rank], ckv[:, rank:]  # strided, as in the model
    c[0, :] = 0  # an all-zero group takes the smallest scale
    slots = _scattered_slots(n, num_slots, 8)
    want = cache.clone()
    fmt.write_latent(want, slots, c, k_pe)
    store_latent(cache, slots, c, k_pe)
    assert torch.equal(cache, want), SEED


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
def test_kv_store_norms_ropes_and_stores(fp8, dtype, interleaved):
    """The model's kv_store: RMSNorm of the latent, RoPE of k_pe, the store; against the torch
    composition. Only the norm's summation order differs, so a rare element rounds to the
    neighbouring bf16 (and then perhaps fp8) value."""
    from nsaserve.kernels.rope import rope_cos_sin

    n, num_slots, rank, rope = (300, 4096, 512, 64) if GPU else (5, 32, 64, 16)
    cache = fmt.alloc_latent(num_slots, rank, rope, fp8, dtype, DEV)
    cache.copy_(_poisoned(cache.shape, cache.dtype, 19))
    kv = randn(n, rank + rope, seed=20, dtype=dtype, scale=2.0)
    weight = randn(rank, seed=21, dtype=dtype) + 1
    pos = torch.randint(0, 100000, (n,), generator=gen(22), device=DEV)
    cos, sin = rope_cos_sin(pos, 1e4 ** (-torch.arange(0, rope, 2, dtype=torch.float32, device=DEV) / rope))
    slots = _scattered_slots(n, num_slots, 23)
    want = cache.clone()
    get_backend("kv_store", "torch")(want, slots, kv, weight, 1e-6, cos, sin, interleaved)
    get_backend("kv_store", "triton")(cache, slots, kv, weight, 1e-6, cos, sin, interleaved)
    others = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    others[slots] = False
    assert torch.equal(cache[others], want[others]), SEED  # nothing else written
    got_c, got_pe = fmt.gather_latent(cache, slots, rank)
    want_c, want_pe = fmt.gather_latent(want, slots, rank)
    exact = dtype == torch.float32 and not fp8
    assert rel_err(got_c, want_c) < (1e-6 if exact else 1e-2), SEED
    assert rel_err(got_pe, want_pe) < (1e-6 if exact else 4e-3), SEED
    if dtype == torch.bfloat16:  # (in float32 a norm's last bit differs in whole rows)
        assert (cache[slots] == want[slots]).float().mean() > 0.97, SEED


@pytest.mark.parametrize("fp8", [True, False])
def test_index_key_store_matches_pool_format(fp8):
    n, pages, page_size, dim = (300, 128, 64, 128) if GPU else (6, 4, 4, 32)
    cache = fmt.alloc_index_k(pages, page_size, dim, fp8, torch.bfloat16, DEV)
    cache.copy_(_poisoned(cache.shape, cache.dtype, 9))
    k = randn(n, dim, seed=10, dtype=torch.bfloat16, scale=5.0)
    slots = _scattered_slots(n, pages * page_size, 11)
    want = cache.clone()
    get_backend("index_key_store", "torch")(want, slots, k, page_size)
    get_backend("index_key_store", "triton")(cache, slots, k, page_size)
    assert torch.equal(cache, want), SEED


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_656_byte_rows_match_quant_module(scale_fmt):
    """kernels.quant's FlashMLA row (R = 512, P = 64) with its power-of-two or float scales."""
    n, num_slots = (200, 2048) if GPU else (3, 8)
    cache = _poisoned((num_slots, 656), torch.uint8, 12)
    latent = randn(n, 512, seed=13, dtype=torch.bfloat16, scale=0.3)
    latent[0] = 0
    rope = randn(n, 64, seed=14, dtype=torch.bfloat16)
    slots = _scattered_slots(n, num_slots, 15)
    want = cache.clone()
    write_mla_kv(want, slots, latent, rope, scale_fmt)
    store_latent(cache, slots, latent, rope, scale_fmt)
    assert torch.equal(cache, want), SEED


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_132_byte_index_keys_match_quant_module(scale_fmt):
    pages, page_size = (64, 64) if GPU else (2, 4)
    n = pages * page_size // 2
    cache = _poisoned((pages, page_size, 132), torch.uint8, 16)
    k = randn(n, 128, seed=17, dtype=torch.bfloat16, scale=0.01)
    k[1] = 0
    slots = _scattered_slots(n, pages * page_size, 18)
    want = cache.clone()
    write_indexer_k(want, slots, k, scale_fmt)
    store_index_k(cache, slots, k, page_size, scale_fmt)
    assert torch.equal(cache, want), SEED


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_index_key_store_prep_matches_torch(fp8, interleaved, rotate, dtype):
    """The indexer's key path in one launch (LayerNorm, RoPE of the first dims, the Hadamard
    rotation, the store) against the torch composition. Only summation orders differ (the norm's
    statistics, the rotation's sums), so a rare element rounds to a neighbouring bf16 or fp8 value."""
    from nsaserve.kernels.rope import rope_cos_sin
    from nsaserve.kernels.small_ops import IndexKeyPrep

    # GPU: GLM-5's indexer (128 dims, the first 64 roped); CPU: a tiny model's 32 with 8 roped (the
    # unroped rest, 24, is not a power of two) and a whole-row rope.
    # (21 keys: a whole block of 16 and a partial one.)
    n, pages, page_size, dim, rope = (300, 128, 64, 128, 64) if GPU else (21, 8, 4, 32, 8)
    cache = fmt.alloc_index_k(pages, page_size, dim, fp8, dtype, DEV)
    cache.copy_(_poisoned(cache.shape, cache.dtype, 24))
    wide = randn(n, dim + 16, seed=25, dtype=dtype, scale=3.0)
    k = wide[:, 16:]  # strided rows, as a slice of a wider projection
    weight = randn(dim, seed=26, dtype=dtype) + 1
    bias = randn(dim, seed=27, dtype=dtype, scale=0.1)
    pos = torch.randint(0, 100000, (n,), generator=gen(28), device=DEV)
    cos, sin = rope_cos_sin(pos, 1e4 ** (-torch.arange(0, rope, 2, dtype=torch.float32, device=DEV) / rope))
    prep = IndexKeyPrep(weight, bias, 1e-6, cos, sin, interleaved, rotate)
    slots = _scattered_slots(n, pages * page_size, 29)
    want = cache.clone()
    get_backend("index_key_store", "torch")(want, slots, k, page_size, prep=prep)
    get_backend("index_key_store", "triton")(cache, slots, k, page_size, prep=prep)
    got_k, want_k = fmt.gather_index_k(cache, slots, page_size), fmt.gather_index_k(want, slots, page_size)
    assert rel_err(got_k, want_k) < (2e-2 if fp8 else 4e-3), SEED
    if fp8:
        pages_of = slots // page_size
        others = torch.ones(pages, dtype=torch.bool, device=DEV)
        others[pages_of] = False
        assert torch.equal(cache[others], want[others]), SEED  # pages with no new key untouched
        # (Compare codes: a scale one unit apart changes every dequantised value of its row.)
        got_codes = fmt._index_regions(cache)[0][slots // page_size, slots % page_size]
        want_codes = fmt._index_regions(want)[0][slots // page_size, slots % page_size]
        assert (got_codes == want_codes).float().mean() > 0.97, SEED
    else:
        others = torch.ones(pages * page_size, dtype=torch.bool, device=DEV)
        others[slots] = False
        assert torch.equal(cache.view(-1, dim)[others], want.view(-1, dim)[others]), SEED
        if dtype == torch.bfloat16:
            assert (got_k == want_k).float().mean() > 0.97, SEED


def test_index_key_store_prep_whole_row_rope():
    """A rope over the whole key (no unroped rest), fp8 with the rotation."""
    from nsaserve.kernels.rope import rope_cos_sin
    from nsaserve.kernels.small_ops import IndexKeyPrep

    n, pages, page_size, dim = (64, 16, 64, 64) if GPU else (5, 4, 4, 16)
    cache = fmt.alloc_index_k(pages, page_size, dim, True, torch.bfloat16, DEV)
    k = randn(n, dim, seed=30, dtype=torch.bfloat16, scale=2.0)
    pos = torch.randint(0, 1000, (n,), generator=gen(31), device=DEV)
    cos, sin = rope_cos_sin(pos, 1e4 ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=DEV) / dim))
    ones = torch.ones(dim, dtype=torch.bfloat16, device=DEV)
    prep = IndexKeyPrep(ones, ones * 0, 1e-6, cos, sin, False, True)
    slots = _scattered_slots(n, pages * page_size, 32)
    want = cache.clone()
    get_backend("index_key_store", "torch")(want, slots, k, page_size, prep=prep)
    get_backend("index_key_store", "triton")(cache, slots, k, page_size, prep=prep)
    got_k, want_k = fmt.gather_index_k(cache, slots, page_size), fmt.gather_index_k(want, slots, page_size)
    assert rel_err(got_k, want_k) < 2e-2, SEED


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_then_rotation_matches_torch(dtype, interleaved):
    """The indexer's fp8-cache query: RoPE of the first dims, then the Hadamard rotation, float32
    out, in one launch (the MMA against the signs), against rope + hadamard_rotate."""
    from nsaserve.kernels.rope import rope_cos_sin

    # GPU: GLM-5's indexer query (32 heads x 128, 64 roped); CPU: a tiny model's (4 x 32, 8 roped:
    # fewer than the MMA's 16 on every side, padded).
    tokens, heads, dim, rope = (41, 32, 128, 64) if GPU else (5, 4, 32, 8)
    pos = torch.randint(0, 100000, (tokens,), generator=gen(33), device=DEV)
    cos, sin = rope_cos_sin(pos, 1e4 ** (-torch.arange(0, rope, 2, dtype=torch.float32, device=DEV) / rope))
    wide = randn(tokens, heads * dim + 8, seed=34, dtype=dtype, scale=2.0)
    x = wide[:, 8:].view(tokens, heads, dim)  # strided rows, as a view of a projection
    want = get_backend("rope", "torch")(x, cos, sin, interleaved, rotate=True)
    got = get_backend("rope", "triton")(x, cos, sin, interleaved, rotate=True)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # The roped values round to x's dtype in both; then only the rotation's summation order differs
    # (and in bf16 the rare roped element that rounds the other way).
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 1e-3), SEED
    if dtype == torch.bfloat16:
        assert ((got - want).abs() <= 1e-5 * want.abs().amax(-1, keepdim=True)).float().mean() > 0.95, SEED
    unrotated = get_backend("rope", "triton")(x, cos, sin, interleaved)
    assert unrotated.dtype == dtype  # (rotate off: the plain RoPE, unchanged)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [12288, 2048, 1000] if GPU else [96, 40])
def test_silu_mul(dtype, inter):
    """silu(gate) * up from the stacked gate/up GEMM's rows: on the GPU bit for bit the torch
    reference (the same expf, correctly rounded division and roundings); in the interpreter, whose
    exp is numpy's, at most one unit in the last place in a few elements."""
    rows = 37 if GPU else 5
    # Wide enough values to reach silu's both tails (where exp under- and overflows).
    h = randn(rows, 2 * inter, seed=7, dtype=dtype, scale=6.0)
    h[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0], dtype=dtype)
    wide = randn(rows, 2 * inter + 16, seed=8, dtype=dtype)[:, : 2 * inter]  # rows with a longer stride
    for x in (h, wide):
        want = get_backend("silu_mul", "torch")(x)
        got = get_backend("silu_mul", "triton")(x)
        assert got.dtype == want.dtype and got.shape == want.shape == (rows, inter)
        if GPU:
            assert torch.equal(got, want), f"seed {SEED}"
        else:
            assert (got.float() != want.float()).float().mean() < 0.01, SEED
            assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-6), SEED


def test_silu_mul_rejects_odd_columns_and_float32():
    with pytest.raises(ValueError, match="2n"):
        get_backend("silu_mul", "triton")(torch.zeros(2, 5, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        get_backend("silu_mul", "triton")(torch.zeros(2, 4, device=DEV))
