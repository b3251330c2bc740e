"""Token embedding: the table on one device, or a vocabulary slice per GPU under tensor parallelism; scaled
(Gemma's sqrt(hidden), Granite's / MiniCPM's multipliers) and plus learned positions (GPT-2) where the
architecture says so. Gemma 2 keeps its residual stream in fp32: the embedding starts it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from exlpy.config.config import ExLlamaV2Config
from exlpy.errors import ConfigError
from exlpy.kernels import ops
from exlpy.model.batch import ForwardBatch
from exlpy.model.module import Module
from exlpy.model.parallel_linear import Collective
from exlpy.vision.embedding import EMBEDDING_INDEX
from exlpy.vision.mm import embed_rows
from exlpy.weights.checks import landed


class Embedding(Module):
    def __init__(self, config: ExLlamaV2Config) -> None:
        super().__init__(config, "model.embed_tokens")
        self.weight: torch.Tensor | None = None
        # Tensor parallelism (Megatron's vocab-parallel embedding): this GPU holds rows [vocab_start, +len);
        # ids outside give zero rows and the all-reduce completes every row.
        self.vocab_start = 0
        self.group: Collective | None = None
        self.wpe: torch.Tensor | None = None  # learned position embeddings [positions, hidden]
        f = self.spec.features
        self.scale = f.embed_scale
        self.residual_fp32 = self.spec.arch.residual_fp32
        self.lora: Any = None  # adapters that replace or adapt the embedding (exlpy/lora/outer.py)

    def load(self, device: torch.device) -> None:
        s = self.spec
        name = "model.embed_tokens.weight"
        self.weight = landed(self.index, name, self.index.get(name, shape=(s.vocab_size, s.hidden_size)).to(
            device=device, dtype=self.dtype(device)))
        if s.features.learned_positions:
            rows = s.features.learned_positions
            if self.config.max_seq_len > rows:
                raise ConfigError(f"config.max_seq_len {self.config.max_seq_len} exceeds the {rows} learned positions "
                                  f"of {s.architecture} (model.wpe); it has no way to encode later positions")
            shape = (rows, s.hidden_size)
            self.wpe = landed(self.index, "model.wpe.weight", self.index.get("model.wpe.weight", shape=shape).to(
                device=device, dtype=self.dtype(device)))
        self.device = device

    def tensor_prefixes(self) -> list[str]:
        return [self.key] + (["model.wpe"] if self.spec.features.learned_positions else [])

    def unload(self) -> None:
        self.weight = self.wpe = self.lora = None
        super().unload()

    async def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        mm = batch.mm.embeddings if batch.mm is not None else None
        ids = x
        if mm:
            x = x.masked_fill(x >= EMBEDDING_INDEX, 0)  # embedding ids: looked up below, not in the table
        h = await self._lookup(x, batch)
        if batch.lora and self.lora is not None:  # rows whose adapters replace or adapt the table (PEFT adds
            h = self.lora.embed(x, h, batch)       # them inside embed_tokens, before any scaling)
        if self.scale != 1.0:
            # As transformers: the scale rounded to the compute dtype, one multiply.
            h = h * float(torch.tensor(self.scale, dtype=h.dtype))
        if mm:
            # Image features enter unscaled, as transformers inserts them after the scaled text embedding.
            h = embed_rows(ids, h, mm)
        if self.wpe is not None:
            h = h + F.embedding(batch.rope_pos.to(h.device), self.wpe)
        return h.float() if self.residual_fp32 else h

    async def _lookup(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.weight is not None
        if self.group is None:
            return F.embedding(x, self.weight)
        h = ops.embed_slice(x, self.weight, self.vocab_start)  # zero rows outside this GPU's slice
        await self.group.all_reduce(h)
        return h
