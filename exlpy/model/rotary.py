"""RoPE cos/sin tables, built once per device and dtype from the config's current RoPE settings.

Every layout runs through the one NEOX kernel (rotate the pairs (i, i + D/2)): GPT-J's interleaved pairs
(2i, 2i + 1) and partial rotary (the first `rotary_dim` dimensions only) become NEOX after a fixed permutation
of each head's dimensions, applied to q and k alike (q.k is unchanged by it; v is not permuted, so neither is
the output). The table is the identity (cos 1, sin 0) on the dimensions that are not rotated, and everywhere
for layers without RoPE (Cohere 2's global layers) and models with learned positions.
"""

from __future__ import annotations

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.config.rope import RopeScaling, cos_sin_table


def head_permutation(style: str, head_dim: int, rotary_dim: int) -> list[int] | None:
    """perm with q_neox = q[..., perm], or None when the layout is NEOX over the whole head already."""
    half, rh = head_dim // 2, rotary_dim // 2
    if style == "gptj":
        pairs = [(2 * i, 2 * i + 1) for i in range(rh)]
    else:
        pairs = [(i, i + rh) for i in range(rh)]
    perm = [0] * head_dim
    for i, (a, b) in enumerate(pairs):
        perm[i], perm[half + i] = a, b
    rest = range(rotary_dim, head_dim)  # unrotated dimensions fill the identity columns of the table
    slots = [*range(rh, half), *range(half + rh, head_dim)]
    for slot, d in zip(slots, rest):
        perm[slot] = d
    return None if perm == list(range(head_dim)) else perm


class RotaryTables:
    def __init__(self, config: ExLlamaV2Config) -> None:
        self.config = config
        self._tables: dict[tuple[str, torch.dtype, bool, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self._perms: dict[str, torch.Tensor | None] = {}

    def get(self, device: torch.device, dtype: torch.dtype, rotary: bool = True, local: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The table of a layer; `local`: a sliding-window layer of Gemma 3 (its own base, no scaling)."""
        key = (str(device), dtype, rotary, local)
        if key not in self._tables:
            c, s = self.config, self.config.spec
            assert s is not None
            theta, scaling, pos_scale = s.rope_theta, s.rope_scaling, c.scale_pos_emb
            if local and s.rope_local_theta:
                # Local layers have no scaling: config.json's linear factor (config.scale_pos_emb) is the global
                # layers' only; a factor the user set beyond it applies to both.
                theta, scaling = s.rope_local_theta, RopeScaling()
                if s.rope_scaling.kind == "linear":
                    pos_scale = pos_scale / s.rope_scaling.factor
            # fp32 tables on the CPU reference path; the compute dtype on GPUs.
            self._tables[key] = cos_sin_table(s.head_dim, theta, scaling, c.scale_alpha_value,
                                              pos_scale, c.max_seq_len, device, dtype,
                                              s.features.rotary_dim if rotary else 0)
        return self._tables[key]

    def permutation(self, device: torch.device) -> torch.Tensor | None:
        """Index of each head's dimensions in NEOX order on `device`, None when none is needed."""
        key = str(device)
        if key not in self._perms:
            s = self.config.spec
            assert s is not None
            perm = head_permutation(s.arch.rope_style, s.head_dim, s.features.rotary_dim)
            self._perms[key] = None if perm is None else torch.tensor(perm, device=device)
        return self._perms[key]

    def clear(self) -> None:
        self._tables.clear()
        self._perms.clear()
