"""Load-time fusion of projections that read the same input, and residual adds fused into GEMMs.

One matmul over [q; k; v] (or [gate; up]) reads the input once and launches one kernel instead of three,
which matters at batch 1 where every launch costs the same as a small GEMV.
"""

from __future__ import annotations

import torch

from exlpy.errors import ConfigError
from exlpy.kernels import ops
from exlpy.model.linear import DenseLinear, Linear
from exlpy.quant.group import FusedQuant, fuse_quant
from exlpy.quant.linear import QuantLinear


class FusedDense(DenseLinear):
    """Several dense projections side by side; single rows (batch-1 decode) use the streaming GEMV kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear_add(x, self.weight)
        return y if self.bias is None else y + self.bias

    def forward_normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """forward(rms_norm(x)); one kernel at batch 1, where the norm would otherwise launch on its own."""
        y = ops.norm_linear(x, norm_weight, eps, self.weight)
        return y if self.bias is None else y + self.bias

    def forward_normed_swiglu(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """silu(gate) * up of forward_normed(x) for a [gate; up] fusion: [..., I].

        Without a bias this is one op, whose batch-1 kernel applies the activation in the GEMV epilogue; the
        weight keeps its plain [gate; up] row layout, so the parts' views and tensor-parallel splits still see
        ordinary gate and up weights.
        """
        if self.weight.shape[0] % 2:
            raise ConfigError(f"forward_normed_swiglu: fused weight {tuple(self.weight.shape)} is not a "
                              "[gate; up] pair of equal halves")
        if self.bias is None:
            return ops.norm_linear_swiglu(x, norm_weight, eps, self.weight)
        gate, up = self.forward_normed(x, norm_weight, eps).chunk(2, dim=-1)
        return ops.silu_mul(gate, up)


def fuse_dense(parts: list[Linear]) -> FusedDense | None:
    """One DenseLinear computing every part's outputs side by side, or None when the parts cannot fuse.

    Fusing needs plain dense weights of one dtype on one device, with biases on all parts or none. The
    parts are rebound to views of the fused weight, so they keep working and the memory is not doubled.
    """
    if not all(type(p) is DenseLinear for p in parts):
        return None
    dense = [p for p in parts if isinstance(p, DenseLinear)]
    w0 = dense[0].weight
    if any(p.weight.device != w0.device or p.weight.dtype != w0.dtype or p.in_features != dense[0].in_features
           for p in dense):
        return None
    has_bias = [p.bias is not None for p in dense]
    if any(has_bias) and not all(has_bias):
        return None
    weight = torch.cat([p.weight for p in dense], dim=0)
    bias = torch.cat([p.bias for p in dense if p.bias is not None], dim=0) if all(has_bias) else None
    start = 0
    for p in dense:
        end = start + p.out_features
        p.weight = weight[start:end]
        p.bias = bias[start:end] if bias is not None else None
        start = end
    return FusedDense(weight, bias)


def add_linear(x: torch.Tensor, linear: Linear, h: torch.Tensor) -> torch.Tensor:
    """x + linear(h).

    On CUDA a bias-free dense layer accumulates into x in place (the GEMV epilogue, or cuBLAS beta=1): no
    extra kernel and no extra pass over x. The residual stream is owned by the forward pass, so nothing else
    sees x change.
    """
    if isinstance(linear, DenseLinear) and linear.bias is None and x.is_contiguous():
        return ops.linear_add(h, linear.weight, x)
    if isinstance(linear, QuantLinear) and x.is_contiguous():
        return linear.forward_add(h, x)  # one decode row: the quantized GEMV's epilogue adds into x
    return x + linear.forward(h)


def dense_matmul(linear: DenseLinear, h: torch.Tensor) -> torch.Tensor:
    """linear(h) for a dense weight through `ops.linear_add` (the single-row GEMV kernel at decode, where
    cuBLAS would pick split-K GEMVs plus a reduce kernel)."""
    y = ops.linear_add(h, linear.weight)
    return y if linear.bias is None else y.add_(linear.bias)


def fuse_linears(parts: list[Linear]) -> FusedDense | FusedQuant | None:
    """The parts side by side as one projection (dense, or quantized with a shared act order), or None."""
    return fuse_dense(parts) or fuse_quant(parts)
