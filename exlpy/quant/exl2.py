"""EXL2 linear loader (spec §3): read the packed tensors, validate them once, keep them packed on `device`."""

from __future__ import annotations

import torch

from exlpy.errors import QuantFormatError
from exlpy.quant.exl2_ref import build_exl2_matrix
from exlpy.quant.linear import QuantLinear
from exlpy.weights.checks import landed
from exlpy.weights.safetensors_index import SafetensorsIndex

_PARTS = ("q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups")


class EXL2Linear(QuantLinear):
    """An EXL2-quantized linear (mixed 2-8 bit groups, act-order permutation, 4-bit scales)."""


def load_exl2_linear(index: SafetensorsIndex, prefix: str, in_features: int, out_features: int,
                     device: torch.device, dtype: torch.dtype, prescale: float = 1.0) -> EXL2Linear:
    for part in _PARTS:
        if f"{prefix}.{part}" not in index:
            raise QuantFormatError("EXL2 tensor missing", tensor=f"{prefix}.{part}", file=index.model_dir)
    # q_perm, when present, is ignored: it is always recomputed from q_invperm (spec §3.1).
    t = {p: index.get(f"{prefix}.{p}") for p in _PARTS}
    qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"],
                           in_features, out_features, prefix, prescale=prescale)
    bias = None
    if f"{prefix}.bias" in index:
        b = index.get(f"{prefix}.bias")
        if b.numel() < out_features:
            raise QuantFormatError(f"has {b.numel()} entries, expected {out_features}", tensor=f"{prefix}.bias")
        bias = landed(index, f"{prefix}.bias", (b.flatten()[:out_features].float() * prescale).to(device=device,
                                                                                                 dtype=dtype))
    qm = qm.to(device)
    landed(index, f"{prefix}.q_scale_max", qm.scale_max)  # a NaN scale makes a whole group of weights NaN
    return EXL2Linear(qm, bias, dtype)
