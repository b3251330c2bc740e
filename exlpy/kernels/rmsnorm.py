"""RMSNorm over the last dimension, one program per row; fp32 statistics like the torch reference."""

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
    # Round to the input dtype before the weight multiply, as the reference (and transformers) does.
    y = (xf * inv).to(x.dtype) * w
    tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `reference.rms_norm`; rows may be strided (views of a fused projection)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.result_type(x, weight), device=x.device)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        warps = 4 if block <= 2048 else 8
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), n, eps, BLOCK=block,
                                          num_warps=warps)
    return y.view(x.shape)
