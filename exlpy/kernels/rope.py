"""NEOX rotary embedding applied in place on Q and K, one program per (token, head).

Q and K may be strided views into one fused QKV projection output, so the rotation costs no copy.
`rope_store_kv` also writes the rotated K and the V rows into the KV cache from the same programs, which saves
the separate store kernel's launch at every decode step (about 2-3 us per layer inside a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.errors import ConfigError


@triton.jit
def _rotate(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, q_tok_stride, k_tok_stride, tab_stride, hq,
            HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Rotate this program's (token, head) row of q or k in place; returns the two rotated halves (in the
    row's dtype, so a cache gets exactly what apply_rope would leave) and the column offsets/mask."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    if head < hq:
        base = q_ptr + tok * q_tok_stride + head * (2 * HALF)
    else:
        base = k_ptr + tok * k_tok_stride + (head - hq) * (2 * HALF)
    x1 = tl.load(base + cols, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + cols, mask=mask, other=0.0)
    tab = pos * tab_stride
    c1 = tl.load(cos_ptr + tab + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + tab + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + tab + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + tab + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    r1 = (x1f * c1 - x2f * s1).to(x1.dtype)
    r2 = (x2f * c2 + x1f * s2).to(x1.dtype)
    tl.store(base + cols, r1, mask=mask)
    tl.store(base + HALF + cols, r2, mask=mask)
    return r1, r2, cols, mask


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, q_tok_stride, k_tok_stride, tab_stride, hq,
                 HALF: tl.constexpr, BLOCK: tl.constexpr):
    _rotate(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, q_tok_stride, k_tok_stride, tab_stride, hq, HALF, BLOCK)


def _tokens_view(t: torch.Tensor) -> torch.Tensor:
    """[B,T,H,D] -> [B*T,H,D] without copying when the head rows are dense (the fused-QKV case)."""
    B, T, H, D = t.shape
    if t.stride(-1) == 1 and t.stride(-2) == D and (B == 1 or t.stride(0) == T * t.stride(1)):
        return t.as_strided((B * T, H, D), (t.stride(1), D, 1))
    raise ValueError("not a token-major view")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.apply_rope`, but rotates q and k in place and returns them."""
    B, T, hq, D = q.shape
    hk = k.shape[2]
    try:
        q3, k3 = _tokens_view(q), _tokens_view(k)
    except ValueError:
        q, k = q.contiguous(), k.contiguous()
        q3, k3 = _tokens_view(q), _tokens_view(k)
    pos = positions.reshape(-1)
    if not pos.is_contiguous():
        pos = pos.contiguous()
    assert cos.stride(-1) == 1 and sin.stride(0) == cos.stride(0)
    if B * T > 0:
        half = D // 2
        _rope_kernel[(B * T, hq + hk)](q3, k3, cos, sin, pos, q3.stride(0), k3.stride(0), cos.stride(0), hq,
                                       HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return q, k


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, q_tok_stride,
                       k_tok_stride, v_tok_stride, tab_stride, hq, hk, HALF: tl.constexpr, BLOCK: tl.constexpr):
    r1, r2, cols, mask = _rotate(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, q_tok_stride, k_tok_stride, tab_stride,
                                 hq, HALF, BLOCK)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head >= hq:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:  # negative slots are padding rows of a batch bucket: they write nowhere
            h = head - hq
            dst = (slot * hk + h) * (2 * HALF)
            tl.store(kc_ptr + dst + cols, r1.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(kc_ptr + dst + HALF + cols, r2.to(kc_ptr.dtype.element_ty), mask=mask)
            vbase = v_ptr + tok * v_tok_stride + h * (2 * HALF)
            v1 = tl.load(vbase + cols, mask=mask, other=0.0)
            v2 = tl.load(vbase + HALF + cols, mask=mask, other=0.0)
            tl.store(vc_ptr + dst + cols, v1.to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc_ptr + dst + HALF + cols, v2.to(vc_ptr.dtype.element_ty), mask=mask)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.rope_store_kv`: rotates q and k in place, writes rotated k and v into the
    caches at `slots` (negative slots skipped) and returns (q, k). One launch for all of it."""
    B, T, hq, D = q.shape
    hk = k.shape[2]
    check_rope_store_shapes(q, k, v, k_cache, v_cache, slots)
    try:
        q3, k3, v3 = _tokens_view(q), _tokens_view(k), _tokens_view(v)
    except ValueError:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        q3, k3, v3 = _tokens_view(q), _tokens_view(k), _tokens_view(v)
    pos = positions.reshape(-1)
    if not pos.is_contiguous():
        pos = pos.contiguous()
    s = slots.reshape(-1)
    if not s.is_contiguous():
        s = s.contiguous()
    assert cos.stride(-1) == 1 and sin.stride(0) == cos.stride(0)
    if B * T > 0:
        half = D // 2
        _rope_store_kernel[(B * T, hq + hk)](q3, k3, v3, cos, sin, pos, s, k_cache, v_cache, q3.stride(0),
                                             k3.stride(0), v3.stride(0), cos.stride(0), hq, hk, HALF=half,
                                             BLOCK=triton.next_power_of_2(half), num_warps=1)
    return q, k


def check_rope_store_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Typed errors for the shape mismatches the fused kernel would otherwise turn into stray writes."""
    B, T, _, D = q.shape
    hk = k.shape[2]
    if k.shape != (B, T, hk, D) or v.shape != k.shape:
        raise ConfigError(f"rope_store_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, T, Hkv, D] "
                          f"matching q {tuple(q.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(c.shape[-2:]) != (hk, D) or not c.is_contiguous():
            raise ConfigError(f"rope_store_kv: {name} {tuple(c.shape)} must be contiguous [..., {hk}, {D}]")
    if slots.numel() != B * T:
        raise ConfigError(f"rope_store_kv: slots {tuple(slots.shape)} must hold one slot per token ({B}x{T})")
