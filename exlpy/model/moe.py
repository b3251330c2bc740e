"""The mixture-of-experts block (Mixtral, Qwen3-MoE): x + sum_j w_j * expert_j(h) with h = norm(x).

Routing as exlpy/config/moe.py describes it: router logits in the compute dtype, softmax in fp32, the top k
experts per token, their weights renormalised where the architecture says, cast back to the compute dtype.
The experts are gated MLPs stacked at load into one [E, 2I, H] gate|up and one [E, H, I] down tensor, run by
`ops.moe_experts` (only the chosen experts' weights are read).
"""

from __future__ import annotations

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.errors import NotSupportedError
from exlpy.kernels import ops
from exlpy.model.batch import ForwardBatch
from exlpy.model.linear import linear_format
from exlpy.model.module import Module
from exlpy.model.norm import block_norm, load_norm_tensors
from exlpy.weights.checks import landed


class MoEMLP(Module):
    """Pre-norm MoE block in place of a layer's MLP. Its grouped path synchronises with the host (expert
    token counts), so a model with one is never captured in a CUDA graph."""

    graph_safe = False

    def __init__(self, config: ExLlamaV2Config, layer_idx: int) -> None:
        super().__init__(config, f"model.layers.{layer_idx}.mlp")
        self.layer_idx = layer_idx
        s = self.spec
        norms = dict(s.arch.norms)
        # The MoE architectures are plain pre-norm blocks; a post-norm or a parallel block would need wiring here.
        assert s.moe is not None and "mlp_post" not in norms and not s.arch.parallel_blocks
        self.moe = s.moe
        self.act = s.features.act
        self.norm_key = f"model.layers.{layer_idx}.{norms['mlp_pre']}"
        self.norm_w: torch.Tensor | None = None
        self.norm_b: torch.Tensor | None = None
        self.router: torch.Tensor | None = None  # [E, H]
        self.w_gate_up: torch.Tensor | None = None  # [E, 2I, H]
        self.w_down: torch.Tensor | None = None  # [E, H, I]
        self.lora = None  # adapters do not reach expert layers (exlpy/lora/ refuses MoE models)

    def tensor_prefixes(self) -> list[str]:
        # all experts' weights are resident (the planner counts them all); a token reads only its k experts'
        return [self.key, self.norm_key]

    def _dense(self, name: str, shape: tuple[int, int], device: torch.device, dt: torch.dtype) -> torch.Tensor:
        prefix = name.rsplit(".", 1)[0]
        fmt = linear_format(self.index, prefix)
        if fmt != "dense":
            raise NotSupportedError(f"{self.index.model_dir}: expert {prefix} is stored as {fmt.upper()}; exlpy "
                                    "runs mixture-of-experts models from fp16/bf16/fp32 weights only for now")
        return landed(self.index, name, self.index.get(name, shape=shape)).to(device=device, dtype=dt)

    def load(self, device: torch.device) -> None:
        s, dt = self.spec, self.dtype(device)
        hid, inter, n = s.hidden_size, self.moe.expert_size, self.moe.num_experts
        self.norm_w, self.norm_b = load_norm_tensors(self, self.norm_key, device)
        self.router = self._dense(f"{self.key}.router.weight", (n, hid), device, dt)
        gate_up, down = [], []
        for e in range(n):
            p = f"{self.key}.experts.{e}"
            gate_up.append(torch.cat([self._dense(f"{p}.gate_proj.weight", (inter, hid), device, dt),
                                      self._dense(f"{p}.up_proj.weight", (inter, hid), device, dt)]))
            down.append(self._dense(f"{p}.down_proj.weight", (hid, inter), device, dt))
        self.w_gate_up = torch.stack(gate_up)
        self.w_down = torch.stack(down)
        if s.features.residual_scale != 1.0:
            self.w_down.mul_(s.features.residual_scale)
        self.device = device

    def unload(self) -> None:
        self.norm_w = self.norm_b = self.router = self.w_gate_up = self.w_down = None
        super().unload()

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in the compute dtype, expert ids [T, k]) of the normed tokens h [T, H]."""
        assert self.router is not None
        probs = torch.softmax((h @ self.router.t()).float(), dim=-1)
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_p == 1.0:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        elif self.moe.norm_p:
            weights = weights / torch.linalg.vector_norm(weights, ord=self.moe.norm_p, dim=-1, keepdim=True)
        return weights.to(h.dtype), ids

    async def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.norm_w is not None and self.w_gate_up is not None and self.w_down is not None
        h = block_norm(x, self.norm_w, self.norm_b, self.spec).to(self.norm_w.dtype).reshape(-1, x.shape[-1])
        weights, ids = self.route(h)
        out = ops.moe_experts(h, weights, ids, self.w_gate_up, self.w_down, self.act)
        return x + out.view(x.shape).to(x.dtype)
