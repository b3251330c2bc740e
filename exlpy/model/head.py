"""The final norm and the output projection to the vocabulary (tied models fall back to the embedding), with
the architecture's logit scale and final soft-capping applied to the float32 logits."""

from __future__ import annotations

from typing import Any

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.model.batch import ForwardBatch
from exlpy.model.linear import DenseLinear, Linear, load_linear
from exlpy.model.module import Module
from exlpy.model.norm import block_norm, load_norm_tensors
from exlpy.model.parallel_linear import ColumnParallel


class RMSNorm(Module):
    """The final norm: RMSNorm, or LayerNorm where the architecture uses it (the per-block norms live inside
    the blocks that use them). Its output is in the compute dtype (the residual may be fp32)."""

    def __init__(self, config: ExLlamaV2Config, key: str = "model.norm") -> None:
        super().__init__(config, key)
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def load(self, device: torch.device) -> None:
        self.weight, self.bias = load_norm_tensors(self, self.key, device)
        self.device = device

    def unload(self) -> None:
        self.weight = self.bias = None
        super().unload()

    async def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.weight is not None
        pre = batch.take_prenormed(x)  # computed by the last block's collective (tensor parallelism)
        if pre is not None:
            return pre
        return block_norm(x, self.weight, self.bias, self.spec).to(self.weight.dtype)


class Head(Module):
    """Output projection. Under tensor parallelism `linear` is a ColumnParallel over this GPU's vocabulary
    columns whose logits are gathered on the first GPU (the others return None)."""

    def __init__(self, config: ExLlamaV2Config) -> None:
        super().__init__(config, "lm_head")
        self.linear: Linear | ColumnParallel | None = None
        self.lora: Any = None  # adapters that replace or adapt the head (exlpy/lora/outer.py)

    def tensor_prefixes(self) -> list[str]:
        if any(n.startswith("lm_head.") for n in self.index.tensors):
            return ["lm_head"]
        return ["model.embed_tokens"]

    def load(self, device: torch.device) -> None:
        s = self.spec
        dt = self.dtype(device)
        self.linear = load_linear(self.index, "lm_head", s.hidden_size, s.vocab_size, device, dt,
                                  fallback_prefix="model.embed_tokens" if s.features.tied_head else None)
        if s.features.norm_head and isinstance(self.linear, DenseLinear):
            # Index / Baichuan-style heads: rows L2-normalized (exllamav2 does it for unquantized heads).
            w = self.linear.weight.float()
            self.linear.weight = (w / w.norm(dim=-1, keepdim=True).clamp_min(1e-12)).to(dt)
        self.device = device

    def unload(self) -> None:
        self.linear = self.lora = None
        super().unload()

    async def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """float32 logits. At most `config.max_output_len` positions go through the head at a time
        (exllamav2's bound on the head's working memory); each slice leaves as float32."""
        n = self.config.max_output_len
        if not n or x.shape[1] <= n:
            return await self._logits(x, batch)
        parts = [await self._logits(x[:, a:a + n], batch) for a in range(0, x.shape[1], n)]
        return None if parts[0] is None else torch.cat(parts, dim=1)  # type: ignore[arg-type]

    async def _logits(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        assert self.linear is not None
        y = await self.linear.forward(x) if isinstance(self.linear, ColumnParallel) else self.linear.forward(x)
        if y is None:
            return None
        if batch.lora and self.lora is not None:  # rows whose adapters replace or adapt lm_head
            y = self.lora.logits(x, y, batch)
        f = self.spec.features
        y = y.float()
        if f.logit_scale != 1.0:
            y = y * f.logit_scale
        if f.final_softcap:
            y = torch.tanh(y / f.final_softcap) * f.final_softcap
        return y
