"""The norms of a block: RMSNorm or LayerNorm as the architecture says, loaded with its quirks.

Gemma stores RMSNorm weights minus one (`norm_constant_bias`): the one is added at load, so the kernels see an
ordinary weight. LayerNorms may carry a bias (GPT-2, StarCoder2) or not (Cohere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exlpy.errors import WeightsError
from exlpy.kernels import ops
from exlpy.weights.checks import landed


@dataclass
class Norm:
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    rms: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.layer_norm(x, self.weight, self.bias, self.eps)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + norm(y): a post-norm block's residual add (one kernel for RMSNorm; may write into x)."""
        if self.rms:
            return ops.rms_norm_add(x, y, self.weight, self.eps)
        return x + ops.layer_norm(y, self.weight, self.bias, self.eps)

    def to(self, device: torch.device) -> Norm:
        return Norm(self.weight.to(device), None if self.bias is None else self.bias.to(device), self.eps, self.rms)


def load_norm_tensors(m: object, key: str, device: torch.device, shapes: list[tuple[int, ...]] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias or None) of the norm `key` of module `m`, the architecture's constant added to the weight.
    `shapes`: the shapes allowed (default [hidden_size]); q/k norms allow [head_dim] and per head [heads, D]."""
    spec, index = m.spec, m.index  # type: ignore[attr-defined]
    dtype = m.dtype(device)  # type: ignore[attr-defined]
    name = f"{key}.weight"
    allowed = shapes or [(spec.hidden_size,)]
    shape = index.info(name).shape
    if shape not in allowed:
        raise WeightsError(f"wrong shape {list(shape)}, expected {' or '.join(str(list(a)) for a in allowed)}",
                           tensor=name, file=index.info(name).file)
    w = index.get(name)
    if spec.arch.norm_constant_bias:
        w = w.float() + spec.arch.norm_constant_bias
    weight = landed(index, name, w.to(device=device, dtype=dtype))
    bias = None
    if f"{key}.bias" in index:
        bias = landed(index, f"{key}.bias", index.get(f"{key}.bias", shape=shape).to(device=device, dtype=dtype))
    return weight, bias


def load_norm(m: object, key: str, device: torch.device, shapes: list[tuple[int, ...]] | None = None) -> Norm:
    weight, bias = load_norm_tensors(m, key, device, shapes)
    spec = m.spec  # type: ignore[attr-defined]
    return Norm(weight, bias, spec.norm_eps, spec.arch.norm == "rms")


def block_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: object) -> torch.Tensor:
    """The architecture's norm kind over x's last dim with these tensors."""
    if spec.arch.norm == "rms":  # type: ignore[attr-defined]
        return ops.rms_norm(x, weight, spec.norm_eps)  # type: ignore[attr-defined]
    return ops.layer_norm(x, weight, bias, spec.norm_eps)  # type: ignore[attr-defined]


def reads(fused: object, x: torch.Tensor) -> bool:
    """Whether a fused projection's normed forward takes x as it is: dense ones also read an fp32 residual
    stream (Gemma 2) into a half-precision GEMV, quantized ones only their own compute dtype."""
    from exlpy.model.fusion import FusedDense

    if isinstance(fused, FusedDense):
        return True
    parts = getattr(fused, "parts", None)  # FusedQuant: its projections' compute dtype
    return not parts or x.dtype == parts[0].dtype


def fused_norm_ok(spec: object) -> bool:
    """Whether a block's pre-norm may run inside the first projection's kernel (those compute RMSNorm)."""
    return spec.arch.norm == "rms"  # type: ignore[attr-defined]
