"""Single-row dense matmul y = x @ W^T (+ residual, in place) for batch-1 decode.

At one row, y = W x streams the weight once; cuBLAS picks split-K kernels for the tall-K shapes (o_proj,
down_proj) that need a second reduction kernel and reach ~2.4-2.7 TB/s. Here each program owns BLOCK_N
whole output rows and reads them end to end (coalesced along K), so there is one kernel and no reduction,
and the residual add rides in the epilogue. For the fused gate|up projection the SwiGLU activation rides
there too (`norm_linear_swiglu`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.errors import ConfigError
from exlpy.kernels import pdl
from exlpy.kernels.activation import silu_mul

_SMS = 132  # an H100's SM count; only sizes the rows per program
# Launch parameters (benchmarks/gemv_sweep.py times alternatives in whole-model decode): weight rows per program
# on large / small outputs, K tile, warps per program.
CONFIG: dict[str, int] = {"ROWS": 8, "ROWS_SMALL": 4, "BLOCK_K": 512, "WARPS": 4}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, r_ptr, nw_ptr, N, K, w_stride, eps, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, EVEN_K: tl.constexpr,
                 SWIGLU: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched early (exlpy/kernels/pdl.py): x and the residual come from the previous kernel
        tl.extra.cuda.gdc_wait()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = w_ptr + n.to(tl.int64)[:, None] * w_stride
    # SWIGLU: the weight is [gate; up] with 2N rows; this program also streams the up rows n + N that match
    # its gate rows, so silu(gate) * up is formed in registers and the [.., 2N] intermediate never exists.
    rows_u = w_ptr + (n + N).to(tl.int64)[:, None] * w_stride
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # stays unused (and is folded away) without SWIGLU
    ss = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(rows + k[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + k)
        else:
            w = tl.load(rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        xf = x.to(tl.float32)
        if HAS_NORM:
            # RMSNorm folded in: y = rsqrt(mean(x²) + eps) · Σ W (x · w_norm), in the same pass over x. It
            # differs from norm-then-GEMV only by the fp16 rounding of the normalized input.
            ss += xf * xf
            xf = xf * tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        if SWIGLU:
            if EVEN_K:
                wu = tl.load(rows_u + k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                wu = tl.load(rows_u + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            acc_u += wu.to(tl.float32) * xf[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    u = tl.sum(acc_u, axis=1)
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        y = y * inv_rms
        u = u * inv_rms
    if SWIGLU:
        y = y / (1.0 + tl.exp(-y)) * u
    if HAS_RES:
        y += tl.load(r_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.linear_add`: residual + x @ weight^T, written into residual when given.

    One row runs the kernel above; more rows go to cuBLAS (addmm_ into the residual, or F.linear).
    """
    N, K = weight.shape
    rows = x.numel() // K
    if rows != 1 or weight.stride(1) != 1 or x.dtype != weight.dtype:
        if residual is None:
            return torch.nn.functional.linear(x, weight)
        residual.view(-1, N).addmm_(x.reshape(-1, K), weight.t())
        return residual
    return _launch(x, weight, residual, None, 0.0)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as `reference.norm_linear`: rms_norm(x) @ weight^T, the norm fused in for one row."""
    N, K = weight.shape
    if x.numel() != K or weight.stride(1) != 1 or not _norm_input_ok(x, norm_weight, weight):
        from exlpy.kernels.rmsnorm import rms_norm

        return torch.nn.functional.linear(rms_norm(x, norm_weight, eps), weight)
    return _launch(x, weight, None, norm_weight, eps)


def norm_linear_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
                       ) -> torch.Tensor:
    """Same contract as `reference.norm_linear_swiglu`: silu(gate) * up of rms_norm(x) @ [gate; up]^T.

    One row runs the GEMV kernel with the activation in its epilogue (one launch instead of GEMV + silu_mul);
    more rows keep the fused GEMM and the separate activation kernel.
    """
    two_n, K = weight.shape
    if two_n % 2:
        raise ConfigError(f"norm_linear_swiglu: weight {tuple(weight.shape)} must stack gate and up rows of "
                          "equal count")
    if x.numel() != K or weight.stride(1) != 1 or not _norm_input_ok(x, norm_weight, weight):
        gate, up = norm_linear(x, norm_weight, eps, weight).chunk(2, dim=-1)
        return silu_mul(gate, up)
    return _launch(x, weight, None, norm_weight, eps, swiglu=True)


def _norm_input_ok(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor) -> bool:
    """The fused norm reads x in its own dtype: the weights' dtype, or an fp32 residual stream (Gemma 2)."""
    return norm_weight.dtype == weight.dtype and x.dtype in (weight.dtype, torch.float32)


def _launch(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, swiglu: bool = False) -> torch.Tensor:
    N, K = weight.shape
    if swiglu:
        N //= 2
    x1 = x.reshape(K)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    out = residual if residual is not None else torch.empty((*x.shape[:-1], N), dtype=weight.dtype, device=x.device)
    # Weight rows per program: more on large outputs. With SWIGLU each output reads a gate and an up row, so half
    # as many outputs per program keeps the same rows (and registers) per program.
    rows = 2 * N if swiglu else N
    block_n = CONFIG["ROWS"] if rows >= CONFIG["ROWS"] * 4 * _SMS else CONFIG["ROWS_SMALL"]
    if swiglu:
        block_n = max(1, block_n // 2)
    block_k = CONFIG["BLOCK_K"] if K >= CONFIG["BLOCK_K"] else triton.next_power_of_2(K)
    nw = norm_weight if norm_weight is not None else x1
    _gemv_kernel[(triton.cdiv(N, block_n),)](x1, weight, out, out, nw, N, K, weight.stride(0), eps,
                                             BLOCK_N=block_n, BLOCK_K=block_k, HAS_RES=residual is not None,
                                             HAS_NORM=norm_weight is not None, EVEN_K=K % block_k == 0,
                                             SWIGLU=swiglu, num_warps=CONFIG["WARPS"], PDL=pdl.enabled(x.device),
                                             **pdl.launch_options(x.device))
    return out
