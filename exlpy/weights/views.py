"""Canonical tensors read as slices of fused or transposed checkpoint tensors.

Phi-3 stores q|k|v as one `qkv_proj` and gate|up as one `gate_up_proj`, GPT-2 and GPTBigCode one `c_attn`
(GPT-2's transposed, as Conv1D stores [in, out]), InternLM2 one `wqkv` packed per KV group. Each part gets a
view under its canonical name (`q_proj.weight`, ...), so every loader, the planner and the converter see one
naming and one layout ([out, in]), and an EXL2 checkpoint (whose parts are stored separately) needs none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from exlpy.errors import WeightsError

Rows = tuple[int, int] | tuple[int, ...] | None  # (start, stop) range, or explicit indices with `indexed`


@dataclass(frozen=True)
class TensorView:
    source: str  # stored (canonical) name of the tensor read
    transpose: bool = False  # the stored 2-D tensor is [in, out]
    rows: Rows = None  # after the transpose: all rows, a [start, stop) range, or indices
    indexed: bool = False
    transpose_rows: bool = False  # the selected rows transposed (DBRX's fused w2: [E*I, H], an expert's [I, H])

    def rows_of(self, shape: tuple[int, ...]) -> int:
        total = shape[1] if self.transpose and len(shape) == 2 else shape[0]
        if self.rows is None:
            return total
        return len(self.rows) if self.indexed else self.rows[1] - self.rows[0]

    def read(self, t: torch.Tensor) -> torch.Tensor:
        if self.transpose and t.dim() == 2:
            t = t.t()
        if self.rows is not None:
            t = t[torch.tensor(self.rows)] if self.indexed else t[self.rows[0]:self.rows[1]]
        if self.transpose_rows:
            t = t.t()
        return t.contiguous()


def _altpack_rows(kv_heads: int, groups: int, head_dim: int) -> list[list[int]]:
    """InternLM2's wqkv rows for q, k and v: per KV head, `groups` query heads then one key and one value head."""
    per = (groups + 2) * head_dim
    q = [h * per + g * head_dim + d for h in range(kv_heads) for g in range(groups) for d in range(head_dim)]
    k = [h * per + groups * head_dim + d for h in range(kv_heads) for d in range(head_dim)]
    v = [h * per + (groups + 1) * head_dim + d for h in range(kv_heads) for d in range(head_dim)]
    return [q, k, v]


def _split(index: Any, fused: str, parts: list[str], sizes: list[int] | None, transpose: bool,
           indices: list[list[int]] | None = None) -> None:
    """Views `parts` of the stored tensor `fused` (its .weight and, when present, its .bias)."""
    for suffix in ("weight", "bias"):
        src = f"{fused}.{suffix}"
        if src not in index.stored:
            continue
        shape = index.stored[src].shape
        tr = transpose and len(shape) == 2
        total = shape[1] if tr else shape[0]
        expect = sum(sizes) if sizes is not None else sum(len(i) for i in indices or [])
        if total != expect:
            raise WeightsError(f"fused tensor has {total} output rows, the config implies {expect} "
                               f"({' + '.join(parts)})", tensor=src, file=index.stored[src].file)
        start = 0
        for i, part in enumerate(parts):
            if indices is not None:
                view = TensorView(src, tr, tuple(indices[i]), indexed=True)
            else:
                assert sizes is not None
                view = TensorView(src, tr, (start, start + sizes[i]))
                start += sizes[i]
            index.add_view(f"{part}.{suffix}", view)
        index.hide(src)


def _fused_experts(index: Any, layer: str, n: int, inter: int) -> None:
    """DBRX: an MoE layer's experts stored as three [E*I, H] tensors (w1 gate, v1 up, w2 down transposed),
    read as each expert's canonical gate / up / down projections."""
    for src, proj in (("w1", "gate_proj"), ("v1", "up_proj"), ("w2", "down_proj")):
        name = f"{layer}.mlp.experts.{src}"
        if name not in index.stored:
            continue
        info = index.stored[name]
        if len(info.shape) != 2 or info.shape[0] != n * inter:
            raise WeightsError(f"fused experts of shape {list(info.shape)}, the config implies {n} experts of "
                               f"{inter} rows", tensor=name, file=info.file)
        for e in range(n):
            index.add_view(f"{layer}.mlp.experts.{e}.{proj}.weight",
                           TensorView(name, rows=(e * inter, (e + 1) * inter), transpose_rows=src == "w2"))
        index.hide(name)


def add_arch_views(index: Any, spec: Any) -> None:
    """Canonical views of `spec`'s fused and transposed tensors in `index` (nothing when none are stored)."""
    arch = spec.arch
    hq = spec.num_attention_heads * spec.head_dim
    hk = spec.num_key_value_heads * spec.head_dim
    for i in range(spec.num_hidden_layers):
        layer = f"model.layers.{i}"
        attn = [f"{layer}.self_attn.{p}_proj" for p in "qkv"]
        if arch.fused_qkv is not None:
            fused = f"{layer}.{arch.fused_qkv}"
            if arch.fused_qkv_layout == "qkv_altpack":
                groups = spec.num_attention_heads // spec.num_key_value_heads
                _split(index, fused, attn, None, False, _altpack_rows(spec.num_key_value_heads, groups,
                                                                      spec.head_dim))
            else:
                _split(index, fused, attn, [hq, hk, hk], arch.transposed)
        if arch.moe_fused_experts and spec.is_sparse(i):
            _fused_experts(index, layer, spec.moe.num_experts, spec.moe.expert_size)
        if arch.fused_gate_up is not None:
            inter = spec.intermediate_size
            _split(index, f"{layer}.{arch.fused_gate_up}", [f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj"],
                   [inter, inter], False)
        if arch.transposed:
            for lin in (f"{layer}.self_attn.o_proj", f"{layer}.mlp.up_proj", f"{layer}.mlp.down_proj"):
                name = f"{lin}.weight"
                if name in index.stored and name not in index.views:
                    index.add_view(name, TensorView(name, transpose=True))
