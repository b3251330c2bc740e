"""GPTQ linear loader (spec §3.6): 4-bit, v1/v2 zero conventions, optional act-order g_idx."""

from __future__ import annotations

import torch

from exlpy.errors import QuantFormatError
from exlpy.quant.gptq_ref import build_gptq_matrix
from exlpy.quant.linear import QuantLinear
from exlpy.weights.checks import landed
from exlpy.weights.safetensors_index import SafetensorsIndex


class GPTQLinear(QuantLinear):
    """A 4-bit GPTQ linear, run by the same packed-matrix kernels as EXL2 (column split supported too)."""


def load_gptq_linear(index: SafetensorsIndex, prefix: str, in_features: int, out_features: int,
                     device: torch.device, dtype: torch.dtype, gptq_v2: bool = False) -> GPTQLinear:
    for part in ("qweight", "qzeros", "scales"):
        if f"{prefix}.{part}" not in index:
            raise QuantFormatError("GPTQ tensor missing", tensor=f"{prefix}.{part}", file=index.model_dir)
    g_idx = index.get(f"{prefix}.g_idx") if f"{prefix}.g_idx" in index else None
    qm = build_gptq_matrix(index.get(f"{prefix}.qweight"), index.get(f"{prefix}.qzeros"),
                           index.get(f"{prefix}.scales"), g_idx, in_features, out_features, prefix, gptq_v2)
    bias = None
    if f"{prefix}.bias" in index:
        b = index.get(f"{prefix}.bias", shape=(out_features,))
        if bool((b != 0).any()):  # GPTQ checkpoints often carry all-zero biases; they are dropped
            bias = landed(index, f"{prefix}.bias", b.to(device=device, dtype=dtype))
    qm = qm.to(device)
    landed(index, f"{prefix}.scales", qm.scales)
    return GPTQLinear(qm, bias, dtype)
