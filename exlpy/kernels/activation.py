"""Gated activations act(gate) * up (SwiGLU; GeGLU with GELU's tanh approximation, Gemma); gate and up may
be strided halves of one fused projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, g_stride, u_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row * n + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Same contract as `reference.silu_mul` for gate/up of equal shape; returns a contiguous tensor."""
    n = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = g2.shape[0]
    if rows > 0:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](g2, u2, y, g2.stride(0), u2.stride(0), n, BLOCK=block,
                                                        num_warps=4)
    return y


@triton.jit
def _gelu_tanh_mul_kernel(g_ptr, u_ptr, y_ptr, g_stride, u_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), with tanh(y) = 1 - 2 / (exp(2y) + 1)
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    y = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)) * u
    tl.store(y_ptr + row * n + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def act_mul(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """Same contract as `reference.act_mul`: SiLU and GELU (tanh) in one kernel, others by torch."""
    if kind == "silu":
        return silu_mul(gate, up)
    if kind != "gelu_tanh":
        from exlpy.kernels import reference

        return reference.act_mul(gate, up, kind)
    n = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if g2.shape[0] > 0:
        block = 1024
        _gelu_tanh_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, u2, y, g2.stride(0), u2.stride(0), n,
                                                                    BLOCK=block, num_warps=4)
    return y
