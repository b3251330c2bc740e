"""RoPE cos/sin tables, built once per device and dtype from the config's current RoPE settings."""

from __future__ import annotations

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.config.rope import cos_sin_table


class RotaryTables:
    def __init__(self, config: ExLlamaV2Config) -> None:
        self.config = config
        self._tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(device), dtype)
        if key not in self._tables:
            c, s = self.config, self.config.spec
            assert s is not None
            # fp32 tables on the CPU reference path; the compute dtype on GPUs.
            self._tables[key] = cos_sin_table(s.head_dim, s.rope_theta, s.rope_scaling, c.scale_alpha_value,
                                              c.scale_pos_emb, c.max_seq_len, device, dtype)
        return self._tables[key]

    def clear(self) -> None:
        self._tables.clear()
