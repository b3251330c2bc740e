"""The mixture-of-experts block (Mixtral, Qwen3-MoE, DBRX): x + sum_j w_j * expert_j(h) with h = norm(x).

Routing as exlpy/config/moe.py describes it: router logits in the compute dtype, softmax in fp32, the top k
experts per token, their weights renormalised where the architecture says, cast back to the compute dtype.
Dense experts are stacked at load into one [E, 2I, H] gate|up and one [E, H, I] down tensor, run by
`ops.moe_experts`: the (token, expert) pairs sorted by expert on the device and two grouped launches (only the
chosen experts' weights are read, nothing is read on the host), so the block is captured in the decode step's
CUDA graph like a dense MLP. EXL2 experts (exllamav2's and exlpy's converted models) are stacked at load per
projection (exlpy/quant/experts.py: packed rows end to end, per-row tables of act order, code position, width and
group) and run by `ops.moe_experts_exl2`: the same sort and combine, gate|up and down as one grouped launch each
reading the routed experts' packed weights, also inside the graph. GPTQ experts (or a mix of formats) stay one
linear each, read packed, and run grouped by expert with the counts read on the host (`grouped_experts`): a model
with them runs eagerly.
"""

from __future__ import annotations

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.kernels import ops
from exlpy.model.batch import ForwardBatch
from exlpy.model.linear import Linear, linear_format, load_linear
from exlpy.model.module import Module
from exlpy.model.norm import block_norm, load_norm_tensors
from exlpy.quant.experts import ExpertStack, load_exl2_experts
from exlpy.weights.checks import landed


class MoEMLP(Module):
    """Pre-norm MoE block in place of a layer's MLP. `graph_safe` (set at load): the experts are dense or EXL2
    stacks, so the block never synchronises with the host; other quantized experts read their token counts there
    (no CUDA graph)."""

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
        self.packed: tuple[ExpertStack, ExpertStack, ExpertStack] | None = None  # (gate, up, down): all EXL2
        self.experts: list[tuple[Linear, Linear, Linear]] | None = None  # (gate, up, down): GPTQ or mixed formats
        self.lora = None  # adapters do not reach expert layers (exlpy/lora/ refuses MoE models)

    def tensor_prefixes(self) -> list[str]:
        # all experts' weights are resident (the planner counts them all); a token reads only its k experts'
        return [self.key, self.norm_key]

    def active_weight_bytes(self) -> int:
        """Stored bytes one token reads: the router, the norm and k of the E experts (on average)."""
        experts = sum(t.nbytes for n, t in self.index.tensors.items() if n.startswith(f"{self.key}.experts."))
        k = self.config.num_experts_per_token or self.moe.top_k
        return self.weight_bytes() - experts + experts * k // self.moe.num_experts

    def _dense(self, name: str, shape: tuple[int, int], device: torch.device, dt: torch.dtype) -> torch.Tensor:
        return landed(self.index, name, self.index.get(name, shape=shape).to(device=device, dtype=dt))

    def load(self, device: torch.device) -> None:
        s, dt = self.spec, self.dtype(device)
        hid, inter, n = s.hidden_size, self.moe.expert_size, self.moe.num_experts
        scale = s.features.residual_scale
        self.norm_w, self.norm_b = load_norm_tensors(self, self.norm_key, device)
        self.router = self._dense(f"{self.key}.router.weight", (n, hid), device, dt)
        prefixes = [f"{self.key}.experts.{e}" for e in range(n)]
        projs = ("gate_proj", "up_proj", "down_proj")
        formats = {linear_format(self.index, f"{p}.{proj}") for p in prefixes for proj in projs}
        biased = any(f"{p}.{proj}.bias" in self.index for p in prefixes for proj in projs)
        if formats == {"exl2"} and not biased:
            self.packed = (load_exl2_experts(self.index, prefixes, "gate_proj", hid, inter, device, dt),
                           load_exl2_experts(self.index, prefixes, "up_proj", hid, inter, device, dt),
                           load_exl2_experts(self.index, prefixes, "down_proj", inter, hid, device, dt, scale))
        elif formats != {"dense"}:
            kw = {"gptq_v2": s.gptq_v2}
            self.experts = [(load_linear(self.index, f"{p}.gate_proj", hid, inter, device, dt, **kw),
                             load_linear(self.index, f"{p}.up_proj", hid, inter, device, dt, **kw),
                             load_linear(self.index, f"{p}.down_proj", inter, hid, device, dt, prescale=scale, **kw))
                            for p in prefixes]
        else:
            # filled expert by expert: the peak is the stacked tensors plus one expert, not twice the experts
            self.w_gate_up = torch.empty(n, 2 * inter, hid, device=device, dtype=dt)
            self.w_down = torch.empty(n, hid, inter, device=device, dtype=dt)
            for e, p in enumerate(prefixes):
                self.w_gate_up[e, :inter] = self._dense(f"{p}.gate_proj.weight", (inter, hid), device, dt)
                self.w_gate_up[e, inter:] = self._dense(f"{p}.up_proj.weight", (inter, hid), device, dt)
                self.w_down[e] = self._dense(f"{p}.down_proj.weight", (hid, inter), device, dt)
            if scale != 1.0:
                self.w_down.mul_(scale)
        # the EXL2 kernels fuse SiLU and tanh-GELU; another activation takes the torch reference, which reads the
        # expert counts on the host
        self.graph_safe = self.experts is None and (self.packed is None or self.act in ("silu", "gelu_tanh"))
        self.device = device

    def unload(self) -> None:
        self.norm_w = self.norm_b = self.router = self.w_gate_up = self.w_down = self.experts = self.packed = None
        self.graph_safe = False
        super().unload()

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in the compute dtype, expert ids [T, k]) of the normed tokens h [T, H]."""
        assert self.router is not None
        k = self.config.num_experts_per_token or self.moe.top_k  # the config's, or exllamav2's -ept override
        return ops.moe_route(h @ self.router.t(), k, self.moe.norm_p)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The block's normed input h [T, H] in the compute dtype (the router's and the experts' input)."""
        assert self.norm_w is not None
        return block_norm(x, self.norm_w, self.norm_b, self.spec).to(self.norm_w.dtype).reshape(-1, x.shape[-1])

    async def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.normed(x)
        weights, ids = self.route(h)
        if self.experts is not None:
            out = grouped_experts(h, weights, ids, self.experts, self.act)
            return x + out.view(x.shape).to(x.dtype)
        if self.packed is not None:
            out = ops.moe_experts_exl2(h, weights, ids, *self.packed, self.act, x.reshape(h.shape))
            return out.view(x.shape)
        assert self.w_gate_up is not None and self.w_down is not None
        out = ops.moe_experts(h, weights, ids, self.w_gate_up, self.w_down, self.act, x.reshape(h.shape))
        return out.view(x.shape)


def grouped_experts(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: list[tuple[Linear, Linear, Linear]], act: str) -> torch.Tensor:
    """`ops.moe_experts` over experts that are linears of any format (EXL2 / GPTQ read packed): the (token,
    expert) pairs sorted by expert, each active expert run once over its tokens (counts read on the host)."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xs = h.index_select(0, order // k)
    grouped = torch.empty(T * k, h.shape[-1], dtype=h.dtype, device=h.device)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=len(experts)).tolist()):
        if n:
            gate, up, down = experts[e]
            seg = xs[start:start + n]
            grouped[start:start + n] = down.forward(ops.act_mul(gate.forward(seg), up.forward(seg), act))
            start += n
    out = torch.empty_like(grouped)
    out[order] = grouped
    return (out.view(T, k, -1).float() * weights.float().unsqueeze(-1)).sum(dim=1).to(h.dtype)
