"""Quantize new K/V rows straight into a quantized cache (exlpy.cache.qcodec's format), one program per token.

The decode step of a quantized cache then needs no fp16 working copy and no host-side row selection, so it
can be captured in a CUDA graph: rows come from device `slots` (negative = padding, skipped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.errors import ConfigError
from exlpy.kernels.kv_tiles import FP8, fmt_code, hadamard_blocks, next_pow2


@triton.jit
def _round_half_even(x):
    """torch.round's rounding (ties to even) in fp32, the same on the GPU and in the interpreter."""
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _quant_row(x_ptr, tok_off, slot, c_ptr, s_ptr, c_row_stride, s_row_stride, NG: tl.constexpr,
               BLOCK_G: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr):
    """Quantize one token's [NG * 32] vector into cache row `slot`."""
    gi = tl.arange(0, BLOCK_G)
    j = tl.arange(0, 32)
    g_ok = gi < NG
    x = tl.load(x_ptr + tok_off + gi[:, None] * 32 + j[None, :], mask=g_ok[:, None], other=0.0)
    if FMT == 2:  # FP8: the upper byte of the fp16 value
        code = (x.to(tl.float16).to(tl.int16, bitcast=True) >> 8).to(tl.uint8)
        tl.store(c_ptr + slot * c_row_stride + gi[:, None] * 32 + j[None, :], code, mask=g_ok[:, None])
    else:
        HALF: tl.constexpr = 1 << (BITS - 1)
        g = tl.dot(x.to(tl.float32), hadamard_blocks(32), input_precision="ieee")  # [BLOCK_G, 32] rotated
        absmax = tl.maximum(tl.max(tl.abs(g), axis=1), 1e-8)
        scale = absmax / HALF
        q = _round_half_even(tl.math.div_rn(g, scale[:, None])) + HALF
        q = tl.minimum(tl.maximum(q, 0.0), 2 * HALF - 1).to(tl.uint8)
        if BITS == 4:  # element 2i in the low nibble of byte i, 2i + 1 in the high one
            lo, hi = tl.split(tl.reshape(q, [BLOCK_G, 16, 2]))
            jj = tl.arange(0, 16)
            tl.store(c_ptr + slot * c_row_stride + gi[:, None] * 16 + jj[None, :], lo | (hi << 4),
                     mask=g_ok[:, None])
        else:
            tl.store(c_ptr + slot * c_row_stride + gi[:, None] * 32 + j[None, :], q, mask=g_ok[:, None])
        tl.store(s_ptr + slot * s_row_stride + gi, scale.to(tl.float16), mask=g_ok)


@triton.jit
def _quant_store_kernel(k_ptr, v_ptr, slot_ptr, kc_ptr, ks_ptr, vc_ptr, vs_ptr, k_tok_stride, v_tok_stride,
                        kc_row_stride, ks_row_stride, vc_row_stride, vs_row_stride, NG: tl.constexpr,
                        BLOCK_G: tl.constexpr, K_FMT: tl.constexpr, K_BITS: tl.constexpr, V_FMT: tl.constexpr,
                        V_BITS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        if tl.program_id(1) == 0:
            _quant_row(k_ptr, tok * k_tok_stride, slot, kc_ptr, ks_ptr, kc_row_stride, ks_row_stride, NG, BLOCK_G,
                       K_FMT, K_BITS)
        else:
            _quant_row(v_ptr, tok * v_tok_stride, slot, vc_ptr, vs_ptr, vc_row_stride, vs_row_stride, NG, BLOCK_G,
                       V_FMT, V_BITS)


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """[B,T,H,D] -> [B*T, H*D] view (a copy only when heads are not densely packed)."""
    B, T, H, D = t.shape
    if t.stride(-1) == 1 and t.stride(-2) == D and (B == 1 or t.stride(0) == T * t.stride(1)):
        return t.as_strided((B * T, H * D), (t.stride(1), 1))
    return t.reshape(B * T, H * D).contiguous()


def store_kv_quant(k_codes: torch.Tensor, k_scales: torch.Tensor | None, v_codes: torch.Tensor,
                   v_scales: torch.Tensor | None, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_bits: int, v_bits: int) -> None:
    """Same contract as `reference.store_kv_quant`; codes and scales must be contiguous."""
    k2, v2 = _token_rows(k), _token_rows(v)
    n, e = k2.shape
    if n == 0:
        return
    if e % 32:
        raise ConfigError(f"quantized caches need Hkv*D to be a multiple of 32, got {e}")
    kf, kb = fmt_code(k_scales, k_bits)
    vf, vb = fmt_code(v_scales, v_bits)
    for t in (k_codes, v_codes, k_scales, v_scales):
        if t is not None and not t.is_contiguous():
            raise ConfigError("store_kv_quant needs contiguous cache codes and scales")
    s = slots.reshape(-1)
    if not s.is_contiguous():
        s = s.contiguous()
    ks = k_scales if k_scales is not None else k_codes
    vs = v_scales if v_scales is not None else v_codes
    _quant_store_kernel[(n, 2)](
        k2, v2, s, k_codes, ks, v_codes, vs, k2.stride(0), v2.stride(0), k_codes.shape[-1],
        ks.shape[-1] if k_scales is not None else 0, v_codes.shape[-1], vs.shape[-1] if v_scales is not None else 0,
        NG=e // 32, BLOCK_G=max(16, next_pow2(e // 32)), K_FMT=kf, K_BITS=kb, V_FMT=vf, V_BITS=vb, num_warps=4)


__all__ = ["FP8", "store_kv_quant"]
