"""NEOX rotary embedding applied in place on Q and K, one program per (token, head).

Q and K may be strided views into one fused QKV projection output, so the rotation costs no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, q_tok_stride, k_tok_stride, tab_stride, hq,
                 HALF: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(base + cols, (x1f * c1 - x2f * s1).to(x1.dtype), mask=mask)
    tl.store(base + HALF + cols, (x2f * c2 + x1f * s2).to(x1.dtype), mask=mask)


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
