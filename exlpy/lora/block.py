"""What an adapted block computes: the hooks Attention and MLP call when a step has rows with adapters.

Each hook runs the block's own projections as the plain path does (fused q|k|v and gate|up where the block
has them, otherwise the parts) and adds the adapters' outputs with the segmented kernels (ops.lora_*):
  q|k|v:   one shrink over the normed input for all three parts (the norm computed inside), one expand into
           the fused output, before RoPE;
  gate|up: one shrink, then one kernel adds the adapters to gate and up and applies SwiGLU (and, for a few
           tokens, emits the down projection's shrink partials too);
  o, down: `closing` returns the function `close_block` calls between the closing projection's GEMM and its
           collective: it adds the adapter's output to this GPU's partial (or column slice), so the block's
           existing all-reduce sums the adapter's contributions with the base ones.
Rows whose slot is -1 get exactly the plain block's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from exlpy.kernels import ops
from exlpy.lora.buffers import BlockSlots
from exlpy.model.batch import ForwardBatch
from exlpy.model.parallel_linear import ColumnParallel

Closing = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class BlockLora(BlockSlots):
    """Slot buffers of one block copy plus the hooks its forward calls (attached as `module.lora`)."""

    def project_qkv(self, attn: Any, x: torch.Tensor, batch: ForwardBatch
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        eps = attn.spec.norm_eps
        if attn.qkv_proj is not None:
            y = attn.qkv_proj.forward_normed(x, attn.norm_w, eps)
            src, norm = x, attn.norm_w
        else:
            h = ops.rms_norm(x, attn.norm_w, eps)
            y = torch.cat([attn.q_proj.forward(h), attn.k_proj.forward(h), attn.v_proj.forward(h)], dim=-1)
            src, norm = h, None
        g = self.groups.get("qkv")
        if g is not None:
            u = ops.lora_shrink(src, g.a, g.ranks, batch.adapters, batch.q_len, norm, eps)
            y = ops.lora_expand(y, u, g.b, g.ranks, batch.adapters, batch.q_len, g.bounds)
        return y.split([attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features], dim=-1)

    def activation(self, mlp: Any, x: torch.Tensor, batch: ForwardBatch
                   ) -> tuple[torch.Tensor | None, Closing | None]:
        """silu(gate) * up with the adapters added to gate and up (None on a tensor-parallel GPU holding no
        intermediate slice), and the closing hook for down_proj."""
        if mlp.gate_proj is None or mlp.up_proj is None:
            return None, self.closing(batch, "down")
        eps = mlp.spec.norm_eps
        if mlp.gate_up_proj is not None:
            gu = mlp.gate_up_proj.forward_normed(x, mlp.norm_w, eps)
            src, norm = x, mlp.norm_w
        else:
            h = ops.rms_norm(x, mlp.norm_w, eps)
            gu = torch.cat([mlp.gate_proj.forward(h), mlp.up_proj.forward(h)], dim=-1)
            src, norm = h, None
        g, down = self.groups.get("gate_up"), self.groups.get("down")
        if g is None:
            inter = gu.shape[-1] // 2
            return ops.silu_mul(gu[..., :inter], gu[..., inter:]), self.closing(batch, "down")
        # down_proj's shrink rides along when its input is this activation as computed here (not after an
        # all-gather, as a column-parallel closer's is).
        fuse = down is not None and not isinstance(mlp.down_proj, ColumnParallel)
        u = ops.lora_shrink(src, g.a, g.ranks, batch.adapters, batch.q_len, norm, eps)
        act, pre = ops.lora_expand_swiglu(gu, u, g.b, g.ranks, batch.adapters, batch.q_len,
                                          down.a if fuse and down else None, down.ranks if fuse and down else None)
        return act, self.closing(batch, "down", pre)

    def closing(self, batch: ForwardBatch, group: str, pre: torch.Tensor | None = None) -> Closing | None:
        """y += adapter(h) for a closing projection, h its input as the projection sees it and y its output
        before the collective; `pre`: the shrink already computed (fused into the activation)."""
        g = self.groups.get(group)
        if g is None:
            return None

        def add(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            u = pre if pre is not None else ops.lora_shrink(h, g.a, g.ranks, batch.adapters, batch.q_len)
            return ops.lora_expand(y, u, g.b, g.ranks, batch.adapters, batch.q_len)
        return add
