"""Write new K/V rows into a cache addressed by flat slots; negative slots (padding rows) are skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_tok_stride, v_tok_stride, row_size,
                     BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < row_size
        k = tl.load(k_ptr + tok * k_tok_stride + cols, mask=mask)
        v = tl.load(v_ptr + tok * v_tok_stride + cols, mask=mask)
        tl.store(kc_ptr + slot * row_size + cols, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + slot * row_size + cols, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """[B,T,H,D] -> [B*T, H*D] view (a copy only when heads are not densely packed)."""
    B, T, H, D = t.shape
    if t.stride(-1) == 1 and t.stride(-2) == D and (B == 1 or t.stride(0) == T * t.stride(1)):
        return t.as_strided((B * T, H * D), (t.stride(1), 1))
    return t.reshape(B * T, H * D).contiguous()


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Same contract as `reference.store_kv`; caches must be contiguous."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    k2, v2 = _token_rows(k), _token_rows(v)
    s = slots.reshape(-1)
    if not s.is_contiguous():
        s = s.contiguous()
    n = k2.shape[0]
    row_size = k2.shape[1]
    if n > 0:
        block = min(1024, triton.next_power_of_2(row_size))
        _store_kv_kernel[(n, triton.cdiv(row_size, block))](k2, v2, k_cache, v_cache, s, k2.stride(0),
                                                            v2.stride(0), row_size, BLOCK=block, num_warps=4)
