"""Gluon sparse MLA decode (Hopper only) against the torch reference and the Triton kernel, on
fresh random inputs at GLM-5 / DeepSeek-V3.2 shapes. Gluon has no CPU interpreter: skipped
without a Hopper GPU (tests/kernels/compile_sm90.py compiles it on any machine)."""

import pytest
import torch

pytest.importorskip("triton")

from test_triton_sparse_mla import make_case, rel_err  # noqa: E402

from nsaserve.kernels import triton_sparse_mla  # noqa: E402
from nsaserve.kernels.gluon_sparse_mla import sparse_mla_decode_gluon, supports, takes_shapes  # noqa: E402
from nsaserve.kernels.gluon_sparse_mla_ws import sparse_mla_decode_ws  # noqa: E402
from nsaserve.kernels.indexer import topk_to_slots  # noqa: E402
from nsaserve.kernels.registry import get_backend  # noqa: E402
from nsaserve.kernels.sparse_mla import sparse_mla_torch  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU")

RANK, ROPE, TOPK, SCALE = 512, 64, 2048, 0.0625


def case(tokens, heads, fp8, seed):
    q_lat, q_pe, cache, pos, base, kv_slots = make_case(tokens, heads, RANK, ROPE, TOPK, fp8, seed)
    slots = topk_to_slots(pos, base, kv_slots)
    want = sparse_mla_torch(q_lat, q_pe, cache, slots, SCALE)
    return [x.cuda() for x in (q_lat, q_pe, cache, slots)], want


@hopper
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [64, 128, 16])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_matches_reference_and_triton(fp8, heads, num_splits):
    (q_lat, q_pe, cache, slots), want = case(5, heads, fp8, seed=heads + fp8 + (num_splits or 0))
    assert supports(q_lat, q_pe, cache) == (heads % 64 == 0)  # 16 heads: the Triton kernel's (padding)
    got = sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE, num_splits=num_splits)
    tri = triton_sparse_mla.sparse_mla_decode(q_lat, q_pe, cache, slots, SCALE, num_splits=num_splits)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rel_err(got.cpu(), want) < 1e-2  # bf16 operands (P and, for fp8, the dequantised latent)
    # The same operands as the Triton kernel; only the order of the float32 sums differs.
    assert rel_err(got, tri) < 2e-3


@hopper
@pytest.mark.parametrize("fp8", [False, True])
def test_one_token_takes_32_row_blocks(fp8):
    """A single (token, head block) runs 32-row blocks over 32 splits (the batch-1 launch)."""
    (q_lat, q_pe, cache, slots), want = case(1, 64, fp8, seed=13)
    got = sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE)
    assert rel_err(got.cpu(), want) < 1e-2
    assert rel_err(got, sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE, block_n=64)) < 2e-3


@hopper
@pytest.mark.parametrize("fp8", [False, True])
def test_trimmed_rows(fp8):
    """Rows -1 padded after their valid entries (a decode graph's context bucket) match the
    reference with and without trim, with and without splits."""
    (q_lat, q_pe, cache, slots), _ = case(3, 64, fp8, seed=7)
    for t, n in enumerate([TOPK, 1000, 1]):
        slots[t, n:] = -1
    want = sparse_mla_torch(q_lat.cpu(), q_pe.cpu(), cache.cpu(), slots.cpu(), SCALE)
    for trim in (False, True):
        for num_splits in (None, 1):
            got = sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE, num_splits=num_splits, trim=trim)
            assert rel_err(got.cpu(), want) < 1e-2, (trim, num_splits)


@hopper
@pytest.mark.parametrize("tokens, num_splits", [(5, None), (5, 1), (5, 3), (64, None), (1, None)])
def test_staged_fp8_blocks_equal_the_register_path(tokens, num_splits):
    """stage=True (the next block's FP8 rows by cp.async, dequantised from shared memory) gives the
    default path's output bit for bit (the same dequantised operands, the same MMAs), -1 tails
    and trimmed loops included, and matches the reference."""
    (q_lat, q_pe, cache, slots), want = case(tokens, 64, True, seed=21 + tokens)
    for t in range(0, tokens, 2):
        slots[t, 700 + 37 * t :] = -1
    want = sparse_mla_torch(q_lat.cpu(), q_pe.cpu(), cache.cpu(), slots.cpu(), SCALE)
    for trim in (False, True):
        kw = dict(num_splits=num_splits, trim=trim)
        staged = sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE, stage=True, **kw)
        assert torch.equal(staged, sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE, stage=False, **kw))
        assert rel_err(staged.cpu(), want) < 1e-2


@hopper
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens, num_splits", [(5, None), (5, 1), (5, 3), (64, None), (1, None)])
def test_early_copies_equal_the_late_issue(fp8, tokens, num_splits):
    """early=True (block i + 1's copies issued before block i's QK^T, from slots loaded a block
    ahead) gives the late issue's output bit for bit: the same operands and MMAs. -1 tails, a
    one-entry list (a single block, so the slots loaded ahead are all past its end) and trimmed
    loops included; and it matches the reference."""
    (q_lat, q_pe, cache, slots), _ = case(tokens, 64, fp8, seed=31 + tokens + fp8)
    for t in range(0, tokens, 2):
        slots[t, 700 + 37 * t :] = -1
    if tokens > 1:
        slots[1, 1:] = -1
    want = sparse_mla_torch(q_lat.cpu(), q_pe.cpu(), cache.cpu(), slots.cpu(), SCALE)
    for trim in (False, True):
        kw = dict(num_splits=num_splits, trim=trim, stage=True)
        early = sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE, early=True, **kw)
        assert torch.equal(early, sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE, early=False, **kw))
        assert rel_err(early.cpu(), want) < 1e-2


# Both Gluon kernels: lock step and warp-specialised (gluon_sparse_mla_ws).
BOTH = pytest.mark.parametrize("attend", [sparse_mla_decode_gluon, sparse_mla_decode_ws], ids=["lock-step", "ws"])


@hopper
@BOTH
@pytest.mark.parametrize("fp8", [False, True])
def test_model_dtype_output_is_the_float32_output_rounded(fp8, attend):
    (q_lat, q_pe, cache, slots), _ = case(3, 64, fp8, seed=11)
    f32 = attend(q_lat, q_pe, cache, slots, SCALE, num_splits=1)
    bf16 = attend(q_lat, q_pe, cache, slots, SCALE, num_splits=1, out_dtype=torch.bfloat16)
    assert torch.equal(bf16, f32.bfloat16())


@hopper
@BOTH
@pytest.mark.parametrize("fp8", [False, True])
def test_graph_replay_with_new_lists(fp8, attend):
    """Captured once, replayed with other queries and lists copied into the captured buffers."""
    (q_lat, q_pe, cache, slots), _ = case(6, 64, fp8, seed=3)
    (q_lat2, q_pe2, _, slots2), _ = case(6, 64, fp8, seed=4)
    slots2[:, 1500:] = -1
    attend(q_lat, q_pe, cache, slots, SCALE, trim=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(q_lat, q_pe, cache, slots, SCALE, trim=True)
    q_lat.copy_(q_lat2)
    q_pe.copy_(q_pe2)
    slots.copy_(slots2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, attend(q_lat, q_pe, cache, slots, SCALE, trim=True))


@hopper
@pytest.mark.parametrize("bits", [True, False], ids=["bits", "float32"])
def test_fp8_rows_dequantise_exactly(bits):
    """Every finite e4m3 code (subnormals and both zeros among them) under group scales from 2^-14
    to 2^32: each token selects one row, so the output is that row dequantised, and must equal
    code x scale in float32 rounded to bf16 (kv_cache_format's reading) bit for bit, in both Gluon
    kernels. bits (the default): by bit operations, for the cache's power-of-two scales; else
    through float32, for any scale (1.37 x 2^e and the like too)."""
    from nsaserve.kernels import kv_cache_format as fmt

    exps = [-13, -7, 0, 7, 8, 20, 30]
    mults = (1, 1, 1, 1) if bits else (1, 1.37, 1.9, 1.0001)
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F / 0xFF: NaN
    rows = []
    for i, e in enumerate(exps):
        row = torch.zeros(fmt.latent_fp8_row_bytes(RANK, ROPE), dtype=torch.uint8)
        row[:RANK] = codes.roll(37 * i).repeat(3)[:RANK]
        group_scales = torch.tensor([m * 2.0 ** (e + g - 1) for g, m in enumerate(mults)])
        row[RANK : RANK + 16] = group_scales.view(torch.uint8)
        rows.append(row)
    cache = torch.stack(rows).cuda()
    tokens = len(rows)
    want = fmt.unpack_latent_fp8(cache.cpu(), RANK)[0].bfloat16().float()[:, None, :].expand(-1, 64, -1)
    q_lat = torch.randn(tokens, 64, RANK).bfloat16().cuda()
    q_pe = torch.zeros(tokens, 64, ROPE, dtype=torch.bfloat16).cuda()
    # One valid entry per list, not the first, in the first block; then in the second (for the
    # lock-step kernel: dequantised from the staged copy with stage=True).
    for width, at in ((64, 5), (128, 64 + 5)):
        slots = torch.full((tokens, width), -1, dtype=torch.int32)
        slots[:, at] = torch.arange(tokens)
        slots = slots.cuda()
        for stage in (False, True):
            got = sparse_mla_decode_gluon(q_lat, q_pe, cache, slots, SCALE, num_splits=1, stage=stage, bits=bits)
            assert torch.equal(got.cpu(), want), (width, stage)
        got = sparse_mla_decode_ws(q_lat, q_pe, cache, slots, SCALE, num_splits=1, bits=bits)
        assert torch.equal(got.cpu(), want), (width, "ws")


@hopper
@pytest.mark.parametrize("tokens", [5, 300])
def test_registry_backend_takes_it(monkeypatch, tokens):
    """Decode steps and prompt chunks (from PREFILL_TOKENS tokens, loops trimmed) alike."""
    (q_lat, q_pe, cache, slots), want = case(tokens, 64, True, seed=5)
    calls = []
    real = sparse_mla_decode_gluon

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr("nsaserve.kernels.gluon_sparse_mla.sparse_mla_decode_gluon", spy)
    monkeypatch.setattr(triton_sparse_mla, "KERNEL", "gluon")
    monkeypatch.setattr(triton_sparse_mla, "WS_MODE", "none")  # the warp-specialised kernel's: its own file
    got = get_backend("attention", "triton")(q_lat, q_pe, cache, slots, SCALE, whole_contexts=tokens < 100)
    assert len(calls) == 1 and calls[0]["trim"] is True
    assert got.dtype == q_lat.dtype and rel_err(got.float().cpu(), want) < 1e-2


def test_shape_rule():
    """What the registry backend hands the Gluon kernel, checked on any machine."""
    bf16, u8 = torch.bfloat16, torch.uint8
    assert takes_shapes(64, 512, 64, bf16, bf16, u8) and takes_shapes(128, 512, 64, bf16, bf16, bf16)
    assert not takes_shapes(16, 512, 64, bf16, bf16, u8)  # tensor-parallel ranks with fewer heads
    assert not takes_shapes(64, 512, 64, torch.float16, torch.float16, u8)
    assert not takes_shapes(64, 96, 64, bf16, bf16, u8) and not takes_shapes(64, 1024, 64, bf16, bf16, u8)
    assert not takes_shapes(64, 384, 64, bf16, bf16, u8)  # three groups of 128: not a power of two
    assert not takes_shapes(64, 512, 48, bf16, bf16, u8)
    assert not supports(*(torch.zeros(1, 64, d, dtype=bf16) for d in (512, 64)), torch.zeros(4, 656, dtype=u8))  # CPU
