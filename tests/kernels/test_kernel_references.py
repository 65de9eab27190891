"""The torch kernel references against naive per-element loops on random inputs."""

import math
import random

import pytest
import torch

from nsaserve.kernels import kv_cache_format as fmt
from nsaserve.kernels.indexer import indexer_topk_torch, topk_to_slots
from nsaserve.kernels.moe import moe_experts_torch, route_noaux_tc
from nsaserve.kernels.registry import available, get_backend
from nsaserve.kernels.rope import apply_rope_interleaved, apply_rope_neox, rope_cos_sin
from nsaserve.kernels.sparse_mla import sparse_mla_torch


def scattered_batch(seq_lens, cached_lens, page_size, num_pages, seed=0):
    """kv_slots / kv_start / query_start for requests whose pages are scattered."""
    pages = list(range(num_pages))
    random.Random(seed).shuffle(pages)
    kv_slots, kv_start, query_start = [], [0], [0]
    for seq, cached in zip(seq_lens, cached_lens):
        mine = [pages.pop() for _ in range(-(-seq // page_size))]
        kv_slots += [mine[p // page_size] * page_size + p % page_size for p in range(seq)]
        kv_start.append(len(kv_slots))
        query_start.append(query_start[-1] + seq - cached)
    return torch.tensor(kv_slots), torch.tensor(kv_start), query_start


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_topk_matches_naive(fp8):
    torch.manual_seed(0)
    ps, num_pages, heads, dim, topk = 4, 40, 16, 32, 6
    seq_lens, cached = [13, 5, 22], [0, 2, 21]  # prefill, continuation, decode
    kv_slots, kv_start, qs = scattered_batch(seq_lens, cached, ps, num_pages)
    cache = fmt.alloc_index_k(num_pages, ps, dim, fp8, torch.float32, "cpu")
    keys = torch.randn(len(kv_slots), dim)
    fmt.write_index_k(cache, kv_slots, keys, ps)
    keys = fmt.gather_index_k(cache, kv_slots, ps)  # what the kernel sees (quantised when fp8)
    q, w = torch.randn(qs[-1], heads, dim), torch.randn(qs[-1], heads)
    scale = dim**-0.5
    got = indexer_topk_torch(q, w, cache, kv_slots, qs, cached, seq_lens, topk, scale, ps)
    assert got.shape == (qs[-1], topk)
    for i in range(len(seq_lens)):
        for j, t in enumerate(range(qs[i], qs[i + 1])):
            pos = cached[i] + j
            scores = []
            for s in range(pos + 1):
                k = keys[kv_start[i] + s]
                scores.append(sum(float(w[t, h]) * max(0.0, scale * float(q[t, h] @ k)) for h in range(heads)))
            if pos + 1 <= topk:
                want = list(range(pos + 1))
                assert sorted(got[t][got[t] >= 0].tolist()) == want
            else:
                want = sorted(range(pos + 1), key=lambda s: (-scores[s], s))[:topk]
                assert got[t].tolist() == want
            assert (got[t] >= 0).sum() == min(pos + 1, topk)


def test_indexer_ties_prefer_lower_positions():
    """All keys equal -> every score ties; the earliest positions win."""
    ps, heads, dim, topk = 4, 2, 8, 3
    kv_slots, _, qs = scattered_batch([10], [9], ps, 8, seed=3)
    cache = fmt.alloc_index_k(8, ps, dim, False, torch.float32, "cpu")
    fmt.write_index_k(cache, kv_slots, torch.ones(10, dim), ps)
    got = indexer_topk_torch(
        torch.ones(1, heads, dim), torch.ones(1, heads), cache, kv_slots, qs, [9], [10], topk, 1.0, ps
    )
    assert got.tolist() == [[0, 1, 2]]


def test_topk_to_slots():
    kv_slots = torch.tensor([7, 3, 9, 20, 21, 4])
    base = torch.tensor([0, 3, 3])  # token 0 in request 0, tokens 1-2 in request 1
    pos = torch.tensor([[2, 0, -1], [1, -1, -1], [0, 2, 1]])
    assert topk_to_slots(pos, base, kv_slots).tolist() == [[9, 7, -1], [21, -1, -1], [20, 4, 21]]


@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_mla_matches_naive(fp8):
    torch.manual_seed(1)
    T, H, R, P, slots_n, K = 5, 3, 32, 8, 40, 6
    cache = fmt.alloc_latent(slots_n, R, P, fp8, torch.float32, "cpu")
    fmt.write_latent(cache, torch.arange(slots_n), torch.randn(slots_n, R), torch.randn(slots_n, P))
    slots = torch.randint(0, slots_n, (T, K))
    slots[0, 3:] = -1
    slots[2, 1:] = -1
    q_lat, q_pe, scale = torch.randn(T, H, R), torch.randn(T, H, P), 0.2
    got = sparse_mla_torch(q_lat, q_pe, cache, slots, scale)
    c_all, pe_all = fmt.gather_latent(cache, torch.arange(slots_n), R)
    for t in range(T):
        valid = [int(s) for s in slots[t] if s >= 0]
        for h in range(H):
            logits = torch.tensor([scale * float(q_lat[t, h] @ c_all[s] + q_pe[t, h] @ pe_all[s]) for s in valid])
            p = torch.softmax(logits, 0)
            want = sum(p[j] * c_all[s] for j, s in enumerate(valid))
            torch.testing.assert_close(got[t, h], want, rtol=1e-5, atol=1e-5)


def test_route_noaux_tc_matches_naive():
    torch.manual_seed(2)
    T, E, k, groups, keep = 7, 16, 3, 4, 2
    logits, bias = torch.randn(T, E), 0.1 * torch.randn(E)
    w, ids = route_noaux_tc(logits, bias, k, groups, keep, True, 2.5)
    for t in range(T):
        s = [1 / (1 + math.exp(-float(x))) for x in logits[t]]
        b = [s[e] + float(bias[e]) for e in range(E)]
        size = E // groups
        gscore = [sum(sorted(b[g * size : (g + 1) * size])[-2:]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -gscore[g])[:keep]
        cand = [e for e in range(E) if e // size in kept]
        chosen = sorted(cand, key=lambda e: -b[e])[:k]
        assert sorted(ids[t].tolist()) == sorted(chosen)
        total = sum(s[e] for e in chosen)
        for j, e in enumerate(ids[t].tolist()):
            assert abs(float(w[t, j]) - s[e] / total * 2.5) < 1e-5


def test_moe_experts_matches_naive_and_skips_remote_experts():
    torch.manual_seed(3)
    T, Hd, inter, E, first, local = 6, 8, 5, 8, 4, 4  # this rank owns experts 4..7
    x = torch.randn(T, Hd)
    w13, w2 = torch.randn(local, 2 * inter, Hd), torch.randn(local, Hd, inter)
    ids = torch.randint(0, E, (T, 3))
    wts = torch.rand(T, 3)
    got = moe_experts_torch(x, ids, wts, w13, w2, first)
    for t in range(T):
        want = torch.zeros(Hd)
        for j in range(3):
            e = int(ids[t, j]) - first
            if 0 <= e < local:
                g, u = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
                want += float(wts[t, j]) * (w2[e] @ (torch.nn.functional.silu(g) * u))
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def test_rope_layouts_match_complex_rotation():
    torch.manual_seed(4)
    T, H, d = 5, 2, 8
    x = torch.randn(T, H, d)
    pos = torch.tensor([0, 1, 7, 100, 3])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_cos_sin(pos, inv_freq)
    rot = torch.polar(torch.ones(T, d // 2), pos[:, None].float() * inv_freq[None])[:, None, :]
    pairs = torch.view_as_complex(x.view(T, H, d // 2, 2).contiguous())
    want = torch.view_as_real(pairs * rot).flatten(-2)
    torch.testing.assert_close(apply_rope_interleaved(x, cos, sin), want, rtol=1e-5, atol=1e-5)
    halves = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * rot
    torch.testing.assert_close(apply_rope_neox(x, cos, sin), torch.cat((halves.real, halves.imag), -1))


def test_fp8_latent_row_layout_and_error():
    torch.manual_seed(5)
    R, P, n = 512, 64, 9
    assert fmt.latent_fp8_row_bytes(R, P) == 656  # FlashMLA's row
    c, k_pe = torch.randn(n, R) * torch.rand(n, 1) * 10, torch.randn(n, P)
    rows = fmt.pack_latent_fp8(c, k_pe)
    assert rows.shape == (n, 656) and rows.dtype == torch.uint8
    c2, pe2 = fmt.unpack_latent_fp8(rows, R)
    assert torch.equal(pe2, k_pe.to(torch.bfloat16).float())
    amax = c.view(n, 4, 128).abs().amax(-1, keepdim=True)
    err = (c2 - c).view(n, 4, 128).abs() / amax
    assert float(err.max()) <= 1 / 16  # e4m3 keeps 3 mantissa bits
    assert float(err.max()) > 0  # it really is quantised
    # Scales sit right after the codes: amax / 448 per 128-group, rounded up to a power of two.
    scales = rows[:, R : R + 16].contiguous().view(torch.float32)
    want = torch.exp2(torch.ceil(torch.log2(amax[..., 0] / 448)))
    assert torch.equal(scales, want)
    assert torch.equal(torch.frexp(scales).mantissa, torch.full_like(scales, 0.5))  # powers of two


def test_fp8_index_keys_paged_layout():
    ps, pages, dim = 4, 3, 16
    cache = fmt.alloc_index_k(pages, ps, dim, True, torch.float32, "cpu")
    assert cache.shape == (pages, ps, dim + 4)
    keys = torch.randn(5, dim)
    slots = torch.tensor([11, 0, 5, 6, 3])
    fmt.write_index_k(cache, slots, keys, ps)
    # Page 1's offset 1 (slot 5): its codes start at 1 * dim, its scale at ps * dim + 4 * 1.
    page1 = cache[1].reshape(-1)
    scale = page1[ps * dim + 4 : ps * dim + 8].contiguous().view(torch.float32)
    torch.testing.assert_close(scale, keys[2].abs().amax().reshape(1) / 448)
    back = fmt.gather_index_k(cache, slots, ps)
    assert float(((back - keys).abs() / keys.abs().amax(-1, keepdim=True)).max()) <= 1 / 16
    assert torch.equal(fmt.gather_index_k(cache, torch.tensor([1, 2]), ps), torch.zeros(2, dim))


def test_registry():
    for kind in ("attention", "indexer", "moe_route", "moe_experts"):
        assert "torch" in available(kind)
    assert get_backend("attention", "torch") is sparse_mla_torch
    with pytest.raises(KeyError, match="registered"):
        get_backend("attention", "no-such-backend")


def test_fp8_layouts_are_byte_compatible_with_quant_formats():
    """Same bytes as kernels.quant's FlashMLA encoder (power-of-two scales) and DeepGEMM encoder (float
    scales) at production dims."""
    from nsaserve.kernels.quant.indexer_k_fp8 import write_indexer_k
    from nsaserve.kernels.quant.mla_kv_fp8 import encode_mla_kv

    torch.manual_seed(6)
    c, k_pe = torch.randn(5, 512) * 3, torch.randn(5, 64)
    c[1, :128] = 0  # an all-zero group: the smallest scale
    assert torch.equal(fmt.pack_latent_fp8(c, k_pe), encode_mla_kv(c, k_pe, scale_fmt="ue8m0"))
    ps, pages = 64, 2
    ours = fmt.alloc_index_k(pages, ps, 128, True, torch.float32, "cpu")
    theirs = torch.zeros(pages, ps, 132, dtype=torch.uint8)
    slots, keys = torch.tensor([3, 70, 64, 127]), torch.randn(4, 128)
    fmt.write_index_k(ours, slots, keys, ps)
    write_indexer_k(theirs, slots, keys, scale_fmt="float")
    assert torch.equal(ours, theirs)


def test_hadamard_rotation_is_orthonormal_and_keeps_dot_products():
    from nsaserve.kernels.hadamard import hadamard_rotate

    torch.manual_seed(7)
    eye = hadamard_rotate(torch.eye(32))
    torch.testing.assert_close(eye @ eye.T, torch.eye(32), rtol=0, atol=1e-6)
    torch.testing.assert_close(eye.abs(), torch.full((32, 32), 32**-0.5))
    q, k = torch.randn(4, 2, 32), torch.randn(5, 32)
    torch.testing.assert_close(
        torch.einsum("thd,ld->thl", hadamard_rotate(q), hadamard_rotate(k)), torch.einsum("thd,ld->thl", q, k)
    )
    # An outlier is spread over every dim.
    spike = torch.zeros(1, 32)
    spike[0, 3] = 10.0
    assert float(hadamard_rotate(spike).abs().max()) < 2.0
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.zeros(2, 24))
