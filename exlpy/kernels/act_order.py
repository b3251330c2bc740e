"""The input rows of a quantized decode GEMV: fp32, in the matrix's act order, zero-padded (exl2_gemv.py).

EXL2 (and act-order GPTQ) matrices store rows sorted by importance, so their matmul reads x[perm]. Gathering
x into that order in the kernel that produces x (the RMSNorm before q|k|v and gate|up) costs nothing extra,
where a separate gather costs a launch per matrix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.kernels import pdl

_BLOCK = 1024


@triton.jit
def _gather(x_ptr, w_ptr, perm_ptr, out_ptr, K, KP, xs, eps, HAS_PERM: tl.constexpr, NORM: tl.constexpr,
            BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[row, r] = x[row, perm[r]] (* w[perm[r]] * rsqrt(mean(x[row]²) + eps) with NORM) for r < K, 0 for
    K <= r < KP; x row `row` (program axis 1) at x_ptr + row * xs."""
    row = tl.program_id(1)
    x_ptr += row * xs
    out_ptr += row * KP
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < K
    if PDL:  # launched early (exlpy/kernels/pdl.py); x comes from the previous kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    src = tl.load(perm_ptr + r, mask=m, other=0) if HAS_PERM else r
    v = tl.load(x_ptr + src, mask=m, other=0.0).to(tl.float32)
    if NORM:
        # every program reduces the whole row itself (a few KB from L2): no second launch, no grid sync
        ss = tl.zeros((BLOCK,), tl.float32)
        for k0 in range(0, K, BLOCK):
            xk = tl.load(x_ptr + k0 + tl.arange(0, BLOCK), mask=k0 + tl.arange(0, BLOCK) < K, other=0.0)
            ss += xk.to(tl.float32) * xk.to(tl.float32)
        v = v * tl.load(w_ptr + src, mask=m, other=0.0).to(tl.float32) * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    tl.store(out_ptr + r, v, mask=r < KP)


def _launch(x: torch.Tensor, w: torch.Tensor | None, eps: float, perm: torch.Tensor | None, k: int,
            pad: int) -> torch.Tensor:
    m = x.numel() // k if k else 0
    if m < 1 or x.numel() != m * k:
        raise ValueError(f"act-order gather takes rows of {k} features, got shape {tuple(x.shape)}")
    x2 = x.reshape(m, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((k + pad,) if m == 1 else (m, k + pad), dtype=torch.float32, device=x.device)
    _gather[(triton.cdiv(k + pad, _BLOCK), m)](x2, w if w is not None else x2, perm if perm is not None else out,
                                                out, k, k + pad, x2.stride(0), eps, HAS_PERM=perm is not None,
                                                NORM=w is not None, BLOCK=_BLOCK, num_warps=4,
                                                PDL=pdl.enabled(x.device), **pdl.launch_options(x.device))
    return out


def act_order(x: torch.Tensor, perm: torch.Tensor | None, pad: int) -> torch.Tensor:
    """Same contract as `reference.act_order`."""
    return _launch(x, None, 0.0, perm, x.shape[-1], pad)


def rms_norm_act_order(x: torch.Tensor, weight: torch.Tensor, eps: float, perm: torch.Tensor | None,
                       pad: int) -> torch.Tensor:
    """Same contract as `reference.rms_norm_act_order`."""
    return _launch(x, weight, eps, perm, x.shape[-1], pad)
