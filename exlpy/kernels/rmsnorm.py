"""RMSNorm over the last dimension, one program per row; fp32 statistics like the torch reference. Also the
post-norm residual add of Gemma 2 / GLM-4 blocks (x += rms_norm(y)) in one pass, and a sum followed by its norm
(x += r; rms_norm(x)): the end of the two-GPU copy all-reduce with the next block's norm (parallel/tp_copy.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, x_stride, y_stride, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # Round to the weight's dtype before the weight multiply, as the reference (and transformers) does.
    y = (xf * inv).to(w.dtype) * w
    tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `reference.rms_norm`; rows may be strided (views of a fused projection)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=weight.dtype, device=x.device)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        warps = 4 if block <= 2048 else 8
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), n, eps, BLOCK=block,
                                          num_warps=warps)
    return y.view(x.shape)


@triton.jit
def _rms_norm_add_kernel(x_ptr, y_ptr, w_ptr, x_stride, y_stride, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0)
    yf = y.to(tl.float32)
    inv = tl.rsqrt(tl.sum(yf * yf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    normed = ((yf * inv).to(y.dtype) * w).to(tl.float32)  # rounded as rms_norm's output would be
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    tl.store(x_ptr + row * x_stride + cols, (x.to(tl.float32) + normed).to(x_ptr.dtype.element_ty), mask=mask)


def rms_norm_add(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `reference.rms_norm_add`: x + rms_norm(y), written into x (the residual) and returned."""
    n = x.shape[-1]
    if not x.is_contiguous() or y.dtype != weight.dtype:
        from exlpy.kernels import reference

        return reference.rms_norm_add(x, y, weight, eps)
    x2, y2 = x.view(-1, n), y.reshape(-1, n)
    if y2.stride(-1) != 1:
        y2 = y2.contiguous()
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _rms_norm_add_kernel[(x2.shape[0],)](x2, y2, weight, x2.stride(0), y2.stride(0), n, eps, BLOCK=block,
                                              num_warps=4 if block <= 2048 else 8)
    return x


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, x_stride, r_stride, y_stride, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0)
    s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual as x.add_(r) rounds it
    tl.store(x_ptr + row * x_stride + cols, s, mask=mask)
    sf = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(sf * sf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (sf * inv).to(w.dtype) * w
    tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `reference.add_rms_norm`: x += r (in place), returns rms_norm(x): one read of each input
    instead of an add's two and the norm's one."""
    n = x.shape[-1]
    if not x.is_contiguous() or r.shape != x.shape or r.dtype != x.dtype:
        from exlpy.kernels import reference

        return reference.add_rms_norm(x, r, weight, eps)
    x2, r2 = x.view(-1, n), r.reshape(-1, n)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    y = torch.empty(x2.shape, dtype=weight.dtype, device=x.device)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, x2.stride(0), r2.stride(0), y.stride(0), n, eps,
                                              BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return y.view(x.shape)
