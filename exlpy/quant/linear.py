"""The Linear object for quantized weights: packed on the GPU (Triton kernels), dequantized once on the CPU.

The kernel modules import triton, so they are imported only where they run (CUDA with the Triton kernels
available): a CPU-only install without triton loads and runs EXL2 and GPTQ models on the reference path.
"""

from __future__ import annotations

import torch

from exlpy.errors import TensorParallelError
from exlpy.kernels import ops
from exlpy.quant.exl2_ref import dequant_dense
from exlpy.quant.layout import QuantMatrix


class QuantLinear:
    """y = x @ W (+ bias) with W held packed. Implements exlpy.model.linear.Linear.

    On CUDA, forward runs the Triton kernels on the packed tensors (no fp16 copy of W is kept). On the CPU (and on
    CUDA without Triton, EXLPY_NO_TRITON=1), the reference path dequantizes W once and keeps that dense `dtype`
    copy on the weight's device.
    """

    def __init__(self, qm: QuantMatrix, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.qm = qm
        self.bias = bias
        self.dtype = dtype
        self.in_features = qm.k
        self.out_features = qm.n
        self._dense: torch.Tensor | None = None
        self._rows = None  # exl2_qmm.QmmGroup: 2-64 rows, made at load (never inside a CUDA-graph capture)
        if qm.device.type == "cuda" and ops.has_cuda_kernels():
            # the decode kernels' per-device workspaces and plans, made now rather than inside a capture
            from exlpy.kernels import exl2_qmm, exl2_qmm_plan
            from exlpy.kernels.exl2_gemv import prepare

            prepare(qm.device)
            if exl2_qmm_plan.supports(qm):
                self._rows = exl2_qmm.QmmGroup([qm], bias)

    @property
    def device(self) -> torch.device:
        return self.qm.device

    def _fused_rows(self, x: torch.Tensor) -> int:
        """Rows of x that the multi-row kernel takes in one launch (0: it does not)."""
        m = x.numel() // self.in_features
        if self._rows is None or not x.is_cuda or m < 1:
            return 0
        from exlpy.kernels.exl2_qmm_plan import rows_kernel_takes

        return m if rows_kernel_takes(m, self.in_features, self.out_features) else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._fused_rows(x)
        if m:
            assert self._rows is not None
            return self._rows.run(x.reshape(m, self.in_features)).view(*x.shape[:-1], self.out_features)
        if x.is_cuda and ops.has_cuda_kernels():
            return ops.quant_matmul(x, [self.qm], self.bias)
        if self._dense is None:
            self._dense = dequant_dense(self.qm).to(device=self.qm.device, dtype=self.dtype)
        w = self._dense
        y = x.to(w.dtype) @ w
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + forward(x). On CUDA the sum is made in `residual` itself, in place (the residual stream
        belongs to the forward pass, so nothing else sees it change): up to 64 rows in the kernels' epilogues,
        longer inputs by cuBLAS accumulating into it."""
        rows = x.numel() // self.in_features
        if x.is_cuda and residual.is_contiguous() and residual.numel() == rows * self.out_features \
                and ops.has_cuda_kernels():
            from exlpy.kernels import exl2_gemv, exl2_matmul

            if exl2_matmul.USE_GEMV and exl2_gemv.supports(self.qm) and exl2_gemv.gemv_takes(rows, self.qm.n,
                                                                                            self.qm.k):
                exl2_gemv.exl2_gemv(x.reshape(rows, -1), self.qm, self.bias, residual=residual.view(rows, -1))
                return residual
        m = self._fused_rows(x)
        if m and residual.is_contiguous() and residual.numel() == m * self.out_features:
            assert self._rows is not None
            self._rows.run(x.reshape(m, self.in_features), residual=residual.view(m, self.out_features))
            return residual
        if x.is_cuda and x.numel() > self.in_features and residual.is_contiguous() and ops.has_cuda_kernels():
            return ops.quant_matmul(x, [self.qm], self.bias, residual)  # prefill: cuBLAS accumulates into it
        return residual + self.forward(x)

    def nbytes(self) -> int:
        b = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return self.qm.nbytes() + b

    def split_columns(self, start: int, end: int, device: torch.device) -> QuantLinear:
        if start % 32 or (end % 32 and end < self.out_features):
            raise TensorParallelError(f"column split [{start}, {end}) must be on multiples of 32")
        qm = self.qm.split_columns(start, end).to(device)
        bias = None if self.bias is None else self.bias[start:end].to(device)
        return type(self)(qm, bias, self.dtype)
