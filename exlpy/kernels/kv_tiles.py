"""Triton helpers shared by the attention kernels and the quantized K/V store: cache formats, tile loads.

A K or V cache is one of three formats, chosen per tensor by a constexpr code:
- PLAIN: the model's dtype (fp16/bf16/fp32), rows of [Hkv, D];
- INT: exlpy.cache.qcodec codes: each group of 32 consecutive elements of a token's [Hkv*D] vector rotated by
  the orthonormal 32-point Hadamard matrix H, then stored as absmax integer codes (4 bits, two per byte, low
  nibble first; or 8 bits) with one fp16 scale per group;
- FP8: exllamav2's 8-bit cache, the upper byte of each fp16 value (E5M2 by truncation), no scales.

INT keys are never un-rotated element by element. H is symmetric and orthogonal, so for a key k = g·H (g the
dequantized rotated group) q·k = (q·H)·g: the kernels rotate q once per program and take dot products with g
directly; likewise sum_t p_t v_t = (sum_t p_t g_t)·H, one rotation of the output tile at the end.
"""

from __future__ import annotations

import triton
import triton.language as tl

from exlpy.errors import ConfigError

PLAIN = 0
INT = 1
FP8 = 2
GROUP = 32  # elements per quantization group (qcodec.GROUP)


@triton.jit
def hadamard_blocks(BLOCK_D: tl.constexpr):
    """[BLOCK_D, BLOCK_D] fp32 block-diagonal matrix of orthonormal 32x32 Sylvester-Hadamard blocks.

    Sylvester's H[i, j] = (-1)^popcount(i & j) / sqrt(32), the matrix qcodec builds by doubling.
    """
    i = tl.arange(0, BLOCK_D)[:, None]
    j = tl.arange(0, BLOCK_D)[None, :]
    x = i & j & 31
    parity = (x ^ (x >> 1) ^ (x >> 2) ^ (x >> 3) ^ (x >> 4)) & 1
    sign = tl.where(parity == 0, 0.17677669529663687, -0.17677669529663687)  # 1/sqrt(32)
    return tl.where((i // 32) == (j // 32), sign, 0.0)


@triton.jit
def hadamard32_signs():
    """The 32x32 Sylvester-Hadamard matrix unnormalized (entries +-1, exact in fp16), as fp16."""
    i = tl.arange(0, 32)[:, None]
    j = tl.arange(0, 32)[None, :]
    x = i & j
    parity = (x ^ (x >> 1) ^ (x >> 2) ^ (x >> 3) ^ (x >> 4)) & 1
    return tl.where(parity == 0, 1.0, -1.0).to(tl.float16)


@triton.jit
def rotate_rows(x, M: tl.constexpr, D: tl.constexpr):
    """x [M, D] fp32 times the block-diagonal orthonormal Hadamard matrix (every 32 columns rotated alone).

    Each row is cut into its D/32 groups, and the [M*D/32, 32] x [32, 32] product runs on the tensor cores:
    x is split into an fp16 high part and an fp16 remainder (together ~22 significant bits) against the exact
    +-1 matrix with fp32 accumulation, then scaled by 1/sqrt(32): fp32-grade accuracy for two tiny MMAs,
    where one fp32 FMA product of the whole [D, D] block-diagonal matrix would cost more than a decode
    program's share of the K/V read.
    """
    xr = tl.reshape(x, [M * D // 32, 32])
    h = hadamard32_signs()
    hi = xr.to(tl.float16)
    lo = (xr - hi.to(tl.float32)).to(tl.float16)
    y = tl.dot(hi, h, out_dtype=tl.float32)
    y = tl.dot(lo, h, y, out_dtype=tl.float32)
    return tl.reshape(y * 0.17677669529663687, [M, D])


@triton.jit
def load_kv_tile(c_ptr, s_ptr, base, rows, kvh, n_ok, row_stride, srow_stride,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr,
                 BITS: tl.constexpr, MASKED: tl.constexpr):
    """The [BLOCK_N, BLOCK_D] tile of KV head `kvh` at cache rows `base + rows`, ready for tl.dot.

    `base` is a scalar and `rows` a vector: when a block lies inside one page, rows is the loop-invariant
    arange and only the scalar changes per block, so the tile's offsets are computed once, outside the loop.

    PLAIN tiles keep the cache dtype; INT and FP8 tiles come out as fp16 (INT ones still rotated, see the
    module docstring). `n_ok` masks rows when MASKED (boundary blocks); interior blocks load unmasked.
    `row_stride` / `srow_stride`: elements (bytes for codes) per cache row of values / scales.
    """
    if FMT == 0:
        d = tl.arange(0, BLOCK_D)
        off = base * row_stride + (rows[:, None] * row_stride + kvh * D + d[None, :])
        if MASKED or BLOCK_D != D:
            tile = tl.load(c_ptr + off, mask=n_ok[:, None] & (d < D)[None, :], other=0.0)
        else:
            tile = tl.load(c_ptr + off)
    elif FMT == 1:
        NG: tl.constexpr = D // 32  # groups per head (D is a power of two >= 32 here, so BLOCK_D == D)
        GB: tl.constexpr = 32 * BITS // 8  # code bytes per group
        HALF: tl.constexpr = 1 << (BITS - 1)
        gi = tl.arange(0, NG)
        j = tl.arange(0, GB)
        c_off = base * row_stride + (rows[:, None, None] * row_stride + (kvh * NG + gi)[None, :, None] * GB
                                     + j[None, None, :])
        s_off = base * srow_stride + (rows[:, None] * srow_stride + kvh * NG + gi[None, :])
        if MASKED:
            codes = tl.load(c_ptr + c_off, mask=n_ok[:, None, None], other=0)
            scales = tl.load(s_ptr + s_off, mask=n_ok[:, None], other=0.0)
        else:
            codes = tl.load(c_ptr + c_off)
            scales = tl.load(s_ptr + s_off)
        if BITS == 4:
            codes = tl.interleave(codes & 15, codes >> 4)  # element 2i is the low nibble of byte i
        vals = (codes.to(tl.float32) - HALF) * scales.to(tl.float32)[:, :, None]
        tile = tl.reshape(vals, [BLOCK_N, D]).to(tl.float16)
    else:
        d = tl.arange(0, BLOCK_D)
        off = base * row_stride + (rows[:, None] * row_stride + kvh * D + d[None, :])
        if MASKED or BLOCK_D != D:
            codes = tl.load(c_ptr + off, mask=n_ok[:, None] & (d < D)[None, :], other=0)
        else:
            codes = tl.load(c_ptr + off)
        tile = (codes.to(tl.int16) << 8).to(tl.float16, bitcast=True)
    return tile


def fmt_code(scales: object, bits: int) -> tuple[int, int]:
    """(format, bits) constexprs for a quantized cache tensor: scales None is the FP8 cache."""
    if scales is None:
        return FP8, 8
    if bits not in (4, 8):
        raise ConfigError(f"quantized K/V caches hold 4- or 8-bit codes, got {bits} bits")
    return INT, bits


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))
