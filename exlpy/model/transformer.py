"""The core model: the module list and one forward pass that reads top to bottom.

It knows nothing of devices, placement or caches beyond `ForwardBatch` and the cache protocol: the execution
strategies (exlpy/engine/) decide which device runs which modules, and one GPU's copy of this class is what
each GPU runs under tensor parallelism.
"""

from __future__ import annotations

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.model.attention import Attention
from exlpy.model.batch import LOGITS_LAST, LOGITS_NONE, ForwardBatch
from exlpy.model.embedding import Embedding
from exlpy.model.head import Head, RMSNorm
from exlpy.model.mlp import MLP
from exlpy.model.module import Module
from exlpy.model.moe import MoEMLP
from exlpy.model.rotary import RotaryTables


def build_modules(config: ExLlamaV2Config, rotary: RotaryTables) -> list[Module]:
    """Embedding, then attention and MLP (or MoE block) per layer, the final norm and the head (exllamav2's
    module list)."""
    assert config.spec is not None
    modules: list[Module] = [Embedding(config)]
    for i in range(config.num_hidden_layers):
        mlp = MoEMLP(config, i) if config.spec.is_sparse(i) else MLP(config, i)
        modules += [Attention(config, i, rotary), mlp]
    return modules + [RMSNorm(config), Head(config)]


class Transformer:
    """A decoder as a module list [embedding, (attention, mlp) x L, norm, head]."""

    def __init__(self, modules: list[Module]) -> None:
        self.modules = modules
        self.norm_idx = len(modules) - 2
        self.last_attn = max(i for i, m in enumerate(modules) if isinstance(m, Attention))

    async def forward(self, x: torch.Tensor, batch: ForwardBatch, start: int = 0, stop: int | None = None
                      ) -> torch.Tensor | None:
        """Modules [start, stop) over `x` (token ids when start is 0): the hidden state, or float32 logits
        when the range ends with the head; None once nothing past the cache is wanted (prefill)."""
        stop = len(self.modules) if stop is None else stop
        for i in range(start, stop):
            out = await self.step(i, x, batch)
            if out is None:
                return None
            x = out
        return x

    async def step(self, i: int, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Module i with what the pass asks around it; None when nothing from module i on is wanted."""
        if i > self.last_attn and batch.logits == LOGITS_NONE:
            return None  # the cache is written: a prefill needs nothing after the last attention
        if i == self.norm_idx and batch.logit_rows is not None:
            x = x[:, :batch.logit_rows]  # a mixed pass: the decode rows lead it (model/batch.py mixed_batch)
        elif i == self.norm_idx and batch.logits == LOGITS_LAST:
            x = x[:, -1:]
        x = await self.run(i, x, batch)
        if i == self.norm_idx and batch.keep_last_state:
            batch.last_state = x
        return x

    async def run(self, i: int, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Module i's forward (layer streaming loads the module around it: exlpy/engine/streaming.py)."""
        return await self.modules[i].forward(x, batch)
