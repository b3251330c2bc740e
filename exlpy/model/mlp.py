"""The MLP block: x + down(silu(gate(h)) * up(h)), h = rms_norm(x)."""

from __future__ import annotations

from typing import Any

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.kernels import ops
from exlpy.model.attention import load_norm
from exlpy.model.batch import ForwardBatch
from exlpy.model.fusion import FusedDense, FusedQuant, fuse_linears
from exlpy.model.linear import Linear, load_linear
from exlpy.model.module import Module
from exlpy.model.parallel_linear import ColumnParallel, RowParallel, close_block


class MLP(Module):
    """Pre-norm SwiGLU block. Under tensor parallelism a copy holds this GPU's slice of the intermediate
    features (possibly none: it then only joins the closing sum) and down_proj sums over GPUs."""

    def __init__(self, config: ExLlamaV2Config, layer_idx: int) -> None:
        super().__init__(config, f"model.layers.{layer_idx}.mlp")
        self.layer_idx = layer_idx
        self.norm_key = f"model.layers.{layer_idx}.post_attention_layernorm"
        self.norm_w: torch.Tensor | None = None
        self.gate_proj: Linear | None = None
        self.up_proj: Linear | None = None
        self.down_proj: Linear | RowParallel | ColumnParallel | None = None
        self.gate_up_proj: FusedDense | FusedQuant | None = None  # gate and up side by side when they can fuse
        self.lora: Any = None  # LoRA slot buffers and hooks, attached by exlpy/lora/ while adapters are in use

    def tensor_prefixes(self) -> list[str]:
        return [self.key, self.norm_key]

    def load(self, device: torch.device) -> None:
        s, dt, idx = self.spec, self.dtype(device), self.index
        kw = {"gptq_v2": s.gptq_v2, "bias": True if s.mlp_bias else None}
        self.norm_w = load_norm(self, self.norm_key, device)
        hid, inter = s.hidden_size, s.intermediate_size
        self.gate_proj = load_linear(idx, f"{self.key}.gate_proj", hid, inter, device, dt, **kw)
        self.up_proj = load_linear(idx, f"{self.key}.up_proj", hid, inter, device, dt, **kw)
        self.down_proj = load_linear(idx, f"{self.key}.down_proj", inter, hid, device, dt, **kw)
        self.fuse()
        self.device = device

    def fuse(self) -> None:
        parts = [p for p in (self.gate_proj, self.up_proj) if p is not None]
        self.gate_up_proj = fuse_linears(parts) if len(parts) == 2 else None

    def unload(self) -> None:
        self.norm_w = None
        self.gate_proj = self.up_proj = self.down_proj = self.gate_up_proj = self.lora = None
        super().unload()

    async def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.down_proj is not None and self.norm_w is not None
        if self.lora is not None and batch.lora:  # rows with LoRA adapters (exlpy/lora/block.py)
            act, closing = self.lora.activation(self, x, batch)
            return await close_block(x, self.down_proj, act, closing)
        if self.gate_proj is None or self.up_proj is None:  # a tensor-parallel GPU with no intermediate share
            return await close_block(x, self.down_proj, None)
        eps = self.spec.norm_eps
        if self.gate_up_proj is not None:  # pre-norm and activation fused into one gate|up projection
            act = self.gate_up_proj.forward_normed_swiglu(x, self.norm_w, eps)
        else:
            h = ops.rms_norm(x, self.norm_w, eps)
            act = ops.silu_mul(self.gate_proj.forward(h), self.up_proj.forward(h))
        return await close_block(x, self.down_proj, act)
