"""Linear layers. The format (dense, EXL2, GPTQ) is fixed when the layer is loaded; forward never branches."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from exlpy.errors import UnsupportedArchitectureError, WeightsError
from exlpy.weights.checks import landed
from exlpy.weights.safetensors_index import SafetensorsIndex


class Linear(Protocol):
    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""
        ...

    def nbytes(self) -> int: ...

    def split_columns(self, start: int, end: int, device: torch.device) -> Linear:
        """A copy that computes output features [start, end) only, on `device` (tensor parallelism)."""
        ...


class DenseLinear:
    """fp16/bf16/fp32 weight [N, K] (HF layout) with optional bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        b = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return self.weight.numel() * self.weight.element_size() + b

    def split_columns(self, start: int, end: int, device: torch.device) -> DenseLinear:
        # Copies, never views: a view would keep the whole unsplit weight alive on its device.
        bias = self.bias[start:end].to(device, copy=True) if self.bias is not None else None
        return DenseLinear(self.weight[start:end].to(device, copy=True).contiguous(), bias)


def linear_format(index: SafetensorsIndex, prefix: str) -> str:
    """Detect a linear's storage format from tensor names alone (spec §3.1)."""
    if f"{prefix}.q_weight" in index:
        return "exl2"
    if f"{prefix}.qweight" in index:
        return "gptq"
    if f"{prefix}.weight" in index:
        return "dense"
    raise WeightsError(f"Could not find {prefix}.* in model", tensor=prefix, file=index.model_dir)


def linear_tensor_names(index: SafetensorsIndex, prefix: str) -> list[str]:
    return [n for n in index.names_with_prefix(prefix + ".")
            if n[len(prefix) + 1:] in ("weight", "bias", "q_weight", "q_invperm", "q_scale", "q_scale_max",
                                       "q_groups", "q_perm", "qweight", "qzeros", "scales", "g_idx")]


def load_linear(index: SafetensorsIndex, prefix: str, in_features: int, out_features: int,
                device: torch.device, dtype: torch.dtype, *, bias: bool | None = None,
                prescale: float = 1.0, gptq_v2: bool = False, fallback_prefix: str | None = None) -> Linear:
    """Load the linear stored under `prefix` (or `fallback_prefix`, for tied heads) in whatever format it is.

    bias: True requires a bias, False forbids none but ignores it if absent, None loads one when present.
    """
    if fallback_prefix is not None and not _has_any(index, prefix):
        prefix = fallback_prefix
    fmt = linear_format(index, prefix)
    if fmt == "exl2":
        from exlpy.quant.exl2 import load_exl2_linear

        return load_exl2_linear(index, prefix, in_features, out_features, device, dtype, prescale=prescale)
    if fmt == "gptq":
        from exlpy.quant.gptq import load_gptq_linear

        if prescale != 1.0:
            raise UnsupportedArchitectureError(f"{prefix}: a residual multiplier ({prescale}) on a GPTQ projection "
                                               "is not supported (EXL2 and fp16 weights fold it in)")
        return load_gptq_linear(index, prefix, in_features, out_features, device, dtype, gptq_v2=gptq_v2)
    w = index.get(f"{prefix}.weight", shape=(out_features, in_features))
    w = (w.to(torch.float32) * prescale if prescale != 1.0 else w).to(device=device, dtype=dtype)
    b = None
    if f"{prefix}.bias" in index and bias is not False:
        b = index.get(f"{prefix}.bias", shape=(out_features,))
        b = (b.to(torch.float32) * prescale if prescale != 1.0 else b).to(device=device, dtype=dtype)
    elif bias:
        raise WeightsError("bias expected by config but missing", tensor=f"{prefix}.bias", file=index.model_dir)
    return DenseLinear(landed(index, f"{prefix}.weight", w), landed(index, f"{prefix}.bias", b))


def _has_any(index: SafetensorsIndex, prefix: str) -> bool:
    return any(f"{prefix}.{s}" in index for s in ("weight", "q_weight", "qweight"))
