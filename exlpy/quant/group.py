"""Quantized projections that read the same input (q|k|v, gate|up) run as one launch: the decode GEMV for one
row, the multi-row kernel (exl2_qmm.py) for 2-64 rows.

EXL2 orders a matrix's rows by the Hessian of its input, which projections of one input share, so q, k and v
(and gate and up) carry the same act-order permutation: the input is gathered into that order once, by the
RMSNorm that makes it, and one launch per bit width computes every part's outputs side by side.
"""

from __future__ import annotations

import torch

from exlpy.kernels import ops
from exlpy.quant.linear import QuantLinear


class FusedQuant:
    """Several QuantLinears side by side. On CUDA one row runs the grouped GEMV and 2-64 rows (decode batches,
    speculative verification) the grouped multi-row kernel, the RMSNorm and act-order gather fused into the
    launch that prepares x; everything else (CPU, prefill) runs the parts one by one and concatenates."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        from exlpy.kernels.exl2_gemv import GemvGroup
        from exlpy.kernels.exl2_qmm import QmmGroup

        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.perm = parts[0].qm.perm
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([p.bias if p.bias is not None else
                              torch.zeros(p.out_features, dtype=parts[0].dtype, device=p.device) for p in parts])
        self.group = GemvGroup([p.qm for p in parts], bias)
        self.rows = QmmGroup([p.qm for p in parts], bias)

    def _decode_row(self, x: torch.Tensor) -> bool:
        """Whether x's rows run the decode GEMV (one row, or a few: exl2_gemv.gemv_takes)."""
        from exlpy.kernels.exl2_gemv import gemv_takes

        return x.is_cuda and gemv_takes(x.numel() // self.in_features, self.out_features, self.in_features)

    def _fused_rows(self, x: torch.Tensor) -> int:
        """Rows of x that the multi-row kernel takes in one launch (0: it does not)."""
        from exlpy.kernels.exl2_qmm_plan import rows_kernel_takes

        m = x.numel() // self.in_features
        return m if x.is_cuda and m >= 1 and rows_kernel_takes(m, self.in_features, self.out_features) else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._decode_row(x):
            from exlpy.kernels.exl2_gemv import ROW_PAD

            y = self.group.run(ops.act_order(x, self.perm, ROW_PAD), x.dtype)
            return y.view(*x.shape[:-1], self.out_features)
        m = self._fused_rows(x)
        if m:
            return self.rows.run(x.reshape(m, self.in_features)).view(*x.shape[:-1], self.out_features)
        if x.is_cuda:  # prefill: the parts dequantized into one output for cuBLAS (no concatenation)
            return ops.quant_matmul(x, [p.qm for p in self.parts], self.rows.bias)
        return torch.cat([p.forward(x) for p in self.parts], dim=-1)

    def forward_normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """forward(rms_norm(x)); for the decode GEMV the norm writes the act-order input itself (no extra launch)."""
        if self._decode_row(x):
            from exlpy.kernels.exl2_gemv import ROW_PAD

            xp = ops.rms_norm_act_order(x, norm_weight, eps, self.perm, ROW_PAD)
            return self.group.run(xp, x.dtype).view(*x.shape[:-1], self.out_features)
        m = self._fused_rows(x)
        if m:  # the gather that puts x in the kernel's order normalizes it on the way
            y = self.rows.run(x.reshape(m, self.in_features), norm_weight=norm_weight, eps=eps)
            return y.view(*x.shape[:-1], self.out_features)
        return self.forward(ops.rms_norm(x, norm_weight, eps))

    def forward_normed_swiglu(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """silu(gate) * up of forward_normed(x) for a [gate; up] pair: [..., I]."""
        gate, up = self.forward_normed(x, norm_weight, eps).chunk(2, dim=-1)
        return ops.silu_mul(gate, up)


def fuse_quant(parts: list[object]) -> FusedQuant | None:
    """A FusedQuant over `parts`, or None when they cannot share one launch: all must be quantized matrices of one
    kind on one CUDA device with the same K and act order, each taken by the decode kernels (groups of whole
    32-row blocks). Without the Triton
    kernels (CPU, or no triton installed) nothing fuses and the kernel module is never imported."""
    if not all(isinstance(p, QuantLinear) for p in parts):
        return None
    qparts = [p for p in parts if isinstance(p, QuantLinear)]
    q0 = qparts[0].qm
    if q0.device.type != "cuda" or not ops.has_cuda_kernels():
        return None
    from exlpy.kernels.exl2_gemv import supports

    if not all(supports(p.qm) for p in qparts):
        return None
    for p in qparts[1:]:
        qm = p.qm
        if qm.kind != q0.kind or qm.device != q0.device or qm.k != q0.k or p.dtype != qparts[0].dtype:
            return None
        if (qm.perm is None) != (q0.perm is None) or (qm.perm is not None and not torch.equal(qm.perm, q0.perm)):
            return None
    try:
        return FusedQuant(qparts)
    except ValueError:  # more output columns than the decode workspace holds
        return None
