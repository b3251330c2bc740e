"""Adapter slot buffers of one block copy: what a step's kernels read, allocated once, written per slot.

Projections that read the same input form a group (q|k|v, o, gate|up, down), matching the fused projections
of the blocks. A group's buffers on one copy of a block (one GPU's copy under tensor parallelism) are
  a [slots, parts, rank, K]   the parts' lora_A, K = the input features this copy sees,
  b [slots, N, rank]          the parts' lora_B (scaling folded in) over this copy's output columns side by side,
  ranks [slots] int32         how many rank rows each slot uses (0: empty).
Writing a slot copies an adapter (or a sum of adapters, concatenated along the rank) into those tensors in
place, so CUDA graphs captured over them stay valid; an unused slot is zeroed.

Under tensor parallelism each copy holds the slice of the adapter that matches its slice of the weights:
column-split projections (q|k|v, gate|up) take B's rows of their output columns and the whole A; row-parallel
closing projections (dense o_proj / down_proj) take A's columns of their input slice and the whole B, so each
GPU's (x_s A_s^T) B^T is a partial sum that the block's existing all-reduce completes; column-parallel closers
(EXL2) see the gathered input, so they take the whole A and B's rows of their output columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from exlpy.model.attention import Attention
from exlpy.model.mlp import MLP
from exlpy.model.parallel_linear import ColumnParallel, RowParallel

Range = tuple[int, int]
# group -> (block prefix in module keys, its projections)
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o": ("self_attn", ("o_proj",)),
    "gate_up": ("mlp", ("gate_proj", "up_proj")), "down": ("mlp", ("down_proj",))}
GROUP_OF = {p: g for g, (_, ps) in GROUPS.items() for p in ps}


@dataclass(frozen=True)
class Geometry:
    """What one copy of a block holds of a group, in the full model's coordinates."""

    inputs: Range  # input features [k0, k1)
    outputs: tuple[Range, ...]  # per part, output columns [n0, n1)


class SlotGroup:
    """One group's slot buffers on one device (see the module docstring)."""

    def __init__(self, layer: int, block: str, names: tuple[str, ...], geom: Geometry, slots: int, rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.keys = tuple(f"model.layers.{layer}.{block}.{n}" for n in names)
        self.geom = geom
        k = geom.inputs[1] - geom.inputs[0]
        widths = [b - a for a, b in geom.outputs]
        self.a = torch.zeros(slots, len(names), rank, k, dtype=dtype, device=device)
        self.b = torch.zeros(slots, sum(widths), rank, dtype=dtype, device=device)
        self.ranks = torch.zeros(slots, dtype=torch.int32, device=device)
        self.bounds = tuple(int(x) for x in torch.tensor(widths).cumsum(0)[:-1].tolist())

    def write(self, slot: int, loras: tuple[Any, ...]) -> None:
        """Slot `slot` := the sum of `loras` (their ranks concatenated) over this copy's slice."""
        P, R, K = self.a.shape[1:]
        a = torch.zeros(P, R, K)
        b = torch.zeros(self.b.shape[1], R)
        (k0, k1), n_at, rank = self.geom.inputs, 0, 0
        for p, (key, (n0, n1)) in enumerate(zip(self.keys, self.geom.outputs)):
            r = 0
            for lora in loras:
                w = lora.weights.get(key)
                if w is not None:
                    ra = w[0].shape[0]
                    a[p, r:r + ra] = w[0][:, k0:k1]
                    b[n_at:n_at + n1 - n0, r:r + ra] = w[1][n0:n1]
                    r += ra
            rank, n_at = max(rank, r), n_at + n1 - n0
        self.a[slot].copy_(a)
        self.b[slot].copy_(b)
        self.ranks[slot:slot + 1].copy_(torch.tensor([rank], dtype=torch.int32))

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot:slot + 1].zero_()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.ranks))


def _closer_geometry(closer: Any, share: Any, inputs: Range | None, total_in: int, hidden: int
                     ) -> Geometry | None:
    """Geometry of a closing projection (o_proj, down_proj): see the module docstring."""
    if isinstance(closer, RowParallel):
        return None if inputs is None else Geometry(inputs, ((0, hidden),))
    if isinstance(closer, ColumnParallel):
        return None if share.hidden is None else Geometry((0, total_in), (share.hidden,))
    return Geometry((0, total_in), ((0, hidden),))


def geometries(module: Attention | MLP, share: Any) -> dict[str, Geometry]:
    """The groups this copy of a block holds (share: its tensor-parallel Share, None for a whole block)."""
    spec = module.spec
    hidden = spec.hidden_size
    out: dict[str, Geometry] = {}
    if isinstance(module, Attention):
        d = spec.head_dim
        (qa, qb), (ka, kb) = ((0, spec.num_attention_heads), (0, spec.num_key_value_heads)) if share is None else \
            (share.q_heads, share.kv_heads)
        out["qkv"] = Geometry((0, hidden), ((qa * d, qb * d), (ka * d, kb * d), (ka * d, kb * d)))
        closer = _closer_geometry(module.o_proj, share, (qa * d, qb * d), spec.num_attention_heads * d, hidden)
        name = "o"
    else:
        inter = spec.intermediate_size
        part = (0, inter) if share is None else share.intermediate
        if part is not None and module.gate_proj is not None:
            out["gate_up"] = Geometry((0, hidden), (part, part))
        closer = _closer_geometry(module.down_proj, share, part, inter, hidden)
        name = "down"
    if closer is not None:
        out[name] = closer
    return out


class BlockSlots:
    """The slot buffers of one block copy, per group (only the groups some loaded adapter uses)."""

    def __init__(self, module: Attention | MLP, share: Any, groups: set[str], slots: int, rank: int) -> None:
        assert module.device is not None
        layer = module.layer_idx
        dtype = module.dtype(module.device)
        self.groups: dict[str, SlotGroup] = {}
        for name, geom in geometries(module, share).items():
            if name in groups:
                block, projs = GROUPS[name]
                self.groups[name] = SlotGroup(layer, block, projs, geom, slots, rank, module.device, dtype)

    def write(self, slot: int, loras: tuple[Any, ...]) -> None:
        for g in self.groups.values():
            g.write(slot, loras)

    def clear(self, slot: int) -> None:
        for g in self.groups.values():
            g.clear(slot)
