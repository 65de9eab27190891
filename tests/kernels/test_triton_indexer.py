"""Triton lightning indexer against the torch reference: same selected set on fresh random inputs.

Runs on the GPU where there is one, else in Triton's CPU interpreter at small shapes; skipped
where Triton is not installed.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are built
pytest.importorskip("triton")

from nsaserve.kernels import kv_cache_format as fmt  # noqa: E402
from nsaserve.kernels import triton_indexer, triton_topk  # noqa: E402
from nsaserve.kernels.registry import available, get_backend  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"


def scattered_slots(seq_lens, page_size, num_pages, seed):
    """kv_slots of requests whose pages are drawn from a shuffled pool."""
    pages = list(range(num_pages))
    random.Random(seed).shuffle(pages)
    slots = []
    for seq in seq_lens:
        mine = [pages.pop() for _ in range(-(-seq // page_size))]
        slots += [mine[p // page_size] * page_size + p % page_size for p in range(seq)]
    return torch.tensor(slots, dtype=torch.int64)


def make_case(seq_lens, new_tokens, heads, dim, page_size, fp8, seed, key_shift=0.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-s // page_size) for s in seq_lens) + 3
    kv_slots = scattered_slots(seq_lens, page_size, num_pages, seed)
    cache = fmt.alloc_index_k(num_pages, page_size, dim, fp8, dtype, "cpu")
    fmt.write_index_k(cache, kv_slots, torch.randn(len(kv_slots), dim, generator=g) + key_shift, page_size)
    cached = [s - n for s, n in zip(seq_lens, new_tokens)]
    qs = [0]
    for n in new_tokens:
        qs.append(qs[-1] + n)
    q = torch.randn(qs[-1], heads, dim, generator=g)
    w = torch.randn(qs[-1], heads, generator=g)
    return q, w, cache, kv_slots, qs, cached


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Fresh buffers full of a valid-looking position, so an unwritten output entry is caught."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(7) if t.dtype in (torch.int64, torch.float32) else t

    monkeypatch.setattr(torch, "empty", empty)


def assert_same_sets(got, want):
    assert got.shape == want.shape
    for r in range(got.shape[0]):
        g, w = got[r], want[r]
        assert sorted(g[g >= 0].tolist()) == sorted(w[w >= 0].tolist()), f"row {r}"
        assert int((g >= 0).sum()) == int((w >= 0).sum())


def run_both(case, topk, page_size, name="triton"):
    """The Triton backend `name` and its torch reference ("triton_fp8q" -> "torch_fp8q")."""
    q, w, cache, kv_slots, qs, cached = case
    seq_lens = [c + (qs[i + 1] - qs[i]) for i, c in enumerate(cached)]
    scale = q.shape[-1] ** -0.5
    ref = get_backend("indexer", name.replace("triton", "torch"))
    want = ref(q, w, cache, kv_slots, qs, cached, seq_lens, topk, scale, page_size)
    d = lambda t: t.to(DEV)  # noqa: E731
    got = get_backend("indexer", name)(d(q), d(w), d(cache), d(kv_slots), qs, cached, seq_lens, topk, scale, page_size)
    return got.cpu(), want


def test_registered():
    assert {"triton", "triton_fp8q"} <= set(available("indexer"))
    assert {"triton", "triton_fp8q"} <= set(available("indexer_rows"))


# Variants of the device path: (logits options, top-k digit bits). The first is the default.
VARIANTS = {
    "default": ({}, triton_indexer.TOPK_BITS, triton_indexer.TOPK_SAMPLED),
    "bf16x3-gather-bits8": ({"split": "bf16x3", "paged": False}, 8, False),
    "fp16x2-bits8": ({"split": "fp16x2"}, 8, False),
    "bf16x3-bits4-sampled": ({"split": "bf16x3"}, 4, True),
    # Blocks as large as a CPU test's pages: the one-lookup-per-page load runs there too.
    "page-blocks-sampled": ({"block_n": 8} if not GPU else {"block_n": 64}, 5, True),
    # Positive factors applied inside the ReLU, per product (the path before "fold").
    "fp16x2-unfolded": ({"split": "fp16x2", "fold": False}, 4, True),
    # Block slots read before the key loop (and on the GPU fp8-typed key tiles).
    "fp16x2-direct": ({"split": "fp16x2", "direct": True} if GPU else {"direct": True, "block_n": 8}, 4, True),
}


# On the GPU every variant costs compiles: the default and one other there.
@pytest.fixture(params=["default", "bf16x3-bits4-sampled"] if GPU else list(VARIANTS))
def variant(request, monkeypatch):
    opts, bits, sampled = VARIANTS[request.param]
    monkeypatch.setattr(triton_indexer, "TOPK_SAMPLED", sampled)
    monkeypatch.setattr(triton_indexer, "LOGITS_OPTIONS", {**triton_indexer.LOGITS_OPTIONS, **opts})
    monkeypatch.setattr(triton_indexer, "TOPK_BITS", bits)
    return request.param


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_matches_reference(fp8, variant):
    decode_case(fp8, 1 + fp8 + 2 * list(VARIANTS).index(variant), torch.bfloat16)  # fresh inputs per case


def test_float32_keys_match_reference():
    # Keys not exact in bf16 take the 3xTF32 path instead of the split-query bf16 one.
    decode_case(False, 4, torch.float32)


def decode_case(fp8, seed, dtype):
    # Decode rows: one new token each; contexts below, at and above top-k.
    if GPU:
        seq_lens, heads, dim, page_size, topk = [4096, 100, 2048, 2049, 8000], 32, 128, 64, 2048
    else:
        seq_lens, heads, dim, page_size, topk = [70, 9, 32, 33, 150], 4, 32, 8, 32
    case = make_case(seq_lens, [1] * len(seq_lens), heads, dim, page_size, fp8, seed, dtype=dtype)
    assert_same_sets(*run_both(case, topk, page_size))


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_and_chunked_rows(fp8, monkeypatch, variant):
    # Several query rows per request (causal within the chunk), and rows longer than one top-k
    # chunk so that the re-reading path runs too; few logits programs, so each loops over blocks.
    monkeypatch.setattr(triton_topk, "CHUNK", 1024 if GPU else 32)
    monkeypatch.setattr(triton_indexer, "_PROGRAMS_WANTED", 8)
    if GPU:
        seq_lens, new, heads, dim, page_size, topk = [3000, 5000], [40, 3], 32, 128, 64, 2048
    else:
        seq_lens, new, heads, dim, page_size, topk = [90, 50], [6, 3], 4, 32, 8, 24
    case = make_case(seq_lens, new, heads, dim, page_size, fp8, seed=3)
    assert_same_sets(*run_both(case, topk, page_size))


def test_ties_prefer_lower_positions(variant):
    # Keys mostly pointing away from the query: ReLU zeroes most scores, so the k-th score is an
    # exact 0 shared by many keys and the choice among them must follow the lower-position rule.
    heads, dim, page_size, topk = 4, 32, 8, 16
    q, w, cache, kv_slots, qs, cached = make_case([120], [1], heads, dim, page_size, False, seed=5, key_shift=-0.4)
    q = q.abs() + 0.1
    w = w.abs()
    keys = fmt.gather_index_k(cache, kv_slots, page_size)
    scores = (torch.relu(torch.einsum("thd,ld->thl", q, keys) * dim**-0.5) * w[..., None]).sum(1)
    assert 0 < int((scores > 0).sum()) < topk  # some clear winners, the rest tied at 0
    got, want = run_both((q, w, cache, kv_slots, qs, cached), topk, page_size)
    assert_same_sets(got, want)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("stream", [None, 16])
def test_whole_prompt(fp8, stream, monkeypatch):
    # A prompt from position 0: early rows take their whole context, later ones really select;
    # rows go through the logits kernel in blocks that share key tiles.
    if GPU:
        seq_lens, heads, dim, page_size, topk = [2600], 32, 128, 64, 2048
    else:
        seq_lens, heads, dim, page_size, topk = [44], 4, 32, 8, 16
    case = make_case(seq_lens, seq_lens, heads, dim, page_size, fp8, seed=9)
    # stream: the prompt's top-k streamed in pieces (on the GPU 512 keys, the default; here 16 of the 44)
    monkeypatch.setattr(triton_indexer, "PREFILL_TOPK_STREAM", stream and (512 if GPU else stream))
    assert_same_sets(*run_both(case, topk, page_size))


@pytest.mark.parametrize(
    "bits,sampled,stream",
    [(8, False, None), (4, False, None), (6, True, None), (4, True, None), (4, True, 1024), (4, True, 512), (4, True, 256)],
)
def test_topk_kernels_on_hard_rows(bits, sampled, stream):
    # Rows of 3000 logits, top 700: random; few distinct values (ties everywhere); constant (the
    # sampled bracket then holds every key, more than it compacts: the full-row fallback runs);
    # negative and zero logits of both signs; and a row whose context fits (all positions taken).
    from nsaserve.kernels.indexer import select_topk

    g = torch.Generator().manual_seed(17)
    n, k = 3000, 700
    x = torch.randn(5, n, generator=g)
    x[1] = torch.randint(-3, 3, (n,), generator=g).float()
    x[2] = 0.25
    x[3] = -x[3].abs()
    x[3, ::5] = 0.0
    x[3, 1::5] = -0.0
    pos = torch.tensor([n - 1, n - 1, n - 1, 2500, 600], dtype=torch.int32)
    got = triton_topk.topk_of_logits(x.to(DEV), pos.to(DEV), k, bits=bits, sampled=sampled, stream=stream).cpu()
    assert_same_sets(got, select_topk(x, pos.long(), k))


def test_streamed_topk_select_sizes():
    """The streamed select works on a quarter, a half or all of its 1024 candidate slots by how
    many keys the bracket holds (here about 160, 330 and 660: rows of 1500, 3000 and 6000 keys,
    top 700), with ties at the threshold; each the same set as the reference."""
    from nsaserve.kernels.indexer import select_topk

    g = torch.Generator().manual_seed(23)
    n, k = 6000, 700
    x = torch.randn(4, n, generator=g)
    x[3] = (x[3] * 4).round() / 4  # few distinct values: ties at the k-th
    pos = torch.tensor([1499, 2999, 5999, 5999], dtype=torch.int32)
    got = triton_topk.topk_of_logits(x.to(DEV), pos.to(DEV), k, stream=512).cpu()
    assert_same_sets(got, select_topk(x, pos.long(), k))


def compiled_variants(kernel) -> int:
    """How many variants a Triton kernel has compiled (all devices)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.skipif(not GPU, reason="counts compiled GPU variants")
def test_streamed_topk_compiles_once_for_any_row_length():
    """A serving step's longest row is any length: each must reuse the compiled kernel, not
    compile a variant (6 s on the H200, in the middle of serving) per 512 keys of it."""
    from nsaserve.kernels.indexer import select_topk

    g = torch.Generator().manual_seed(29)
    k = 2048
    seen = None
    for n in (2176, 2700, 3300, 4100, 9000):
        # Rows padded to a multiple of 16 floats, as indexer_logits lays them out (the row stride's
        # divisibility is the one property of it the kernels specialise on).
        padded = torch.randn(3, -(-n // 16) * 16, generator=g).to(DEV)
        x = padded[:, :n]
        pos = torch.tensor([n - 1, n // 2, 100], dtype=torch.int32)
        got = triton_topk.topk_of_logits(x, pos.to(DEV), k, stream=512).cpu()
        x = x.cpu()
        assert_same_sets(got, select_topk(x, pos.long(), k))
        now = compiled_variants(triton_topk._topk_streamed_kernel)
        assert seen is None or now == seen, (n, seen, now)
        seen = now


def _fp8_case(seq_lens, new, seed):
    heads, dim, page_size = (32, 128, 64) if GPU else (4, 32, 8)
    return make_case(seq_lens, new, heads, dim, page_size, True, seed), page_size


def fp8_scores(case, page_size):
    """Per row: the fp8-query reference's scores over its request's visible keys (float32)."""
    from nsaserve.kernels.indexer import quantize_query_fp8

    q, w, cache, kv_slots, qs, cached = case
    q8, scale, out, off = quantize_query_fp8(q), q.shape[-1] ** -0.5, [], 0
    for i, c in enumerate(cached):
        n = qs[i + 1] - qs[i]
        keys = fmt.gather_index_k(cache, kv_slots[off : off + c + n], page_size)
        s = torch.einsum(
            "th,thl->tl",
            w[qs[i] : qs[i + 1]],
            torch.relu(torch.einsum("thd,ld->thl", q8[qs[i] : qs[i + 1]], keys) * scale),
        )
        out += [s[t, : c + t + 1] for t in range(n)]
        off += c + n
    return out


def assert_sets_equal_up_to_near_ties(got, want, scores, rel=2e-3):
    """Same widths and padding; where a row's chosen sets differ, every position in one and not the
    other scores within rel x the row's largest |score| of that row's k-th score (a near-tie at the
    boundary: the tensor cores' fp8 accumulation is not float32's)."""
    assert got.shape == want.shape
    for r in range(got.shape[0]):
        g, w = got[r], want[r]
        gs, ws = set(g[g >= 0].tolist()), set(w[w >= 0].tolist())
        assert len(gs) == len(ws) == int((g >= 0).sum()), f"row {r}"
        if gs != ws:
            sc = scores[r]
            kth = sc.sort(descending=True).values[len(ws) - 1]
            tol = rel * float(sc.abs().max())
            for p in gs ^ ws:
                assert abs(float(sc[p] - kth)) <= tol, (r, p, float(sc[p]), float(kth))


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("prefill", [False, True])
def test_fp8_query_matches_its_reference(prefill, direct, monkeypatch):
    # DeepSeek-V3.2's path: the query rounded to e4m3 per (row, head), fp8 x fp8 products; the torch
    # reference rounds the same way, so the two choose the same sets up to near-ties.
    if GPU:
        seq_lens, new, topk = ([3000, 2300], [40, 2300], 2048) if prefill else ([4096, 100, 2049, 8000], [1] * 4, 2048)
    else:
        seq_lens, new, topk = ([90, 44], [6, 44], 24) if prefill else ([70, 9, 33, 150], [1] * 4, 32)
    case, page_size = _fp8_case(seq_lens, new, seed=21 + prefill)
    opts = {"direct": direct} if GPU else {"direct": direct, "block_n": 8}  # CPU: blocks within pages
    monkeypatch.setattr(triton_indexer, "LOGITS_OPTIONS", {**triton_indexer.LOGITS_OPTIONS, **opts})
    got, want = run_both(case, topk, page_size, "triton_fp8q")
    assert_sets_equal_up_to_near_ties(got, want, fp8_scores(case, page_size))


def test_fp8_query_logits_match_reference_logits():
    # The logits themselves (before the top-k) within float32 summation error of the reference's.
    from nsaserve.kernels.indexer import quantize_query_fp8

    seq_lens, new = ([2000], [64]) if GPU else ([40], [8])
    (q, w, cache, kv_slots, qs, cached), page_size = _fp8_case(seq_lens, new, seed=23)
    scale = q.shape[-1] ** -0.5
    keys = fmt.gather_index_k(cache, kv_slots, page_size)
    ref = torch.einsum("th,thl->tl", w, torch.relu(torch.einsum("thd,ld->thl", quantize_query_fp8(q), keys) * scale))
    d = lambda t: t.to(DEV)  # noqa: E731
    for rows in (1, 4):
        plan = triton_indexer.plan_from_host(qs, cached, seq_lens, DEV, rows_per=rows)
        blocks = plan.blocks if rows > 1 else None
        got = triton_indexer.indexer_logits(
            d(q),
            d(w),
            d(cache),
            d(kv_slots),
            plan.row_kv_off,
            plan.row_pos,
            plan.max_len,
            scale,
            page_size,
            split="fp8",
            row_blocks=blocks,
        ).cpu()
        for t in range(q.shape[0]):
            n = cached[0] + t + 1
            # (fp8 products are accumulated with less than float32's precision on the tensor cores)
            torch.testing.assert_close(got[t, :n], ref[t, :n], rtol=1e-3, atol=1e-3 * float(ref[t, :n].abs().max()))


def test_quantize_query_fp8():
    from nsaserve.kernels.indexer import quantize_query_fp8

    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, 3, 128, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    dq = quantize_query_fp8(q)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each value above the block's subnormals.
    big = q.abs() >= q.abs().amax(-1, keepdim=True) / 64
    assert float(((dq - q).abs() / q.abs())[big].max()) <= 2**-4
    assert torch.equal(quantize_query_fp8(dq), dq)  # already on the grid: unchanged
    assert torch.equal(quantize_query_fp8(torch.zeros(2, 2, 128)), torch.zeros(2, 2, 128))


@pytest.mark.parametrize("rows_per", [1, 4])
def test_rows_that_fit_the_topk_get_no_logits(rows_per):
    """skip_fit: rows that see at most that many keys (for row blocks: every row of the block) are
    left unwritten, the others computed as without it; indexer_topk_rows still picks the reference's
    sets (those rows' top-k is their whole context)."""
    if GPU:
        seq_lens, new, heads, dim, page_size, topk = [3000, 700, 2048, 2049], [1, 1, 1, 1], 32, 128, 64, 2048
    else:
        seq_lens, new, heads, dim, page_size, topk = [70, 20, 32, 33], [1, 1, 1, 1], 4, 32, 8, 32
    if rows_per > 1:  # prompt chunks: rows of one request in blocks, early blocks fitting the top-k
        new = [min(s, 8) for s in seq_lens] if not GPU else [16, 16, 16, 16]
    case = make_case(seq_lens, new, heads, dim, page_size, True, seed=31 + rows_per)
    q, w, cache, kv_slots, qs, cached = case
    d = lambda t: t.to(DEV)  # noqa: E731
    plan = triton_indexer.plan_from_host(qs, cached, seq_lens, DEV, rows_per=rows_per)
    blocks = plan.blocks if rows_per > 1 else None
    args = (d(q), d(w), d(cache), d(kv_slots), plan.row_kv_off, plan.row_pos, plan.max_len, dim**-0.5, page_size)
    opts = {} if GPU else {"block_n": 8}
    full = triton_indexer.indexer_logits(*args, row_blocks=blocks, **opts).cpu()
    skipped = triton_indexer.indexer_logits(*args, row_blocks=blocks, skip_fit=topk, **opts).cpu()
    row_pos = plan.row_pos.cpu().long()
    if blocks is None:
        fits = row_pos + 1 <= topk
    else:  # a row is skipped when every row of its block fits
        first, count = (b.cpu().long() for b in blocks[:2])
        block_fits = torch.tensor([int(row_pos[f : f + c].max()) + 1 <= topk for f, c in zip(first, count)])
        fits = torch.repeat_interleave(block_fits, count)
    assert bool(fits.any()) and not bool(fits.all())
    for t in range(full.shape[0]):
        n = int(row_pos[t]) + 1
        if fits[t]:
            assert bool((skipped[t, :n] == 7).all()), t  # the poisoned buffer, untouched
        else:
            assert torch.equal(skipped[t, :n], full[t, :n]), t
    assert_same_sets(*run_both(case, topk, page_size))
