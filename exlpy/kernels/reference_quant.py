"""Pure-torch references of the quantized-weight ops: rows in a matrix's act order, the packed EXL2 / GPTQ matmul
(exact dequantized weights, fp32 math) and the converter's GPTQ block (exlpy/kernels/gptq_block.py's twin).
Re-exported by exlpy/kernels/reference.py, the one namespace the dispatch layer and tests use."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def act_order(x: torch.Tensor, perm: torch.Tensor | None, pad: int) -> torch.Tensor:
    """Rows x [..., K] as fp32 in a quantized matrix's act order (x[..., perm]), zero past K: [K + pad] for one
    row, [m, K + pad] for m rows."""
    v = x.reshape(-1, x.shape[-1]).float()
    v = F.pad(v[:, perm.long()] if perm is not None else v, (0, pad))
    return v[0] if v.shape[0] == 1 else v


def rms_norm_act_order(x: torch.Tensor, weight: torch.Tensor, eps: float, perm: torch.Tensor | None,
                       pad: int) -> torch.Tensor:
    """act_order(rms_norm(x)) kept in fp32 (no rounding of the normalized rows to x's dtype)."""
    xf = x.reshape(-1, x.shape[-1]).float()
    return act_order(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float(), perm, pad)


def quant_matmul(x: torch.Tensor, parts: list, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0) -> torch.Tensor:
    """x [..., K] @ [W_0 | W_1 | ...] (+ bias [N total]) for packed matrices `parts` (exlpy.quant.layout.QuantMatrix,
    one K and act order), x first rms_norm'd with norm_weight when given: [..., N total] in x's dtype, or that
    added into `residual` (same shape) in place and returned. fp32 math on the exact dequantized weights."""
    from exlpy.quant.exl2_ref import dequant_dense

    h = x.float()
    if norm_weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    w = torch.cat([dequant_dense(p).to(x.device) for p in parts], dim=1)
    y = h @ w
    if bias is not None:
        y = y + bias.float()
    if residual is None:
        return y.to(x.dtype)
    return residual.copy_((residual.float() + y).to(residual.dtype))


def gptq_block(w: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor,
               codes: torch.Tensor, err: torch.Tensor, rtn: bool = False) -> None:
    """One block of GPTQ rows of O items at once, in place (the converter's inner loop, exlpy/convert/gptq.py).

    w [O, R, N] fp32: the block's rows in act order, already corrected for every earlier block; on return each
    row holds its dequantized values. u [R, R]: the block's square of the upper Cholesky factor of H^-1.
    scale [O, N], zero and maxq [O, 1] fp32: each item's current group. codes [O, R, N] uint8 and err [O, R, N]
    fp32 are written: the stored codes, and each row's scaled error (w - dq) / u[r, r] that the caller feeds to
    the rows after the block. Inside the block the error of each row goes to the rows below it. rtn: no error
    feedback (round to nearest; err is not written)."""
    r_rows = w.shape[1]
    for j in range(r_rows):
        x = w[:, j]
        q = torch.clamp(torch.round(x / scale) + zero, min=torch.zeros_like(zero), max=maxq)
        dq = (q - zero) * scale
        codes[:, j] = q.to(torch.uint8)
        if rtn:
            w[:, j] = dq
            continue
        e = (x - dq) / u[j, j]
        err[:, j] = e
        if j + 1 < r_rows:
            w[:, j + 1:] -= u[j, j + 1:].view(1, -1, 1) * e.unsqueeze(1)
        w[:, j] = dq
