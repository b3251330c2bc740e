"""The packed-word half of the tensor-core EXL2/GPTQ kernel (exl2_tc.py): a K step's packed words and its group's
scales loaded (`_words`, `_scale`), and the words turned into the dot's weight operand in registers (`_tile`).

A code becomes the exact integer q - z, which fp16 holds exactly, so the dot multiplies exact codes by fp16 x; the
group's scale is applied once per step to the partial product, or folded into the codes (FOLD). In fp32 that is
two instructions a code (`_deq`: the field OR-ed into the mantissa of 2^23, then one FMA by constants); on a GPU
4-bit and 8-bit codes are decoded two at a time in f16x2 by inline PTX (`_pair4`: LOP3 into the fp16 pattern of
1024; `_pair8`: a PRMT first), and exl2_qmm's `_opaque` keeps Triton from re-laying out the joined tile before the dot.
"""

from __future__ import annotations

import triton
import triton.language as tl

from exlpy.kernels.exl2_qmm import _opaque, _pairs  # the same join tree and operand move as exl2_qmm's


@triton.jit
def _deq(t, magic, oo: tl.constexpr, BITS: tl.constexpr, Z: tl.constexpr):
    """q - Z (exact, fp32) for the BITS-wide field of uint32 t at bit oo (oo + BITS <= 23): the field OR-ed into
    the mantissa of 2^23 (`magic` a run-time 0x4B000000, so AND-OR is one LOP3), then one FMA by constants."""
    f = ((t & (((1 << BITS) - 1) << oo)) | magic).to(tl.float32, bitcast=True)
    return f * (1.0 / (1 << oo)) - ((1 << (23 - oo)) + Z)


# f16x2 decode of two 4-bit codes 16 bits apart (fields at bits SH and SH + 16 of word $2): both moved to bits 0
# and 16, OR-ed into the fp16 pattern of 1024 (0x6400) in each half by one LOP3 (lut 0xEA: a & b | c), and 1024 + Z
# (register $3) subtracted from both halves at once: 1.5 instructions per code against 2.5 in fp32.
_PAIR_TAIL = "lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; sub.f16x2 t, t, $3; mov.b32 {$0, $1}, t; }"
_PAIR4_0 = tl.constexpr("{ .reg .b32 t; mov.b32 t, $2; " + _PAIR_TAIL)
_PAIR4_4 = tl.constexpr("{ .reg .b32 t; shr.b32 t, $2, 4; " + _PAIR_TAIL)
_PAIR4_8 = tl.constexpr("{ .reg .b32 t; shr.b32 t, $2, 8; " + _PAIR_TAIL)
_PAIR4_12 = tl.constexpr("{ .reg .b32 t; shr.b32 t, $2, 12; " + _PAIR_TAIL)


@triton.jit
def _pair4(w, Z: tl.constexpr, SH: tl.constexpr, H: tl.constexpr):
    """Half H (0: the field at bit SH, 1: at SH + 16) of word w's 4-bit code pair, q - Z as fp16 (inline PTX)."""
    zz = tl.full(w.shape, (0x6400 + Z) * 0x10001, tl.uint32)
    if SH == 0:
        pair = tl.inline_asm_elementwise(_PAIR4_0, "=h,=h,r,r", [w, zz], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=1)
    elif SH == 4:
        pair = tl.inline_asm_elementwise(_PAIR4_4, "=h,=h,r,r", [w, zz], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=1)
    elif SH == 8:
        pair = tl.inline_asm_elementwise(_PAIR4_8, "=h,=h,r,r", [w, zz], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=1)
    else:
        pair = tl.inline_asm_elementwise(_PAIR4_12, "=h,=h,r,r", [w, zz], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=1)
    return pair[H]


# 8-bit: byte B of two consecutive words (codes 4 apart) moved to bits 0 and 16 by one PRMT (selector: byte B of
# $2 into bytes 0-1, byte B of $3 into bytes 2-3; the upper copies are masked off), then as above with 0x00FF00FF.
_PAIR8_TAIL = "lop3.b32 t, t, 0x00FF00FF, 0x64006400, 0xEA; sub.f16x2 t, t, $4; mov.b32 {$0, $1}, t; }"
_PAIR8_0 = tl.constexpr("{ .reg .b32 t; prmt.b32 t, $2, $3, 0x4400; " + _PAIR8_TAIL)
_PAIR8_1 = tl.constexpr("{ .reg .b32 t; prmt.b32 t, $2, $3, 0x5511; " + _PAIR8_TAIL)
_PAIR8_2 = tl.constexpr("{ .reg .b32 t; prmt.b32 t, $2, $3, 0x6622; " + _PAIR8_TAIL)
_PAIR8_3 = tl.constexpr("{ .reg .b32 t; prmt.b32 t, $2, $3, 0x7733; " + _PAIR8_TAIL)


@triton.jit
def _pair8(wa, wb, Z: tl.constexpr, B: tl.constexpr, H: tl.constexpr):
    """Half H of the 8-bit code pair (byte B of wa, byte B of wb), q - Z as fp16 (inline PTX)."""
    zz = tl.full(wa.shape, (0x6400 + Z) * 0x10001, tl.uint32)
    if B == 0:
        pair = tl.inline_asm_elementwise(_PAIR8_0, "=h,=h,r,r,r", [wa, wb, zz], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=1)
    elif B == 1:
        pair = tl.inline_asm_elementwise(_PAIR8_1, "=h,=h,r,r,r", [wa, wb, zz], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=1)
    elif B == 2:
        pair = tl.inline_asm_elementwise(_PAIR8_2, "=h,=h,r,r,r", [wa, wb, zz], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=1)
    else:
        pair = tl.inline_asm_elementwise(_PAIR8_3, "=h,=h,r,r,r", [wa, wb, zz], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=1)
    return pair[H]


@triton.jit
def _code(ws, magic, s, z, j: tl.constexpr, BITS: tl.constexpr, Z: tl.constexpr, FOLD: tl.constexpr,
          GPTQ: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr):
    """The code at the tile's block position bitrev5(j), of every block in the step, as fp16 [KB, BLOCK_N]: q - Z,
    or with FOLD the weight itself, (q - z) s. The join tree in _tile puts what is made for j at position
    bitrev5(j), so feeding code bitrev5(j) gives natural K order (x then needs only the act-order gather). HALF:
    positions 2 q and 2 q + 1 hold the codes 16 bits apart in one 4-bit word, 8 (q // 4) + q % 4 and that + 4
    (exl2_tc_plan.half_order: x is gathered in that order), which 4- and 8-bit codes decode in pairs (_pair4,
    _pair8: compiled GPUs only); other widths and the interpreter decode the same order one code at a time."""
    p: tl.constexpr = ((j & 1) << 4) | ((j & 2) << 2) | (j & 4) | ((j & 8) >> 2) | ((j & 16) >> 4)
    if HALF:
        i: tl.constexpr = 8 * (p // 8) + (p // 2) % 4 + 4 * (p % 2)
    else:
        i: tl.constexpr = p
    if HALF and ASM and BITS == 4 and not FOLD:
        return _pair4(ws[i // 8], Z, (i % 4) * 4, (i % 8) // 4)
    if HALF and ASM and BITS == 8 and not FOLD:  # the pair (i, i + 4) sits in words 2 (i // 8) and the next
        return _pair8(ws[2 * (i // 8)], ws[2 * (i // 8) + 1], Z, i % 4, (i % 8) // 4)
    wi: tl.constexpr = (i * BITS) // 32
    off: tl.constexpr = (i * BITS) % 32
    if off + BITS > 32:  # straddles into the next word: funnel the two
        d = _deq((ws[wi] >> off) | (ws[wi + 1] << (32 - off)), magic, 0, BITS, Z)
    elif off + BITS <= 23:
        d = _deq(ws[wi], magic, off, BITS, Z)
    else:  # fields reaching past bit 22 come from the upper half word
        d = _deq(ws[wi] >> 16, magic, off - 16, BITS, Z)
    if FOLD:
        if GPTQ:
            d = (d - z[None, :]) * s[None, :]
        else:
            d = d * s[None, :]
    return d.to(tl.float16)


@triton.jit
def _tile(ws, magic, s, z, BITS: tl.constexpr, Z: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr,
          SWAP: tl.constexpr, FOLD: tl.constexpr, GPTQ: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr):
    """The step's codes (FOLD: weights) as the dot's weight operand: [BLOCK_N, 32 KB] (SWAP) or [32 KB, BLOCK_N],
    K in order."""
    cs = ()
    for j in tl.static_range(32):
        cs = cs + (_code(ws, magic, s, z, j, BITS, Z, FOLD, GPTQ, HALF, ASM),)
    t = tl.reshape(_pairs(_pairs(_pairs(_pairs(_pairs(cs, 32), 16), 8), 4), 2)[0], (KB, BLOCK_N, 32))
    if SWAP:
        w = tl.reshape(tl.permute(t, (1, 0, 2)), (BLOCK_N, KB * 32))
    else:
        w = tl.reshape(tl.permute(t, (0, 2, 1)), (KB * 32, BLOCK_N))
    return _opaque(w, ASM)


@triton.jit
def _words(qw, s_qw, w_end, rb, r1, offs_b, offs_n, ld_mask, BITS: tl.constexpr):
    """The packed words of the K step starting at relative row rb: BITS tiles [KB, BLOCK_N] (word j of each
    block); blocks at or past r1 and words past the segment's end read as 0."""
    blk = rb // 32 + offs_b
    live = (blk * 32 < r1).to(tl.int32)
    ws = ()
    for j in tl.static_range(BITS):
        row = blk * BITS + j
        # (int & int) != 0, not bool & bool: the CPU interpreter mis-types a broadcast bool &
        m = ((live & (row < w_end).to(tl.int32))[:, None] & ld_mask.to(tl.int32)[None, :]) != 0
        ws = ws + (tl.load(qw + row[:, None] * s_qw + offs_n[None, :], mask=m, other=0).to(tl.uint32, bitcast=True),)
    return ws


@triton.jit
def _scale(sc, s_sc, aux, s_aux, g, offs_n, ld_mask, GPTQ: tl.constexpr):
    """Group g's per-column scale [BLOCK_N] fp32 and (GPTQ) zero point."""
    if GPTQ:
        s = tl.load(sc + g * s_sc + offs_n, mask=ld_mask, other=0.0).to(tl.float32)
        z = tl.load(aux + g * s_aux + offs_n, mask=ld_mask, other=0.0).to(tl.float32)
    else:
        w = tl.load(sc + g * s_sc + offs_n // 8, mask=ld_mask, other=0)
        c1 = (((w >> ((offs_n % 8) * 4)) & 15) + 1).to(tl.float32)
        s = c1 * c1 * tl.load(aux + g)
        z = s
    return s, z
