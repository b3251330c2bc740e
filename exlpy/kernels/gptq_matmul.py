"""GPTQ matmul: a GPTQ matrix is one 4-bit segment of the shared packed-matrix kernels (same word layout as
EXL2 4-bit), with fp16 scales and per-column zero points instead of EXL2's 4-bit scale codes."""

from __future__ import annotations

import torch

from exlpy.kernels.exl2_matmul import exl2_matmul, exl2_matmul_ref
from exlpy.quant.layout import QuantMatrix


def gptq_matmul(x: torch.Tensor, qm: QuantMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    assert qm.kind == "gptq"
    return exl2_matmul(x, qm, bias)


def gptq_matmul_ref(x: torch.Tensor, qm: QuantMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    assert qm.kind == "gptq"
    return exl2_matmul_ref(x, qm, bias)
