"""The MLP block: x + down(act(gate(h)) * up(h)) with h = norm(x), or x + down(act(up(h))) for a non-gated
MLP (GPT-2, StarCoder2); an optional post-norm of the output (Gemma 2, GLM-4); in a parallel block (Cohere)
h is the normed input the attention beside it computed."""

from __future__ import annotations

from typing import Any

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.kernels import ops
from exlpy.model.batch import ForwardBatch
from exlpy.model.fusion import FusedDense, FusedQuant, fuse_linears
from exlpy.model.linear import Linear, load_linear
from exlpy.model.module import Module
from exlpy.model.norm import Norm, block_norm, fused_norm_ok, load_norm, load_norm_tensors, reads
from exlpy.model.parallel_linear import ColumnParallel, RowParallel, close_block, project


class MLP(Module):
    """Pre-norm MLP block. Under tensor parallelism a copy holds this GPU's slice of the intermediate
    features (possibly none: it then only joins the closing sum) and down_proj sums over GPUs."""

    def __init__(self, config: ExLlamaV2Config, layer_idx: int) -> None:
        super().__init__(config, f"model.layers.{layer_idx}.mlp")
        self.layer_idx = layer_idx
        s = self.spec
        norms = dict(s.arch.norms)
        self.parallel = s.arch.parallel_blocks  # the input norm is the attention's (parallel blocks)
        self.gated = s.arch.gated_mlp
        self.act = s.features.act
        layer = f"model.layers.{layer_idx}"
        self.norm_key = f"{layer}.{norms['mlp_pre']}" if "mlp_pre" in norms else None
        self.post_key = f"{layer}.{norms['mlp_post']}" if "mlp_post" in norms else None
        self.norm_w: torch.Tensor | None = None
        self.norm_b: torch.Tensor | None = None
        self.post_norm: Norm | None = None
        self.gate_proj: Linear | None = None
        self.up_proj: Linear | None = None
        self.down_proj: Linear | RowParallel | ColumnParallel | None = None
        self.gate_up_proj: FusedDense | FusedQuant | None = None  # gate and up side by side when they can fuse
        self.lora: Any = None  # LoRA slot buffers and hooks, attached by exlpy/lora/ while adapters are in use

    def tensor_prefixes(self) -> list[str]:
        return [self.key] + [k for k in (self.norm_key, self.post_key) if k is not None]

    def load(self, device: torch.device) -> None:
        s, dt, idx = self.spec, self.dtype(device), self.index
        kw: dict[str, Any] = {"gptq_v2": s.gptq_v2, "bias": True if s.features.mlp_bias else None}
        if self.norm_key is not None:
            self.norm_w, self.norm_b = load_norm_tensors(self, self.norm_key, device)
        if self.post_key is not None:
            self.post_norm = load_norm(self, self.post_key, device)
        hid, inter = s.hidden_size, s.intermediate_size
        if self.gated:
            self.gate_proj = load_linear(idx, f"{self.key}.gate_proj", hid, inter, device, dt, **kw)
        self.up_proj = load_linear(idx, f"{self.key}.up_proj", hid, inter, device, dt, **kw)
        self.down_proj = load_linear(idx, f"{self.key}.down_proj", inter, hid, device, dt, **kw,
                                     prescale=s.features.residual_scale)
        self.fuse()
        self.device = device

    def fuse(self) -> None:
        parts = [p for p in (self.gate_proj, self.up_proj) if p is not None]
        self.gate_up_proj = fuse_linears(parts) if len(parts) == 2 else None

    def unload(self) -> None:
        self.norm_w = self.norm_b = self.post_norm = None
        self.gate_proj = self.up_proj = self.down_proj = self.gate_up_proj = self.lora = None
        super().unload()

    def _input(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The normed input: this block's norm, or in a parallel block the attention's (moved if a layer split
        put the two on different devices)."""
        if self.parallel:
            return batch.block_inputs.pop(self.layer_idx).to(x.device)
        assert self.norm_w is not None
        return block_norm(x, self.norm_w, self.norm_b, self.spec).to(self.norm_w.dtype)

    def _activation(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.up_proj is not None
        pre = None if self.parallel else batch.take_prenormed(x)  # the norm of x from the collective (TP)
        fusable = fused_norm_ok(self.spec) and not self.parallel and self.act == "silu"
        if (pre is None and self.gate_up_proj is not None and fusable and self.norm_w is not None
                and reads(self.gate_up_proj, x)):
            # pre-norm and activation fused into one gate|up projection
            return self.gate_up_proj.forward_normed_swiglu(x, self.norm_w, self.spec.norm_eps)
        h = pre if pre is not None else self._input(x, batch)
        if not self.gated:
            return ops.act(self.up_proj.forward(h), self.act)
        assert self.gate_proj is not None
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj.forward(h).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj.forward(h), self.up_proj.forward(h)
        return ops.act_mul(gate, up, self.act)

    async def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.down_proj is not None
        if self.lora is not None and batch.lora:  # rows with LoRA adapters (exlpy/lora/block.py)
            act, closing = self.lora.activation(self, x, batch)
            if self.post_norm is not None:
                return self.post_norm.add_to(x, await project(self.down_proj, act, x, closing))
            return await close_block(x, self.down_proj, act, closing)
        if self.up_proj is None:  # a tensor-parallel GPU with no intermediate share
            if self.parallel:
                batch.block_inputs.pop(self.layer_idx, None)
            if self.post_norm is not None:
                return self.post_norm.add_to(x, await project(self.down_proj, None, x))
            batch.take_prenormed(x)  # this GPU has no use for it
            return await close_block(x, self.down_proj, None, None, None if batch.lora else batch)
        act = self._activation(x, batch)
        if self.post_norm is None:
            return await close_block(x, self.down_proj, act, None, None if batch.lora else batch)
        return self.post_norm.add_to(x, await project(self.down_proj, act, x))
