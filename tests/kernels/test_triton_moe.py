"""Triton NVFP4 W4A16 MoE (kernels/triton_moe_w4a16.py, its align in triton_moe_align.py) against
the torch reference on the dequantised weights (moe.moe_experts_torch + quant.nvfp4.dequantize_nvfp4),
on fresh random inputs.

Tiny shapes run everywhere (Triton's CPU interpreter without a GPU); GLM-5 shapes (hidden 6144,
256 experts, top-8, intermediate 2048) and CUDA-graph replay run only with CUDA.
"""

import functools

import pytest
import torch

from nsaserve.kernels.moe import moe_experts_torch
from nsaserve.kernels.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4, random_nvfp4_experts

triton = pytest.importorskip("triton")
from nsaserve.kernels import triton_moe_align as ta  # noqa: E402
from nsaserve.kernels import triton_moe_w4a16 as tm  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9  # the Gluon kernels' GPUs
# bf16 activations and a bf16 intermediate h (the weights themselves are exact in bf16).
TOL = 1.5e-2
# Portable dequantisation everywhere; the inline-assembly one too where it can run.
ASM_MODES = [False, True] if CUDA else [False]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def quantized_stacks(num_experts, hidden, inter, gen, device=DEV):
    """Random float experts quantised like a ModelOpt export: w13 (gate, up) and w2 NVFP4 stacks."""

    def q(rows, cols):
        parts = [quantize_nvfp4(torch.randn(rows, cols, generator=gen) * (0.5 + torch.rand(1, generator=gen)) / cols**0.5)
                 for _ in range(num_experts)]  # fmt: skip
        return [
            torch.stack([getattr(p, f) for p in parts]).to(device) for f in ("weight", "weight_scale", "weight_scale_2")
        ]

    gw, gs, gs2 = q(inter, hidden)
    uw, us, us2 = q(inter, hidden)
    dw, ds, ds2 = q(hidden, inter)
    w13 = (torch.cat([gw, uw], 1), torch.cat([gs, us], 1), torch.stack([gs2, us2], 1))
    return w13, (dw, ds, ds2.view(-1, 1))


def random_stacks(num_experts, hidden, inter, gen, device):
    """Large random NVFP4 stacks from random codes and scales (quantising 5 GB of float weights
    would dominate the test)."""
    w13 = random_nvfp4_experts(num_experts, 2 * inter, hidden, 2, gen, device)
    return w13, random_nvfp4_experts(num_experts, hidden, inter, 1, gen, device)


def dense(stack, parts):
    w, s, s2 = stack
    rows = w.shape[1] // parts
    return torch.cat(
        [dequantize_nvfp4(w[:, p * rows : (p + 1) * rows], s[:, p * rows : (p + 1) * rows], s2[:, p].view(-1, 1, 1))
         for p in range(parts)], 1)  # fmt: skip


def reference(x, ids, weights, w13, w2, first_expert):
    """moe_experts_torch on the dequantised weights, float32, one expert at a time."""
    num_local = w13[0].shape[0]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = ids - first_expert
    for e in torch.unique(local[(local >= 0) & (local < num_local)]).tolist():
        sel = torch.tensor([e], device=x.device)
        d13 = dense(tuple(t[sel] for t in w13), 2)
        d2 = dense(tuple(t[sel] for t in w2), 1)
        one = torch.where(local == e, 0, -1)
        out += moe_experts_torch(x.float(), one, weights, d13, d2, 0)
    return out


def route(num_tokens, num_experts, top_k, gen, device=DEV, skew=False):
    """Distinct experts per token; `skew` sends most tokens to a few experts (uneven blocks)."""
    if skew:
        pool = torch.randperm(num_experts, generator=gen)[: max(top_k + 1, num_experts // 8)]
        ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(num_tokens)])
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return ids.to(device), weights.to(device)


TINY = dict(num_experts=6, hidden=128, inter=128, top_k=2)
TINY_CFG = {
    "gate_up": {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2},
    "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2},
}


@pytest.mark.parametrize("asm", ASM_MODES)
@pytest.mark.parametrize(
    "num_tokens,skew,block_m", [(1, False, None), (7, False, 32), (33, True, 16), (7, False, 8), (33, True, 8)]
)
def test_tiny_matches_reference(num_tokens, skew, block_m, asm):
    gen = torch.Generator().manual_seed(1000 + num_tokens)
    e, h, i, k = TINY["num_experts"], TINY["hidden"], TINY["inter"], TINY["top_k"]
    w13, w2 = quantized_stacks(e, h, i, gen)
    x = torch.randn(num_tokens, h, generator=gen).to(DEV, torch.bfloat16)
    ids, weights = route(num_tokens, e, k, gen, skew=skew)
    out = tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, 0, block_m=block_m, config=TINY_CFG, asm=asm)
    ref = reference(x, ids, weights, w13, w2, 0)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("first_expert", [0, 6])
def test_add_is_summed_in_float32_then_rounded(first_expert):
    """add= (the MoE block's shared experts) gives exactly (sum + add.float()).to(add.dtype), also
    for tokens none of whose experts live here and for a step with no local slot at all."""
    gen = torch.Generator().manual_seed(77 + first_expert)
    e, h, i, k = TINY["num_experts"], TINY["hidden"], TINY["inter"], TINY["top_k"]
    w13, w2 = quantized_stacks(e, h, i, gen)
    x = torch.randn(9, h, generator=gen).to(DEV, torch.bfloat16)
    ids, weights = route(9, 2 * e, k, gen)
    add = torch.randn(9, h, generator=gen).to(DEV, torch.bfloat16)
    plain = tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, first_expert, config=TINY_CFG)
    fused = tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, first_expert, config=TINY_CFG, add=add)
    assert fused.dtype == torch.bfloat16
    assert torch.equal(fused, (plain + add.float()).to(torch.bfloat16))
    none = tm.moe_experts_nvfp4_triton(x[:0], ids[:0], weights[:0], *w13, *w2, first_expert, add=add[:0])
    assert none.shape == (0, h) and none.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="add has shape"):
        tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, first_expert, config=TINY_CFG, add=add[:3])


@pytest.mark.parametrize("num_tokens,block_m", [(120, 32), (600, 64)])
def test_tiny_prompt_presets_match_reference(num_tokens, block_m):
    """Steps with >= 32 rows per expert (here 40: 32-token blocks, paired; and 200: several 64-token
    blocks an expert) take PROMPT_PRESETS' blocks when no config is given, and match the reference
    in both layouts."""
    gen = torch.Generator(DEV).manual_seed(num_tokens)
    e, h, i, k = TINY["num_experts"], TINY["hidden"], TINY["inter"], TINY["top_k"]
    assert tm.prompt_preset(num_tokens * k, e)[0] == block_m
    w13, w2 = random_stacks(e, h, i, gen, DEV)
    x = torch.randn(num_tokens, h, generator=gen, device=DEV).to(torch.bfloat16)
    ids, weights = route(num_tokens, e, k, torch.Generator().manual_seed(num_tokens))
    ref = reference(x, ids, weights, w13, w2, 0)
    assert rel_err(tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, 0), ref) < TOL
    assert rel_err(tm.moe_experts_nvfp4_triton(x, ids, weights, *relaid(w13), *relaid(w2), 0, relayout=True), ref) < TOL


@pytest.mark.parametrize("asm", ASM_MODES)
def test_tiny_preset_full_width_tiles_match_reference(asm):
    """The preset at widths it uses whole: hidden 256 (its 256-row down tiles) and intermediate 256
    (128-row gate/up tiles), in the tiled layout, 40 rows per expert."""
    gen = torch.Generator(DEV).manual_seed(9)
    e, h, i, k = 6, 256, 256, 2
    assert tm.prompt_preset(120 * k, e)[1]["down"]["BLOCK_N"] == h
    w13, w2 = random_stacks(e, h, i, gen, DEV)
    x = torch.randn(120, h, generator=gen, device=DEV).to(torch.bfloat16)
    ids, weights = route(120, e, k, torch.Generator().manual_seed(9))
    r13, r2 = relaid(w13), relaid(w2)
    t13, t2 = ((*tm.tile_nvfp4(s[0], s[1]), s[2]) for s in (r13, r2))
    tiled = tm.moe_experts_nvfp4_triton(x, ids, weights, *t13, *t2, 0, asm=asm, relayout=True, tiled=True)
    assert rel_err(tiled, reference(x, ids, weights, w13, w2, 0)) < TOL
    assert torch.equal(tiled, tm.moe_experts_nvfp4_triton(x, ids, weights, *r13, *r2, 0, asm=asm, relayout=True))


def test_block_sizes_follow_the_rows_a_local_expert_can_expect():
    """With expert parallelism a rank's experts get num_local / num_experts of the slots: one TP=8
    rank with 32 of 256 experts sees ~8 rows an expert at 256 tokens, a decode size, not 64."""
    assert tm.expected_local_slots(256 * 8, 32, 256) == 256
    assert tm.expected_local_slots(256 * 8, 256, 256) == tm.expected_local_slots(256 * 8, 256, None) == 2048
    assert tm.prompt_preset(256 * 8, 32) is not None  # what all the slots would have picked
    assert tm.prompt_preset(tm.expected_local_slots(256 * 8, 32, 256), 32) is None
    assert tm.pick_block_m(tm.expected_local_slots(256 * 8, 32, 256), 32) == 8
    assert tm.paired_blocks(8, tm.expected_local_slots(256 * 8, 32, 256), 32)  # 8 rows an expert: paired
    assert not tm.paired_blocks(8, 128 * 8, 256)  # 4 rows an expert: single 8-token blocks
    assert tm.prompt_preset(tm.expected_local_slots(1024 * 8, 32, 256), 32)[0] == 32  # 32 rows an expert
    assert tm.paired_blocks(32, tm.expected_local_slots(1024 * 8, 32, 256), 32)  # ... paired into 64


@pytest.mark.parametrize("num_tokens", [5, 120])
def test_tiny_expert_parallel_block_sizes_match_reference(num_tokens):
    """A rank with 6 of 48 experts: blocks sized by its expected rows (5 tokens: 16-token blocks;
    120: 2.5 rows an expert where all the slots would count 40 and take the preset), and every
    token routed here still lands (the buffers stay sized for all slots being local)."""
    gen = torch.Generator(DEV).manual_seed(num_tokens)
    e, h, i, k = TINY["num_experts"], TINY["hidden"], TINY["inter"], TINY["top_k"]
    w13, w2 = random_stacks(e, h, i, gen, DEV)
    x = torch.randn(num_tokens, h, generator=gen, device=DEV).to(torch.bfloat16)
    ids, weights = route(num_tokens, e, k, torch.Generator().manual_seed(num_tokens))  # all local: the worst case
    out = tm.moe_experts_nvfp4_triton(x, ids + 12, weights, *w13, *w2, 12, num_experts=8 * e)
    assert rel_err(out, reference(x, ids, weights, w13, w2, 0)) < TOL


def test_presets_start_at_32_rows_per_expert():
    assert tm.prompt_preset(31 * 256, 256) is None  # decode-sized: the defaults and pick_block_m
    assert not tm.paired_blocks(32, 31 * 256, 256)  # 32-token blocks below 32 rows an expert: unpaired
    # From 32 rows an expert 32-token blocks, the experts of more than 32 rows paired into 64; from
    # 64 rows an expert 64-token blocks.
    assert tm.prompt_preset(32 * 256, 256)[0] == 32 and tm.paired_blocks(32, 32 * 256, 256)
    assert tm.prompt_preset(63 * 256, 256)[0] == 32
    assert tm.prompt_preset(64 * 256, 256)[0] == 64 and tm.prompt_preset(4096 * 256, 256)[0] == 64
    assert not tm.paired_blocks(64, 64 * 256, 256)


@pytest.mark.parametrize("relayout", [False, True])
@pytest.mark.parametrize("first_expert", [0, 6, 12])
def test_tiny_expert_parallel_share(first_expert, relayout):
    """Under tensor parallelism a rank holds experts [first_expert, first_expert + 6) of 18: tokens
    routed to other ranks' experts add nothing here, and local ids are global ids minus first_expert."""
    gen = torch.Generator().manual_seed(40 + first_expert)
    e, h, i, k = TINY["num_experts"], TINY["hidden"], TINY["inter"], TINY["top_k"]
    w13, w2 = quantized_stacks(e, h, i, gen)
    x = torch.randn(11, h, generator=gen).to(DEV, torch.bfloat16)
    ids, weights = route(11, 3 * e, k, gen)
    ref = reference(x, ids, weights, w13, w2, first_expert)
    if relayout:
        out = tm.moe_experts_nvfp4_triton(x, ids, weights, *relaid(w13), *relaid(w2), first_expert, config=TINY_CFG,
                                          relayout=True)  # fmt: skip
    else:
        out = tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, first_expert, config=TINY_CFG)
    local = ids - first_expert
    assert ((local >= 0) & (local < e)).any() and ((local < 0) | (local >= e)).any()  # both kinds of rows
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("fuse_k", [True, False])
@pytest.mark.parametrize("asm", ASM_MODES)
def test_tiny_every_code_and_scale(asm, fuse_k):
    """Random codes (all 16, both nibbles) and block scales over the whole e4m3 range; one MMA per
    K block or 8 partial ones."""
    gen = torch.Generator(DEV).manual_seed(3)
    e, h, i, k = TINY["num_experts"], TINY["hidden"], TINY["inter"], TINY["top_k"]
    w13, w2 = random_stacks(e, h, i, gen, DEV)
    x = torch.randn(5, h, generator=gen, device=DEV).to(torch.bfloat16)
    ids, weights = route(5, e, k, torch.Generator().manual_seed(3))
    cfg = {kernel: {**c, "FUSE_K": fuse_k} for kernel, c in TINY_CFG.items()}
    out = tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, 0, config=cfg, asm=asm)
    assert rel_err(out, reference(x, ids, weights, w13, w2, 0)) < TOL


def relaid(stack):
    """An NVFP4 stack (weight, scale, scale_2) in relayout_nvfp4's layout."""
    w, s = tm.relayout_nvfp4(stack[0], stack[1])
    return w, s, stack[2]


def test_relayout_round_trip_every_scale():
    """Re-laid-out codes and re-encoded scales come back to the checkpoint's (codes of zero-scale
    blocks to 0) and dequantise to the same values; the words read as _pair_asm reads them (rotate,
    mask, merge the signs) give every input's code; every scale byte's code u gives the bf16 bits
    u * 16 + 0x7600 = scale * 2^119."""
    gen = torch.Generator().manual_seed(21)
    w = torch.randint(0, 256, (3, 24, 64), dtype=torch.uint8, generator=gen)
    sb = torch.randint(0, 0x7F, (3, 24, 8), dtype=torch.uint8, generator=gen)
    sb.view(-1)[:127] = torch.arange(127, dtype=torch.uint8)  # every non-negative, non-NaN byte
    sc = sb.view(torch.float8_e4m3fn)
    rw, rs = tm.relayout_nvfp4(w, sc, rows_per_chunk=5)
    bw, bs = tm.unrelayout_nvfp4(rw, rs)
    assert torch.equal(bs.view(torch.uint8), sb)
    live = (sb != 0).repeat_interleave(8, -1)
    assert torch.equal(bw[live], w[live]) and not bw[~live].any()
    ones = torch.ones(3, 1, 1)
    assert torch.equal(dequantize_nvfp4(w, sc, ones), dequantize_nvfp4(bw, bs, ones))
    bits = rs.view(-1).to(torch.int32) * 16 + 0x7600
    as_bf16 = bits.to(torch.int16).view(torch.bfloat16).float()
    assert torch.equal(as_bf16[sb.view(-1) != 0], sc.view(-1).float()[sb.view(-1) != 0] * 2.0**119)
    # The inline assembly's arithmetic on the words, in int64.
    words = rw.reshape(-1, 8).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [groups, 2]
    codes = torch.stack([bw.long() & 15, bw.long() >> 4], -1).reshape(-1, 16)

    def rotr(x, r):
        return ((x >> r) | (x << (32 - r))) & 0xFFFFFFFF if r else x

    for word in range(2):
        for p in range(4):
            x = words[:, word]
            t = (rotr(x, tm.RELAYOUT_R_MAG[p]) & 0x01C001C0) | (rotr(x, tm.RELAYOUT_R_SIGN[p]) & 0x80008000)
            q = 4 * word + p
            assert torch.equal(((t >> 6) & 7) | ((t >> 12) & 8), codes[:, q])
            assert torch.equal(((t >> 22) & 7) | ((t >> 28) & 8), codes[:, q + 8])


@pytest.mark.parametrize("num_tokens,config", [(9, TINY_CFG), (1, None)])  # None: one token's down blocks
@pytest.mark.parametrize("asm", ASM_MODES)
def test_tiny_relayout_matches_reference(asm, num_tokens, config):
    """relayout=True on re-laid-out stacks: random codes, block scales over the whole e4m3 range
    with zeros (whose blocks' codes are not zero in the checkpoint), against the checkpoint's reference."""
    gen = torch.Generator(DEV).manual_seed(4)
    e, h, i, k = TINY["num_experts"], TINY["hidden"], TINY["inter"], TINY["top_k"]
    w13, w2 = random_stacks(e, h, i, gen, DEV)
    for stack in (w13, w2):
        sb = stack[1].view(torch.uint8)
        sb[torch.rand(sb.shape, generator=gen, device=DEV) < 0.05] = 0
    x = torch.randn(num_tokens, h, generator=gen, device=DEV).to(torch.bfloat16)
    ids, weights = route(num_tokens, e, k, torch.Generator().manual_seed(4))
    out = tm.moe_experts_nvfp4_triton(
        x, ids, weights, *relaid(w13), *relaid(w2), 0, config=config, asm=asm, relayout=True
    )
    ref = reference(x, ids, weights, w13, w2, 0)
    assert rel_err(out, ref) < TOL
    if asm:  # the same products as the checkpoint-layout kernel, up to the order of the sums
        base = tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, 0, config=config, asm=asm)
        assert rel_err(out, base) < 2e-3


@pytest.mark.parametrize("relayout", [False, True])
@pytest.mark.parametrize("asm", ASM_MODES)
def test_tiny_split_k(asm, relayout):
    """Gate/up over K in 2 programs per tile (SPLIT_K): the last one sums the partials and writes h;
    deterministic (partials added in split order)."""
    gen = torch.Generator(DEV).manual_seed(8)
    e, h, i, k = TINY["num_experts"], 256, TINY["inter"], TINY["top_k"]
    w13, w2 = random_stacks(e, h, i, gen, DEV)
    x = torch.randn(3, h, generator=gen, device=DEV).to(torch.bfloat16)
    ids, weights = route(3, e, k, torch.Generator().manual_seed(8))
    k13, k2 = (relaid(w13), relaid(w2)) if relayout else (w13, w2)
    cfg = {**TINY_CFG, "gate_up": {**TINY_CFG["gate_up"], "SPLIT_K": 2}}
    run = functools.partial(tm.moe_experts_nvfp4_triton, config=cfg, asm=asm, relayout=relayout)
    out = run(x, ids, weights, *k13, *k2, 0)
    assert rel_err(out, reference(x, ids, weights, w13, w2, 0)) < TOL
    assert torch.equal(out, run(x, ids, weights, *k13, *k2, 0))


@pytest.mark.parametrize("asm", ASM_MODES)
@pytest.mark.parametrize("num_tokens,block_m", [(5, None), (40, 64)])
@pytest.mark.parametrize("tma", [False, True])
def test_tiny_tiled_equals_relayout(asm, num_tokens, block_m, tma):
    """tiled=True reads the same words and scales from tile_nvfp4's tiles (by pointers, or by TMA
    descriptors): the same results, bit for bit, as relayout=True on the untiled stacks (and both
    near the reference)."""
    gen = torch.Generator(DEV).manual_seed(8)
    e, h, i, k = 6, 256, 256, 2  # the tiles are 256 inputs wide
    w13, w2 = random_stacks(e, h, i, gen, DEV)
    x = torch.randn(num_tokens, h, generator=gen, device=DEV).to(torch.bfloat16)
    ids, weights = route(num_tokens, e, k, torch.Generator().manual_seed(8))
    r13, r2 = relaid(w13), relaid(w2)
    t13, t2 = ((*tm.tile_nvfp4(s[0], s[1]), s[2]) for s in (r13, r2))
    cfg = {"gate_up": {"BLOCK_N": 32, "num_stages": 2}, "down": {"BLOCK_N": 64, "num_stages": 2}}
    run = functools.partial(tm.moe_experts_nvfp4_triton, config=cfg, block_m=block_m, asm=asm, relayout=True)
    tma_cfg = {k: {**v, "TMA": tma} for k, v in cfg.items()}
    tiled = run(x, ids, weights, *t13, *t2, 0, tiled=True, config=tma_cfg)
    assert torch.equal(tiled, run(x, ids, weights, *r13, *r2, 0))
    assert rel_err(tiled, reference(x, ids, weights, w13, w2, 0)) < TOL


def test_gluon_down_is_refused_where_it_cannot_run():
    """The Gluon down kernel (an opt-in config) takes tiled weights on a Hopper GPU only: elsewhere
    a clear error, not a silent fallback."""
    gen = torch.Generator(DEV).manual_seed(9)
    e, h, i, k = 4, 256, 256, 2
    w13, w2 = random_stacks(e, h, i, gen, DEV)
    x = torch.randn(3, h, generator=gen, device=DEV).to(torch.bfloat16)
    ids, weights = route(3, e, k, torch.Generator().manual_seed(9))
    r13, r2 = relaid(w13), relaid(w2)
    with pytest.raises(ValueError, match="Gluon down kernel"):
        tm.moe_experts_nvfp4_triton(x, ids, weights, *r13, *r2, 0, relayout=True, config={"down": {"GLUON": True}})


def test_tile_round_trip_and_placement():
    """tile_nvfp4 / untile_nvfp4 are inverse; row group g's tile t is rows 16g..16g+15, inputs
    256t..256t+255, one contiguous run."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randint(0, 256, (3, 32, 384), dtype=torch.uint8, generator=gen)  # 768 inputs: 3 tiles a row
    s = torch.randint(0, 256, (3, 32, 48), dtype=torch.uint8, generator=gen)
    tw, ts = tm.tile_nvfp4(w, s, groups_per_chunk=2)
    assert tw.shape == w.shape and ts.shape == s.shape
    bw, bs = tm.untile_nvfp4(tw, ts, groups_per_chunk=5)
    assert torch.equal(bw, w) and torch.equal(bs, s)
    flat_w, flat_s = tw.reshape(-1), ts.reshape(-1)
    for expert, group, tile in ((0, 1, 2), (2, 0, 1)):
        g = expert * 2 + group
        run = flat_w[(g * 3 + tile) * 2048 :][:2048].view(16, 128)
        assert torch.equal(run, w[expert, 16 * group : 16 * group + 16, 128 * tile : 128 * tile + 128])
        runs = flat_s[(g * 3 + tile) * 256 :][:256].view(16, 16)
        assert torch.equal(runs, s[expert, 16 * group : 16 * group + 16, 16 * tile : 16 * tile + 16])
    with pytest.raises(ValueError, match="whole tiles"):
        tm.tile_nvfp4(w[:, :24], s[:, :24])
    w13 = (torch.zeros(3, 512, 128, dtype=torch.uint8), torch.zeros(3, 512, 16, dtype=torch.uint8), torch.ones(3, 2))
    w2 = (torch.zeros(3, 256, 128, dtype=torch.uint8), torch.zeros(3, 256, 16, dtype=torch.uint8), torch.ones(3, 1))
    x, ids = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="tiled=True takes re-laid-out"):
        tm.moe_experts_nvfp4_triton(x, ids, torch.ones(1, 1), *w13, *w2, tiled=True)


def test_tiny_expert_parallel_slice():
    """This rank owns experts [3, 6) of 9: other experts' slots contribute nothing, tokens with no
    local expert get exact zeros."""
    gen = torch.Generator().manual_seed(7)
    h, i, k = TINY["hidden"], TINY["inter"], 3
    w13, w2 = quantized_stacks(3, h, i, gen)
    ids, weights = route(9, 9, k, gen)
    ids[0] = torch.tensor([0, 1, 8])  # token 0: nothing local
    x = torch.randn(9, h, generator=gen).to(DEV, torch.bfloat16)
    out = tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, 3, config=TINY_CFG)
    ref = reference(x, ids, weights, w13, w2, 3)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out, ref) < TOL


def test_block_sizing_is_worst_case():
    """Buffers sized from the token count hold the padded runs of any routing: with n experts
    non-empty, the most blocks is n + (slots - n) // block_m (one slot each, the rest in full blocks)."""
    for slots, experts, bm in [(8, 256, 16), (2048, 256, 16), (8192, 256, 64), (5, 3, 16), (100, 7, 32)]:
        worst = max(n + (slots - n) // bm for n in range(1, min(experts, slots) + 1))
        assert tm.max_blocks(slots, experts, bm) >= worst


def _paired_blocks_of(counts, bm: int) -> int:
    """Blocks of a paired align's runs: bm-row runs up to bm slots, 2 bm-row multiples above."""
    return sum(1 if c <= bm else -(-c // (2 * bm)) * 2 for c in counts if c)


def test_paired_block_sizing_is_worst_case():
    """Paired runs (more than bm slots padded to a multiple of 2 bm) fit max_blocks(..., paired=True)
    for the routings that pad most: many experts just over bm slots, single slots, random ones."""
    gen = torch.Generator().manual_seed(5)
    for slots, experts, bm in [(2048, 256, 8), (512, 256, 8), (100, 7, 8), (9, 3, 8), (4096, 32, 8)]:
        tries = []
        for c in range(1, 2 * bm + 2):  # as many experts as possible with c slots, the rest in one
            n = min(experts - 1, slots // c)
            tries.append([c] * n + [slots - c * n])
        for _ in range(50):
            tries.append(torch.bincount(torch.randint(0, experts, (slots,), generator=gen), minlength=experts).tolist())
        worst = max(_paired_blocks_of(t, bm) for t in tries)
        assert tm.max_blocks(slots, experts, bm, paired=True) >= worst


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize(
    "num_tokens,skew,block_m", [(24, False, 8), (7, False, 8), (40, True, 8), (96, False, 32), (80, True, 32)]
)
def test_tiny_paired_blocks_match_reference(monkeypatch, num_tokens, skew, block_m, chunked):
    """block_m-token blocks with the experts of more than block_m rows paired into blocks of 2
    block_m (the same programs take either) give the reference's sums, through either align:
    8 / 16 (decode sizes) and 32 / 64."""
    monkeypatch.setattr(ta, "ALIGN_CHUNKED_FROM", 1 if chunked else 1 << 30)
    monkeypatch.setattr(ta, "ALIGN_SLOT_CHUNK", 32)
    gen = torch.Generator().manual_seed(300 + num_tokens)
    e, h, i, k = TINY["num_experts"], TINY["hidden"], TINY["inter"], TINY["top_k"]
    w13, w2 = quantized_stacks(e, h, i, gen)
    x = torch.randn(num_tokens, h, generator=gen).to(DEV, torch.bfloat16)
    ids, weights = route(num_tokens, e, k, gen, skew=skew)
    counts = torch.bincount(ids.flatten().cpu(), minlength=e)
    if num_tokens in (24, 96):  # block_m rows an expert on average: runs of both kinds
        assert int((counts > block_m).sum()) and int(((counts > 0) & (counts <= block_m)).sum())
    out = tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, 0, block_m=block_m, paired=True, config=TINY_CFG)
    assert rel_err(out, reference(x, ids, weights, w13, w2, 0)) < TOL


@pytest.mark.parametrize("num_tokens,block_m,paired", [(5, 8, False), (24, 8, True)])
def test_tiny_down_mask_h_is_bit_identical(num_tokens, block_m, paired):
    """The down config's MASK_H (padding rows of h zero-filled, not read) changes no bit."""
    gen = torch.Generator().manual_seed(600 + num_tokens)
    e, h, i, k = TINY["num_experts"], TINY["hidden"], TINY["inter"], TINY["top_k"]
    w13, w2 = (relaid(s) for s in quantized_stacks(e, h, i, gen))
    x = torch.randn(num_tokens, h, generator=gen).to(DEV, torch.bfloat16)
    ids, weights = route(num_tokens, e, k, gen)
    cfg = {**TINY_CFG, "down": {**TINY_CFG["down"], "MASK_H": True}}
    run = functools.partial(
        tm.moe_experts_nvfp4_triton, x, ids, weights, *w13, *w2, 0, block_m=block_m, paired=paired, relayout=True
    )
    assert torch.equal(run(config=cfg), run(config=TINY_CFG))


GLM5 = dict(num_experts=256, hidden=6144, inter=2048, top_k=8)


@pytest.fixture(scope="module")
def glm5_stacks():
    gen = torch.Generator("cuda").manual_seed(11)
    return random_stacks(GLM5["num_experts"], GLM5["hidden"], GLM5["inter"], gen, "cuda")


@pytest.fixture(scope="module")
def glm5_relaid(glm5_stacks):
    return tuple(relaid(s) for s in glm5_stacks)


@pytest.fixture(scope="module")
def glm5_tiled(glm5_relaid):
    return tuple((*tm.tile_nvfp4(s[0], s[1]), s[2]) for s in glm5_relaid)


@pytest.mark.skipif(not CUDA, reason="GLM-5 shapes need CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 2048])  # 2048: the 64-row prompt preset
def test_glm5_shapes_match_reference(glm5_stacks, glm5_relaid, glm5_tiled, num_tokens):
    """Checkpoint layout and re-laid-out weights (relayout=True) against one reference; the tiled
    layout gives the re-laid-out results bit for bit."""
    w13, w2 = glm5_stacks
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, GLM5["hidden"], generator=gen).to("cuda", torch.bfloat16)
    ids, weights = route(num_tokens, GLM5["num_experts"], GLM5["top_k"], gen, "cuda", skew=num_tokens == 64)
    ref = reference(x, ids, weights, w13, w2, 0)
    outs = []
    for relayout, (k13, k2) in ((False, glm5_stacks), (True, glm5_relaid)):
        out = tm.moe_experts_nvfp4_triton(x, ids, weights, *k13, *k2, 0, relayout=relayout)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL, f"relayout={relayout}"
        again = tm.moe_experts_nvfp4_triton(x, ids, weights, *k13, *k2, 0, relayout=relayout)
        assert torch.equal(out, again), f"relayout={relayout}: not deterministic"
        outs.append(out)
    # The same bf16 operand values in the same places: the two layouts agree to rounding.
    assert rel_err(outs[1], outs[0]) < 1e-3
    tiled = tm.moe_experts_nvfp4_triton(x, ids, weights, *glm5_tiled[0], *glm5_tiled[1], 0, relayout=True, tiled=True)
    assert torch.equal(tiled, outs[1])
    masked = tm.moe_experts_nvfp4_triton(
        x, ids, weights, *glm5_tiled[0], *glm5_tiled[1], 0, relayout=True, tiled=True, config={"down": {"MASK_H": True}}
    )
    assert torch.equal(masked, outs[1]), "down MASK_H"
    # TMA descriptor loads, and programmatic dependent launches: the same results.
    for option in ("TMA", "PDL"):
        config = {"gate_up": {option: True}, "down": {option: True}}
        again = tm.moe_experts_nvfp4_triton(
            x, ids, weights, *glm5_tiled[0], *glm5_tiled[1], 0, relayout=True, tiled=True, config=config
        )
        assert torch.equal(again, outs[1]), option
    if HOPPER and num_tokens <= 256:
        # The Gluon down kernel (16-token blocks): the same bits as the Triton kernel's 16-token
        # blocks, at its default and at 4 stages.
        tiled_run = functools.partial(
            tm.moe_experts_nvfp4_triton, x, ids, weights, *glm5_tiled[0], *glm5_tiled[1], 0, relayout=True, tiled=True,
            block_m=16,
        )  # fmt: skip
        base = tiled_run()
        assert rel_err(base, ref) < TOL
        for down in ({"GLUON": True}, {"GLUON": True, "STAGES": 4, "PROGRAMS_PER_SM": 2, "maxnreg": None}):
            assert torch.equal(tiled_run(config={"down": down}), base), down


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA")
# 600 x 8 slots: the chunked align. option: the kernels launched as programmatic dependents (PDL);
# the Gluon down kernel (tiled weights; its fixed grid counts the used blocks on the device), at 512
# tokens with 32-token blocks.
@pytest.mark.parametrize(
    "relayout,t,option",
    [
        (False, 16, None),
        (True, 16, None),
        (True, 600, None),
        (True, 16, "PDL"),
        (True, 256, None),  # 8-token blocks, the experts of more than 8 rows paired
        (True, 16, "GLUON"),
        (True, 512, "GLUON"),
    ],
)
def test_cuda_graph_replays_new_routing(request, glm5_stacks, relayout, t, option):
    """Captured once for t tokens, replayed with other inputs and other routings."""
    if option == "GLUON" and not HOPPER:
        pytest.skip("the Gluon kernel needs Hopper")
    w13, w2 = glm5_stacks
    tiled = option == "GLUON"
    k13, k2 = request.getfixturevalue("glm5_tiled" if tiled else "glm5_relaid") if relayout else glm5_stacks
    gen = torch.Generator().manual_seed(5)
    h = GLM5["hidden"]
    x = torch.randn(t, h, generator=gen).to("cuda", torch.bfloat16)
    ids, weights = route(t, GLM5["num_experts"], GLM5["top_k"], gen, "cuda")
    config = {"gate_up": {option: True}, "down": {option: True}} if option in ("PDL", "GLUON") else None
    block_m = 16 if option == "GLUON" and t <= 256 else None  # the Gluon kernel takes 16 or 32 rows
    run = functools.partial(
        tm.moe_experts_nvfp4_triton, relayout=relayout, tiled=tiled, config=config, block_m=block_m
    )
    out = run(x, ids, weights, *k13, *k2, 0)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(x, ids, weights, *k13, *k2, 0)
    for skew in (False, True):
        new_ids, new_w = route(t, GLM5["num_experts"], GLM5["top_k"], gen, "cuda", skew=skew)
        x.copy_(torch.randn(t, h, generator=gen).to("cuda", torch.bfloat16))
        ids.copy_(new_ids)
        weights.copy_(new_w)
        out.fill_(float("nan"))
        g.replay()
        assert rel_err(out, reference(x, ids, weights, w13, w2, 0)) < TOL
        if tiled:  # the Gluon down kernel: bit for bit the Triton kernel's results (same block rows)
            plain = tm.moe_experts_nvfp4_triton(x, ids, weights, *k13, *k2, 0, relayout=True, tiled=True, block_m=block_m)
            assert torch.equal(out, plain)


@pytest.mark.parametrize(
    "num_experts,top_k,n_group,topk_group,norm",
    [(8, 2, 1, 1, True), (16, 4, 4, 2, True), (256, 8, 1, 1, True), (256, 8, 8, 4, True), (64, 6, 1, 1, False)],
)
def test_routing_matches_reference(num_experts, top_k, n_group, topk_group, norm):
    """Sigmoid + bias + group top-k (GLM-5: 1 group; DeepSeek-V3.2: 8 groups keep 4)."""
    from nsaserve.kernels.moe import route_noaux_tc
    from nsaserve.kernels.triton_moe_route import route_noaux_tc_triton

    gen = torch.Generator().manual_seed(num_experts + top_k)
    logits = (torch.randn(9, num_experts, generator=gen) * 2).to(DEV)
    bias = (torch.randn(num_experts, generator=gen) * 0.1).to(DEV)
    args = (logits, bias, top_k, n_group, topk_group, norm, 2.5)
    w, ids = route_noaux_tc_triton(*args)
    ref_w, ref_ids = route_noaux_tc(*args)
    assert ids.dtype == ref_ids.dtype and torch.equal(ids, ref_ids)
    assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)


def test_align_layout():
    """Every local slot appears once, in input order within its expert; each expert's run starts on
    a block boundary and is padded with -1; blocks past the last run are marked unused."""
    gen = torch.Generator().manual_seed(2)
    e, bm, k = 5, 16, 3
    ids, _ = route(30, 9, k, gen, skew=True)
    ids = ids.to(DEV)
    local = (ids - 2).flatten().cpu()  # this rank owns experts 2..6
    n_slots = ids.numel()
    nblocks = tm.max_blocks(n_slots, e, bm)
    slots = torch.full((nblocks * bm,), 77, dtype=torch.int32, device=DEV)
    blocks = torch.full((nblocks,), 77, dtype=torch.int32, device=DEV)
    x = torch.zeros(30, 128, device=DEV)
    xp = torch.empty(30, 128, dtype=torch.bfloat16, device=DEV)
    loops = (4, 1, 2)  # slot, expert-block and block chunks of 32 (more than needed: the tails are masked)
    interp = DEV != "cuda"
    ta._moe_align_kernel[(e + 30,)](
        ids, slots, blocks, x, xp, n_slots, 2, e, nblocks, *loops,
        E_P2=8, BLOCK_M=bm, CHUNK=32, SLOT_CHUNKS=loops[0] if interp else 0,
        EXPERT_BLOCK_CHUNKS=loops[1] if interp else 0, BLOCK_CHUNKS=loops[2] if interp else 0,
        HIDDEN=128, BLOCK_K=128, INTERPRET=interp,
    )  # fmt: skip
    slots, blocks = slots.cpu(), blocks.cpu()
    row = 0
    for b, expert in enumerate(blocks.tolist()):
        if expert < 0:
            assert all(x < 0 for x in blocks[b:].tolist())
            break
        if b == 0 or blocks[b - 1] != expert:
            mine = torch.nonzero(local == expert).flatten().tolist()
            run = -(-len(mine) // bm) * bm
            assert slots[row : row + run].tolist() == mine + [-1] * (run - len(mine))
            row += run
    assert row == sum(-(-int((local == x).sum()) // bm) * bm for x in range(e))


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,first_expert,num_local,skew,slot_chunk",
    [
        (700, 4, 24, 8, 12, True, 1024),  # 2800 slots: two whole chunks and a partial one
        (300, 8, 40, 0, 40, False, 64),  # every expert local, 38 chunks
        (50, 2, 16, 4, 4, True, 16),  # few local slots: empty chunks and experts with no slot
        (1, 8, 16, 0, 16, False, 1024),
    ],
)
def test_chunked_align_equals_per_expert_align(
    monkeypatch, num_tokens, top_k, num_experts, first_expert, num_local, skew, slot_chunk
):
    """The chunked align (three launches, for prompt-sized steps) lays out exactly what the
    one-launch align does: the same blocks, the same slots in the same order, the same padding and
    the same permuted activations."""
    monkeypatch.setattr(ta, "ALIGN_SLOT_CHUNK", slot_chunk)
    gen = torch.Generator().manual_seed(num_tokens + slot_chunk)
    ids, _ = route(num_tokens, num_experts, top_k, gen, skew=skew)
    x = torch.randn(num_tokens, 256, generator=gen).to(DEV)
    flat = ids.flatten().cpu()
    local_ids = flat[(flat >= first_expert) & (flat < first_expert + num_local)] - first_expert
    counts = torch.bincount(local_ids, minlength=num_local).tolist()
    for block_m, paired in ((16, False), (64, False), (8, True)):
        nblocks = tm.max_blocks(ids.numel(), num_local, block_m, paired)
        one = ta._align(x, ids, first_expert, num_local, block_m, nblocks, 128, chunked=False, paired=paired)
        chunked = ta._align(x, ids, first_expert, num_local, block_m, nblocks, 128, chunked=True, paired=paired)
        blocks = one[1].cpu()
        assert torch.equal(chunked[1].cpu(), blocks)
        if paired:  # the runs' blocks first (single blocks e, pairs -(e + 2) then -1), then unused ones
            total = _paired_blocks_of(counts, block_m)
            assert bool((blocks[total:] == -1).all())
            marks = []
            for ex, c in enumerate(counts):
                if c:
                    marks += [ex] if c <= block_m else [-(ex + 2), -1] * (-(-c // (2 * block_m)))
            assert blocks[:total].tolist() == marks
            used = torch.arange(total)
        else:
            used = torch.nonzero(blocks >= 0).flatten()
            assert bool((blocks[: used.numel()] >= 0).all())  # the used blocks come first
        rows = (used[:, None] * block_m + torch.arange(block_m)).flatten()
        assert torch.equal(chunked[0].cpu()[rows], one[0].cpu()[rows])
        assert torch.equal(chunked[2], one[2])
        local = ((ids.flatten().cpu() >= first_expert) & (ids.flatten().cpu() < first_expert + num_local)).sum()
        assert int((one[0].cpu()[rows] >= 0).sum()) == int(local)


def test_chunked_align_whole_path_matches_reference(monkeypatch):
    monkeypatch.setattr(ta, "ALIGN_CHUNKED_FROM", 1)
    monkeypatch.setattr(ta, "ALIGN_SLOT_CHUNK", 32)
    gen = torch.Generator().manual_seed(77)
    e, h, i, k = TINY["num_experts"], TINY["hidden"], TINY["inter"], TINY["top_k"]
    w13, w2 = quantized_stacks(e, h, i, gen)
    x = torch.randn(45, h, generator=gen).to(DEV, torch.bfloat16)
    ids, weights = route(45, e, k, gen, skew=True)
    out = tm.moe_experts_nvfp4_triton(x, ids, weights, *w13, *w2, 0, config=TINY_CFG)
    assert rel_err(out, reference(x, ids, weights, w13, w2, 0)) < TOL
