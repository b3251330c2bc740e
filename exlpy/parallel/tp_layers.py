"""Tensor-parallel modules: attention, MLP and the final norm + head, sharded over the TPContext's slots.

The residual stream is replicated: every slot holds the full hidden state and runs the (cheap) RMSNorm itself.
Each module is a list of *stages*; a stage runs on every slot and returns a tensor that is then summed over the
slots in place (one all-reduce), after which it either becomes the new residual ("replace": the first slot's
closing GEMM already added the residual, in its epilogue), is added to the residual ("residual"), or becomes
the next stage's input ("input"). The eager runner and the CUDA-graph runner share these stage functions.

Per slot, q/k/v shards are one fused GEMM and gate/up another (dense weights), and every dense projection goes
through `ops.linear_add`: the single-row Triton GEMV at decode (cuBLAS picks split-K GEMVs plus a reduce kernel
there), cuBLAS with beta=1 into the residual for prefill.

Two layouts for the projections that close a block (o_proj, down_proj):
- "row" (Megatron): the input dim is split like the heads / intermediate, partial sums are all-reduced: one
  collective per block. Used for dense weights.
- "column" (spec §7.4): the closing projection is split by output columns (rs_split), so its full input is
  all-gathered first: two collectives per block. Used for EXL2 weights, whose row split would need
  group-aligned ranges and the permutation.
`EXLPY_TP_MODE=column` forces the column layout for dense weights too (benchmarks compare both).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.kernels import ops
from exlpy.model.batch import ForwardBatch
from exlpy.model.fusion import fuse_dense
from exlpy.model.layers import MLP, Attention, Head, RMSNorm, attend
from exlpy.model.linear import DenseLinear, Linear
from exlpy.parallel.tp_context import TPContext


@dataclass
class SlotState:
    """One slot's view of a forward pass."""

    slot: int
    device: torch.device
    x: torch.Tensor  # the replicated residual [B, T, hidden], owned by this slot (updated in place)
    batch: ForwardBatch
    cache: Any = None  # this slot's cache (holding its KV heads) or None
    red: torch.Tensor | None = None  # the last stage's output, summed over slots
    pending: str = ""  # what `red` becomes before the next stage: "residual" | "input"
    inp: torch.Tensor | None = None
    static_attn: bool = False  # graph capture: attend over the whole cache, lengths read from device memory
    last_only: bool = False
    last_state: torch.Tensor | None = None

    def enter(self) -> None:
        if self.pending == "replace":
            assert self.red is not None
            self.x = self.red
        elif self.pending == "residual":
            assert self.red is not None
            self.x.add_(self.red)
        elif self.pending == "input":
            self.inp = self.red
        self.pending = ""


@dataclass
class Stage:
    fn: Callable[[SlotState], torch.Tensor]
    then: str  # "replace" | "residual" | "input" | "out" (the head: slices are gathered, not reduced)


def tp_mode() -> str:
    mode = os.environ.get("EXLPY_TP_MODE", "auto")
    return mode if mode in ("auto", "row", "column") else "auto"


def split_rows(lin: Linear, start: int, end: int, device: torch.device, keep_bias: bool) -> DenseLinear | None:
    """A dense linear restricted to input features [start, end) (None for formats without a row split)."""
    if not isinstance(lin, DenseLinear):
        return None
    bias = lin.bias.to(device) if keep_bias and lin.bias is not None else None
    return DenseLinear(lin.weight[:, start:end].to(device).contiguous(), bias)


def cols(lin: Linear, start: int, end: int, device: torch.device) -> Linear:
    """`lin.split_columns` that never keeps the full weight alive: a row slice of a dense weight on its own
    device is a view of the whole matrix (seen on GPU: +4.4 GB on the staging device for 8 70B-shaped layers)."""
    part = lin.split_columns(start, end, device)
    if isinstance(part, DenseLinear) and part.weight.untyped_storage().nbytes() > part.weight.nbytes:
        part = DenseLinear(part.weight.clone(), None if part.bias is None else part.bias.clone())
    return part


def matmul(lin: Linear, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`residual + lin(x)` (just `lin(x)` without a residual). Dense weights use `ops.linear_add`, which on CUDA
    writes the sum into `residual` (callers use the return value)."""
    if isinstance(lin, DenseLinear):
        if residual is not None and not residual.is_contiguous():
            residual = residual.contiguous()
        y = ops.linear_add(x, lin.weight, residual)
        return y if lin.bias is None else y.add_(lin.bias)
    y = lin.forward(x)
    return y if residual is None else residual + y


def fused(parts: list[Linear]) -> Linear | None:
    """One dense linear over `parts` side by side (one GEMM/GEMV per slot instead of len(parts)), or None."""
    f = fuse_dense(parts)
    return None if f is None else DenseLinear(f.weight, f.bias)


def _zeros_like_full(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.zeros(*x.shape[:-1], width, dtype=x.dtype, device=x.device)


def _place(full_width: int, part: torch.Tensor | None, start: int, like: torch.Tensor) -> torch.Tensor:
    """`part` written at column `start` of a zeroed full-width tensor (an all-gather by all-reduce)."""
    out = _zeros_like_full(like, full_width)
    if part is not None:
        out[..., start:start + part.shape[-1]] = part
    return out


class TPAttention:
    def __init__(self, ctx: TPContext, attn: Attention) -> None:
        s = attn.spec
        self.layer_idx = attn.layer_idx
        self.key = attn.key
        self.eps = s.norm_eps
        self.scale = attn.scale
        self.head_dim = D = attn.head_dim
        self.hidden = s.hidden_size
        self.num_heads = attn.num_heads
        assert attn.q_proj and attn.k_proj and attn.v_proj and attn.o_proj and attn.norm_w is not None
        row = tp_mode() != "column" and isinstance(attn.o_proj, DenseLinear)
        self.mode = "row" if row else "column"
        self.shards: dict[int, dict[str, Any]] = {}
        first = ctx.all_devices()[0]
        for slot, ka, kb in ctx.kv_split:
            dev = ctx.all_devs[slot]
            qa, qb = ctx.slot_range(4, slot)
            sh: dict[str, Any] = {
                "norm": attn.norm_w.to(dev), "hq": qb - qa, "hk": kb - ka, "qa": qa,
                "q": cols(attn.q_proj, qa * D, qb * D, dev),
                "k": cols(attn.k_proj, ka * D, kb * D, dev),
                "v": cols(attn.v_proj, ka * D, kb * D, dev),
                "q_norm": None if attn.q_norm_w is None else attn.q_norm_w.to(dev),
                "k_norm": None if attn.k_norm_w is None else attn.k_norm_w.to(dev),
                "cos": ctx.cos[slot], "sin": ctx.sin[slot],
            }
            sh["qkv"] = fused([sh["q"], sh["k"], sh["v"]])
            if sh["qkv"] is not None:  # the parts are views of the fused weight now; only it is used
                sh["q"] = sh["k"] = sh["v"] = None
            if row:
                sh["o"] = split_rows(attn.o_proj, qa * D, qb * D, dev, keep_bias=slot == first)
                sh["adds_residual"] = slot == first
            self.shards[slot] = sh
        if not row:
            for slot, a, b in ctx.rs_split:
                self.shards.setdefault(slot, {})["o_cols"] = cols(attn.o_proj, a, b, ctx.all_devs[slot])
                self.shards[slot]["rs"] = a

    def stages(self) -> list[Stage]:
        if self.mode == "row":
            return [Stage(self._row, "replace")]
        return [Stage(self._heads_gathered, "input"), Stage(self._o_cols, "residual")]

    def _heads(self, st: SlotState) -> torch.Tensor:
        sh = self.shards[st.slot]
        x = st.x
        B, T, _ = x.shape
        D = self.head_dim
        h = ops.rms_norm(x, sh["norm"], self.eps)
        if sh["qkv"] is not None:
            q, k, v = matmul(sh["qkv"], h).split([sh["hq"] * D, sh["hk"] * D, sh["hk"] * D], dim=-1)
        else:
            q, k, v = matmul(sh["q"], h), matmul(sh["k"], h), matmul(sh["v"], h)
        q = q.view(B, T, sh["hq"], D)
        k = k.view(B, T, sh["hk"], D)
        v = v.view(B, T, sh["hk"], D)
        if sh["q_norm"] is not None:
            q = ops.rms_norm(q, sh["q_norm"], self.eps)
            k = ops.rms_norm(k, sh["k_norm"], self.eps)
        q, k = ops.apply_rope(q, k, sh["cos"], sh["sin"], st.batch.rope_pos)
        return self._attend(q, k, v, st).reshape(B, T, sh["hq"] * D)

    def _row(self, st: SlotState) -> torch.Tensor:
        """This slot's partial o_proj; the first slot adds the residual in the GEMM, so the all-reduced sum is
        the next residual (no separate add pass over [rows, hidden] on every slot)."""
        sh = self.shards[st.slot]
        o = self._heads(st)
        return matmul(sh["o"], o, st.x if sh["adds_residual"] else None)

    def _heads_gathered(self, st: SlotState) -> torch.Tensor:
        o = self._heads(st)
        return _place(self.num_heads * self.head_dim, o, self.shards[st.slot]["qa"] * self.head_dim, st.x)

    def _o_cols(self, st: SlotState) -> torch.Tensor:
        sh = self.shards.get(st.slot, {})
        assert st.inp is not None
        y = matmul(sh["o_cols"], st.inp) if "o_cols" in sh else None
        return _place(self.hidden, y, sh.get("rs", 0), st.x)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, st: SlotState) -> torch.Tensor:
        return attend(q, k, v, st.batch, st.cache, self.layer_idx, self.scale, static=st.static_attn)


class TPMLP:
    def __init__(self, ctx: TPContext, mlp: MLP) -> None:
        s = mlp.spec
        assert mlp.gate_proj and mlp.up_proj and mlp.down_proj and mlp.norm_w is not None
        self.key = mlp.key
        self.eps = s.norm_eps
        self.hidden = s.hidden_size
        self.intermediate = s.intermediate_size
        row = tp_mode() != "column" and isinstance(mlp.down_proj, DenseLinear)
        self.mode = "row" if row else "column"
        first = ctx.all_devices()[0]
        self.shards: dict[int, dict[str, Any]] = {s_: {"norm": mlp.norm_w.to(ctx.all_devs[s_])}
                                                  for s_ in ctx.all_devices()}
        for slot, a, b in ctx.id_split:
            dev = ctx.all_devs[slot]
            sh = self.shards[slot]
            gate, up = cols(mlp.gate_proj, a, b, dev), cols(mlp.up_proj, a, b, dev)
            gate_up = fused([gate, up])
            sh.update(gate_up=gate_up, gate=None if gate_up else gate, up=None if gate_up else up, ia=a, n=b - a)
            if row:
                sh["down"] = split_rows(mlp.down_proj, a, b, dev, keep_bias=slot == first)
        if row and mlp.down_proj.bias is not None and "down" not in self.shards[first]:
            self.shards[first]["bias"] = mlp.down_proj.bias.to(ctx.all_devs[first])  # first slot adds the bias
        self.shards[first]["adds_residual"] = True
        if not row:
            for slot, a, b in ctx.rs_split:
                self.shards[slot].update(down_cols=cols(mlp.down_proj, a, b, ctx.all_devs[slot]), rs=a)

    def stages(self) -> list[Stage]:
        if self.mode == "row":
            return [Stage(self._row, "replace")]
        return [Stage(self._act_gathered, "input"), Stage(self._down_cols, "residual")]

    def _act(self, st: SlotState) -> torch.Tensor | None:
        sh = self.shards[st.slot]
        if "ia" not in sh:
            return None
        h = ops.rms_norm(st.x, sh["norm"], self.eps)
        if sh["gate_up"] is not None:
            gate, up = matmul(sh["gate_up"], h).split([sh["n"], sh["n"]], dim=-1)
        else:
            gate, up = matmul(sh["gate"], h), matmul(sh["up"], h)
        return ops.silu_mul(gate, up)

    def _row(self, st: SlotState) -> torch.Tensor:
        """Partial down_proj; the first slot adds the residual in the GEMM (see TPAttention._row)."""
        sh = self.shards[st.slot]
        res = st.x if sh.get("adds_residual") else None
        a = self._act(st)
        if a is None:  # no intermediate share on this slot
            if res is None:
                return torch.zeros_like(st.x)
            return res.add_(sh["bias"]) if "bias" in sh else res
        return matmul(sh["down"], a, res)

    def _act_gathered(self, st: SlotState) -> torch.Tensor:
        return _place(self.intermediate, self._act(st), self.shards[st.slot].get("ia", 0), st.x)

    def _down_cols(self, st: SlotState) -> torch.Tensor:
        sh = self.shards[st.slot]
        assert st.inp is not None
        y = matmul(sh["down_cols"], st.inp) if "down_cols" in sh else None
        return _place(self.hidden, y, sh.get("rs", 0), st.x)


class TPHead:
    """Final RMSNorm (replicated on every slot) and the head split by vocabulary columns (vc_split)."""

    def __init__(self, ctx: TPContext, norm: RMSNorm, head: Head) -> None:
        assert norm.weight is not None and head.linear is not None
        self.eps = norm.spec.norm_eps
        self.norm = {s: norm.weight.to(ctx.all_devs[s]) for s in ctx.all_devices()}
        self.heads = {slot: cols(head.linear, a, b, ctx.all_devs[slot]) for slot, a, b in ctx.vc_split}

    def stages(self) -> list[Stage]:
        return [Stage(self._logits, "out")]

    def _logits(self, st: SlotState) -> torch.Tensor:
        x = st.x[:, -1:] if st.last_only else st.x
        h = ops.rms_norm(x, self.norm[st.slot], self.eps)
        st.last_state = h
        head = self.heads.get(st.slot)
        return matmul(head, h) if head is not None else h.new_empty(*h.shape[:-1], 0)
