"""NVFP4 -> bf16 dequantisation for the W4A16 MoE kernels (triton_moe_w4a16.py): the inline
assembly and the portable arithmetic that builds the same values, the loads of a K block's code
words and scales (rows, re-laid-out rows, tiles, tiles through the tensor memory accelerator), and
a whole K block as one MMA operand in the kernels' operand order (input 8j + r of a K block at
position r·BLOCK_K/8 + j; see triton_moe_w4a16).

Dequantisation (the inline-assembly path on the GPU): a code c = s·e1·e0·m becomes the bf16 bits
(s << 15) | (e1 e0 m << 6), which is exactly e2m1(c) · 2^-126 (0.5 lands on the smallest
subnormal), two values per 32-bit register with a byte permute (which also replicates the sign),
a shift and a mask; one packed bf16 multiply
by (block scale · 2^119) then gives e2m1 · scale · 2^-7 exactly (both have few enough mantissa
bits), and the epilogue multiplies by the expert's global scale · 2^7. The portable path (Triton's
CPU interpreter, or ASM=False) builds the same values with ordinary arithmetic.

Re-laid-out weights (relayout_nvfp4, the kernels' relayout=True): each 16-input group's two words
hold the codes in an order where a pair of bf16 values comes from one word by a rotation, a mask
and (for two of the four pairs) a merge of the sign bits, 15 instructions per 8 values instead of
17, and the scales are re-encoded bytes whose bf16x2 (scale · 2^119, scale · 2^119) is one integer
multiply-add (the checkpoint's e4m3 needs a conversion through f16 and f32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .quant.nvfp4 import RELAYOUT_R_MAG, RELAYOUT_R_SIGN, TILE_K
from .triton_common import mma_operand

# Exponent the inline-assembly dequantisation leaves out of the weights (restored in the epilogue).
_ASM_SHIFT = tl.constexpr(7)


def _dequant_asm(byte: int) -> str:
    """PTX for one byte position of two 32-bit code words A ($2) and B ($3), given also A << 4
    ($4) and B << 4 ($5): the low and high nibbles of A's and B's byte `byte` become two bf16x2
    registers ($0: low nibbles, $1: high; A in the low half), multiplied by the bf16x2 scales in
    $6. prmt puts the byte at bits 0-7 (A) and 16-23 (B) and its sign bit replicated over bits
    8-15 and 24-31; one shift by 2 then brings the magnitude (bits 4-6) to 6-8 and a copy of the
    sign to 15 and 31, and one mask keeps those. The low nibble is the high nibble of A << 4."""
    sel = (0xC + byte) << 12 | (4 + byte) << 8 | (8 + byte) << 4 | byte
    return f"""
{{
.reg .b32 t, u;
prmt.b32 t, $2, $3, {sel:#06x};
shl.b32 t, t, 2;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, $6;
prmt.b32 u, $4, $5, {sel:#06x};
shl.b32 u, u, 2;
and.b32 u, u, 0x81C081C0;
mul.rn.bf16x2 $0, u, $6;
}}
"""


_ASM_BYTE0 = tl.constexpr(_dequant_asm(0))
_ASM_BYTE1 = tl.constexpr(_dequant_asm(1))
_ASM_BYTE2 = tl.constexpr(_dequant_asm(2))
_ASM_BYTE3 = tl.constexpr(_dequant_asm(3))


# Pair p of a re-laid-out word (quant.nvfp4.relayout_nvfp4) is read by rotating the word right by
# RELAYOUT_R_MAG[p] (magnitudes) and RELAYOUT_R_SIGN[p] (signs).


def _pair_ptx(p: int, word: str, out_lo: str, out_hi: str, scale: str) -> str:
    """PTX for pair p of the re-laid-out word `word`: out_lo, out_hi = the bf16 values (input q,
    q + 8) times the bf16x2 scale `scale` (scratch registers t and u, declared by the caller)."""
    rm, rs = RELAYOUT_R_MAG[p], RELAYOUT_R_SIGN[p]

    def rot(dst: str, src: str, r: int, lowest: int, highest: int) -> str:
        """dst = src rotated right by r, for output bits lowest..highest only: a plain shift where
        no needed bit wraps around (ptxas can issue a left shift on the multiply-add pipe)."""
        if r == 0:
            return f"mov.b32 {dst}, {src};"
        if 32 - r <= lowest:
            return f"shl.b32 {dst}, {src}, {32 - r};"
        if highest + r <= 31:
            return f"shr.u32 {dst}, {src}, {r};"
        return f"shf.r.wrap.b32 {dst}, {src}, {src}, {r};"

    if rm == rs:
        body = f"{rot('t', word, rm, 6, 31)}\nand.b32 t, t, 0x81C081C0;"
    else:
        body = f"{rot('t', word, rm, 6, 24)}\nand.b32 t, t, 0x01C001C0;\n"
        if rs == 0:
            body += f"lop3.b32 t, t, {word}, 0x80008000, 0xF8;"
        else:
            body += f"{rot('u', word, rs, 15, 31)}\nlop3.b32 t, t, u, 0x80008000, 0xF8;"
    return f"{body}\nmul.rn.bf16x2 t, t, {scale};\nmov.b32 {{{out_lo}, {out_hi}}}, t;"


def _pair_asm(p: int) -> str:
    """PTX for pair p of two re-laid-out words $4 and $5: ($0, $1) and ($2, $3) are the bf16
    values (input q, q + 8) of each, times the bf16x2 scale $6."""
    return f"""
{{
.reg .b32 t, u;
{_pair_ptx(p, "$4", "$0", "$1", "$6")}
{_pair_ptx(p, "$5", "$2", "$3", "$6")}
}}
"""


def word_pairs_asm(p0: int, p1: int) -> str:
    """PTX for pairs p0 and p1 of one re-laid-out word $4: ($0, $1) and ($2, $3) are their bf16
    values (input q, q + 8), times the bf16x2 scale $5."""
    return f"""
{{
.reg .b32 t, u;
{_pair_ptx(p0, "$4", "$0", "$1", "$5")}
{_pair_ptx(p1, "$4", "$2", "$3", "$5")}
}}
"""


_ASM_PAIR0 = tl.constexpr(_pair_asm(0))
_ASM_PAIR1 = tl.constexpr(_pair_asm(1))
_ASM_PAIR2 = tl.constexpr(_pair_asm(2))
_ASM_PAIR3 = tl.constexpr(_pair_asm(3))
_R_MAG = tl.constexpr(RELAYOUT_R_MAG)
_R_SIGN = tl.constexpr(RELAYOUT_R_SIGN)
# A tile row's code words and scale bytes (tile_nvfp4: TILE_K inputs).
_TILE_WORDS = tl.constexpr(TILE_K // 8)
_TILE_SCALES = tl.constexpr(TILE_K // 16)


@triton.jit
def _e2m1_value(c):
    """Code (int32, 0..15) -> its e2m1 value in float32, by arithmetic (the portable path)."""
    mag = c & 7
    # 2..7 are normal: exponent (mag >> 1) - 1 and one mantissa bit; 0 and 1 are 0 and 0.5.
    normal = ((mag + 252) << 22).to(tl.float32, bitcast=True)
    v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
    return tl.where(c >= 8, -v, v)


@triton.jit
def _load_tile(
    w_ptr, s_ptr, rows, i,
    KW: tl.constexpr, KS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """K block i of rows `rows` (int64 [BLOCK_N] into the stacked weight): the code words
    (int32 [BLOCK_N, BLOCK_K / 8], word j = inputs 8j..8j+7) and each word's block scale, as the
    dequantisation multiplies by it (one scale per 16 inputs = per 2 words)."""
    W: tl.constexpr = BLOCK_K // 8
    words = tl.load(w_ptr + rows[:, None] * KW + i * W + tl.arange(0, W)[None, :])
    offs_s = i * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    scale = tl.load(s_ptr + rows[:, None] * KS + offs_s[None, :]).to(tl.float32)
    if ASM:
        scale = (scale * (2.0**119)).to(tl.bfloat16)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, W // 2, 2]), [BLOCK_N, W])
    # The low nibbles, one place up, are what the dequantisation reads for them (shared by the
    # four byte positions of a word).
    return (words, words << 4), scale


@triton.jit
def _dequant_byte(words, scale, BYTE: tl.constexpr, ASM: tl.constexpr, INTERPRET: tl.constexpr):
    """Byte BYTE of every code word -> (inputs 8j + 2·BYTE, inputs 8j + 2·BYTE + 1), each
    [BLOCK_N, BLOCK_K / 8] in the MMA operand type (times 2^-7 on the inline-assembly path).
    `words` is the (words, words << 4) pair from _load_tile."""
    w, w4 = words
    if ASM:
        if BYTE == 0:
            asm: tl.constexpr = _ASM_BYTE0
        elif BYTE == 1:
            asm: tl.constexpr = _ASM_BYTE1
        elif BYTE == 2:
            asm: tl.constexpr = _ASM_BYTE2
        else:
            asm: tl.constexpr = _ASM_BYTE3
        lo, hi = tl.inline_asm_elementwise(
            asm, "=r,=r,r,r,r,r,r", [w, w4, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2
        )
    else:
        b = w >> (8 * BYTE)
        lo = mma_operand(_e2m1_value(b & 15) * scale, INTERPRET)
        hi = mma_operand(_e2m1_value((b >> 4) & 15) * scale, INTERPRET)
    return lo, hi


@triton.jit
def _cat_k(a, b):
    """[N, K1] and [N, K1] -> [N, 2·K1], a first along K. In the MMA operand layout the two halves
    keep their threads (K1 is a multiple of 16), so this only renames registers."""
    N: tl.constexpr = a.shape[0]
    K1: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (N, 2 * K1))


@triton.jit
def _dequant_block(words, scale, ASM: tl.constexpr, INTERPRET: tl.constexpr):
    """A whole K block as one MMA operand [BLOCK_N, BLOCK_K], in the activations' permuted order
    (input 8j + r at r·BLOCK_K/8 + j): the 8 byte/nibble tiles side by side along K. One MMA per
    K block instead of 8 keeps the MMAs asynchronous (each partial MMA on a register operand
    waited for its completion before the next)."""
    l0, h0 = _dequant_byte(words, scale, 0, ASM, INTERPRET)
    l1, h1 = _dequant_byte(words, scale, 1, ASM, INTERPRET)
    l2, h2 = _dequant_byte(words, scale, 2, ASM, INTERPRET)
    l3, h3 = _dequant_byte(words, scale, 3, ASM, INTERPRET)
    return _cat_k(_cat_k(_cat_k(l0, h0), _cat_k(l1, h1)), _cat_k(_cat_k(l2, h2), _cat_k(l3, h3)))


@triton.jit
def _load_tile_v3(
    w_ptr, s_ptr, rows, i,
    KW: tl.constexpr, KS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
    TILED: tl.constexpr = False,
):  # fmt: skip
    """K block i of re-laid-out rows (relayout_nvfp4): the code words (int32 [BLOCK_N, BLOCK_K / 8])
    and one scale per 16 inputs (= per 2 words, [BLOCK_N, BLOCK_K / 16]): on the inline-assembly
    path the bf16x2 bits of (scale * 2^119, scale * 2^119), one integer multiply-add from the
    re-encoded byte u (bf16 bits u * 16 + 0x7600); else the scale in float32.
    TILED: the weights are in tile_nvfp4's tiles of 16 rows x 256 inputs (BLOCK_K must be 256):
    block i of row r is word (r // 16 * tiles_per_row + i) * 512 + r % 16 * 32 + j."""
    W: tl.constexpr = BLOCK_K // 8
    if TILED:
        tl.static_assert(BLOCK_K == 256, "the tiled layout's tiles are 256 inputs wide")
        group = (rows // 16) * (KW // 32) + i  # the tile holding rows' block i
        within = rows % 16
        words = tl.load(w_ptr + (group * 512 + within * 32)[:, None] + tl.arange(0, W)[None, :])
        u = tl.load(s_ptr + (group * 256 + within * 16)[:, None] + tl.arange(0, BLOCK_K // 16)[None, :]).to(tl.int32)
    else:
        words = tl.load(w_ptr + rows[:, None] * KW + i * W + tl.arange(0, W)[None, :])
        offs_s = i * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        u = tl.load(s_ptr + rows[:, None] * KS + offs_s[None, :]).to(tl.int32)
    return words, _scale_bits(u, ASM)


@triton.jit
def _scale_bits(u, ASM: tl.constexpr):
    """Re-encoded scale bytes (int32) -> what the dequantisation multiplies by: the bf16x2 bits of
    (scale * 2^119, scale * 2^119) on the inline-assembly path, else the scale in float32."""
    if ASM:
        scale = u * 0x100010 + 0x76007600
    else:
        scale = ((u * 16 + 0x7600) << 16).to(tl.float32, bitcast=True) * (2.0**-119)
    return scale


@triton.jit
def _load_tile_tma(w_desc, s_desc, group, i, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """_load_tile_v3 of tiled weights through the tensor memory accelerator: K block i of the
    BLOCK_N rows from row group `group` (16 rows each) on, as bulk copies of whole tiles (the
    descriptors view the tiles as [groups, tiles per row, 16, 32] int32 words and [groups, tiles
    per row, 16, 16] scale bytes; see tile_descriptors). One thread issues each copy, so the
    pipeline's loads cost no per-element addresses or registers."""
    words = tl.reshape(w_desc.load([group, i, 0, 0]), (BLOCK_N, _TILE_WORDS))
    u = tl.reshape(s_desc.load([group, i, 0, 0]), (BLOCK_N, _TILE_SCALES)).to(tl.int32)
    return words, _scale_bits(u, ASM)


@triton.jit
def _rotr(u, R: tl.constexpr):
    """u (uint32) rotated right by R."""
    L: tl.constexpr = (32 - R) % 32
    return (u >> R) | (u << L) if R else u


@triton.jit
def _pair_portable(x, scale, RM: tl.constexpr, RS: tl.constexpr, INTERPRET: tl.constexpr):
    """The inline assembly's pair (input q, q + 8) of re-laid-out words x, by ordinary arithmetic."""
    u = x.to(tl.uint32, bitcast=True)
    mag = _rotr(u, RM)
    sgn = _rotr(u, RS)
    lo = (((mag >> 6) & 7) | ((sgn >> 12) & 8)).to(tl.int32)
    hi = (((mag >> 22) & 7) | ((sgn >> 28) & 8)).to(tl.int32)
    return mma_operand(_e2m1_value(lo) * scale, INTERPRET), mma_operand(_e2m1_value(hi) * scale, INTERPRET)


@triton.jit
def _pair_k(lo, hi):
    """[N, W/2] values of inputs (16j + q, 16j + q + 8) -> [N, W], element 2j and 2j + 1."""
    N: tl.constexpr = lo.shape[0]
    W2: tl.constexpr = lo.shape[1]
    return tl.reshape(tl.join(lo, hi), (N, 2 * W2))


@triton.jit
def _dequant_block_v3(words, scale, ASM: tl.constexpr, INTERPRET: tl.constexpr):
    """_dequant_block for re-laid-out words: the same operand, input 8j + r at r * BLOCK_K/8 + j.
    Tile r holds pairs q = r of word 2j (r < 4) or q = r - 4 of word 2j + 1, at elements 2j
    (input 16j + q) and 2j + 1 (input 16j + q + 8)."""
    N: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    a, b = tl.split(tl.reshape(words, (N, W // 2, 2)))
    if ASM:
        ty: tl.constexpr = (tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16)
        cons: tl.constexpr = "=h,=h,=h,=h,r,r,r"
        a0l, a0h, b0l, b0h = tl.inline_asm_elementwise(_ASM_PAIR0, cons, [a, b, scale], dtype=ty, is_pure=True, pack=1)
        a1l, a1h, b1l, b1h = tl.inline_asm_elementwise(_ASM_PAIR1, cons, [a, b, scale], dtype=ty, is_pure=True, pack=1)
        a2l, a2h, b2l, b2h = tl.inline_asm_elementwise(_ASM_PAIR2, cons, [a, b, scale], dtype=ty, is_pure=True, pack=1)
        a3l, a3h, b3l, b3h = tl.inline_asm_elementwise(_ASM_PAIR3, cons, [a, b, scale], dtype=ty, is_pure=True, pack=1)
    else:
        a0l, a0h = _pair_portable(a, scale, _R_MAG[0], _R_SIGN[0], INTERPRET)
        b0l, b0h = _pair_portable(b, scale, _R_MAG[0], _R_SIGN[0], INTERPRET)
        a1l, a1h = _pair_portable(a, scale, _R_MAG[1], _R_SIGN[1], INTERPRET)
        b1l, b1h = _pair_portable(b, scale, _R_MAG[1], _R_SIGN[1], INTERPRET)
        a2l, a2h = _pair_portable(a, scale, _R_MAG[2], _R_SIGN[2], INTERPRET)
        b2l, b2h = _pair_portable(b, scale, _R_MAG[2], _R_SIGN[2], INTERPRET)
        a3l, a3h = _pair_portable(a, scale, _R_MAG[3], _R_SIGN[3], INTERPRET)
        b3l, b3h = _pair_portable(b, scale, _R_MAG[3], _R_SIGN[3], INTERPRET)
    t0, t1, t2, t3 = _pair_k(a0l, a0h), _pair_k(a1l, a1h), _pair_k(a2l, a2h), _pair_k(a3l, a3h)
    t4, t5, t6, t7 = _pair_k(b0l, b0h), _pair_k(b1l, b1h), _pair_k(b2l, b2h), _pair_k(b3l, b3h)
    return _cat_k(_cat_k(_cat_k(t0, t1), _cat_k(t2, t3)), _cat_k(_cat_k(t4, t5), _cat_k(t6, t7)))
