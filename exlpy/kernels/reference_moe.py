"""Pure-torch references of a mixture-of-experts block's ops (exlpy/kernels/moe.py and moe_exl2.py): the routed
experts as one oracle (`moe_experts`), and the sorted-by-expert formulation the kernels run (route, sort, the
grouped gate|up and down over dense or EXL2 experts, combine). Re-exported by exlpy/kernels/reference.py, the one
namespace the dispatch layer and tests use; the MOE_* switches below are read from this module."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from exlpy.quant.experts import ExpertStack


def _act_mul(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    # reference.act_mul, imported on call: reference imports this module at its top (to re-export it)
    from exlpy.kernels.reference import act_mul

    return act_mul(gate, up, kind)


# Above this many (token, expert) pairs, or this many bytes of gathered weights, `moe_experts` runs grouped by
# expert; at or below, each pair gathers its expert's weights. The byte bound keeps large experts (Mixtral's
# 350 MB) from being copied; `_grouped_matmul` gathers under the same bound.
MOE_GATHER_MAX = 16
MOE_GATHER_BYTES = 128 * 2**20


def moe_experts(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, kind: str) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(act(gate_e(h_t)) * up_e(h_t)) with e = ids[t, j]: the routed experts of a
    mixture-of-experts block. h [T, H]; weights, ids [T, k]; w_gate_up [E, 2I, H] (gate rows, then up rows);
    w_down [E, H, I]. Only the experts some token chose are read; never all experts for all tokens.

    The test oracle of the whole block, written independently of the sorted formulation the model runs
    (ops.moe_experts: moe_sort, moe_gate_up, moe_down, moe_combine below). Few pairs (and few bytes): each pair's
    expert weights gathered into a [T*k, ...] batch. More: pairs sorted by expert, one matmul per expert over its
    tokens (the expert counts read on the host)."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    expert_bytes = (w_gate_up[0].numel() + w_down[0].numel()) * w_gate_up.element_size()
    if T * k <= MOE_GATHER_MAX and T * k * expert_bytes <= MOE_GATHER_BYTES:
        x = h.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        gate, up = torch.bmm(w_gate_up.index_select(0, flat), x).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(w_down.index_select(0, flat), _act_mul(gate, up, kind).unsqueeze(-1)).squeeze(-1)
    else:
        order = torch.argsort(flat, stable=True)
        xs = h.index_select(0, order // k)
        counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
        grouped = torch.empty(T * k, h.shape[-1], dtype=h.dtype, device=h.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = (xs[start:start + n] @ w_gate_up[e].t()).chunk(2, dim=-1)
                grouped[start:start + n] = _act_mul(gate, up, kind) @ w_down[e].t()
                start += n
        out = torch.empty_like(grouped)
        out[order] = grouped
    # the k expert outputs of a token summed in fp32 (half precision would round each partial sum)
    return (out.view(T, k, -1).float() * weights.float().unsqueeze(-1)).sum(dim=1).to(h.dtype)


# --- the grouped (sorted-by-expert) formulation of the routed experts, as the CUDA kernels run it -------------
# The (token, slot) pairs of a step are sorted by expert on the device (`moe_sort`); `moe_gate_up` and `moe_down`
# run every expert over its contiguous run of sorted rows. No shape depends on the routing and nothing is read on
# the host, so a decode step with MoE blocks can be captured in a CUDA graph.


def moe_route(logits: torch.Tensor, top_k: int, norm_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k] int64) of router logits [T, E]: softmax in fp32,
    the top k, divided by their L_p norm (norm_p 1: their sum; 0: kept as they are)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_p == 1.0:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    elif norm_p:
        weights = weights / torch.linalg.vector_norm(weights, ord=norm_p, dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def moe_sort(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [N] int64: the pairs p = t * k + j of ids [T, k] sorted by expert, stable; counts [E] int32: pairs
    per expert). N = T * k; sorted row r holds pair order[r], and expert e owns rows sum(counts[:e]) onwards."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount would read a max on the host
    return order, counts


def _sorted_experts(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The expert of each of the n sorted rows, from the counts alone (fixed shape)."""
    ends = counts.to(torch.int64).cumsum(0)
    return torch.searchsorted(ends, torch.arange(n, device=counts.device), right=True)


# CPU tensors take the per-expert slices of `_grouped_matmul` (tests turn this off to run the fixed-shape paths).
MOE_HOST_SLICES = True


def _grouped_matmul(xs: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """xs [N, K] sorted by expert @ w[e]^T (w [E, Nout, K]) for each row's expert e.

    CPU tensors: one matmul per expert over its rows (the counts live in host memory, so reading them costs no
    wait). Elsewhere fixed shapes: few rows gather their experts' weights (only the routed experts are read), more
    rows run every expert over all rows and keep each row's own (the no-Triton fallback; never on a fast path)."""
    N = xs.shape[0]
    if counts.device.type == "cpu" and MOE_HOST_SLICES:
        out = xs.new_empty(N, w.shape[1])
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                out[start:start + c] = xs[start:start + c] @ w[e].t()
                start += c
        return out
    experts = _sorted_experts(counts, N)
    if N * w[0].numel() * w.element_size() <= MOE_GATHER_BYTES:
        return torch.bmm(w.index_select(0, experts), xs.unsqueeze(-1)).squeeze(-1)
    out = xs.new_zeros(N, w.shape[1])
    for e in range(w.shape[0]):
        out = torch.where((experts == e).unsqueeze(-1), xs @ w[e].t(), out)
    return out


def moe_gate_up(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, top_k: int,
                kind: str) -> torch.Tensor:
    """act(gate) * up of every sorted row (`moe_sort`): row r is token order[r] // top_k of x [T, H] through its
    expert's w_gate_up [E, 2I, H] (gate rows, then up rows). Returns [N, I] in sorted order."""
    gate, up = _grouped_matmul(x.index_select(0, order // top_k), counts, w_gate_up).chunk(2, dim=-1)
    return _act_mul(gate, up, kind)


def moe_down(a: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """a [N, I] in sorted order through each row's expert's w_down [E, H, I], written back in pair order: row p
    of the result [N, H] is pair p = t * k + j (unweighted; the caller sums a token's k rows)."""
    ys = _grouped_matmul(a, counts, w_down)
    return torch.empty_like(ys).index_copy_(0, order, ys)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * y[t * k + j] in fp32 (half precision would round each partial sum), in y's dtype:
    [T, H]; with `residual` [T, H], residual + that sum (in the residual's dtype)."""
    T, k = weights.shape
    out = (y.view(T, k, -1).float() * weights.float().unsqueeze(-1)).sum(dim=1).to(y.dtype)
    return out if residual is None else residual + out.to(residual.dtype)


# --- EXL2 experts: the same grouped formulation over packed experts (exlpy/quant/experts.py ExpertStack) --------


def _grouped_exl2(xs: torch.Tensor, counts: torch.Tensor, stack: ExpertStack) -> torch.Tensor:
    """xs [N, K] sorted by expert @ W_e for each row's expert e (W_e dequantized from the stack once, kept in the
    stack's dtype as QuantLinear's CPU path keeps its dense copy). The counts are read on the host."""
    out = xs.new_empty(xs.shape[0], stack.n)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            w = stack.dense(e)
            out[start:start + c] = (xs[start:start + c].to(w.dtype) @ w).to(xs.dtype)
            start += c
    return out


def moe_gate_up_exl2(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, gate: ExpertStack,
                     up: ExpertStack, top_k: int, kind: str) -> torch.Tensor:
    """`moe_gate_up` with each expert's gate and up read from EXL2 stacks ([K=H] -> [n=I] each): act(gate) * up
    of every sorted row, [N, I] in sorted order."""
    xs = x.index_select(0, order // top_k)
    return _act_mul(_grouped_exl2(xs, counts, gate), _grouped_exl2(xs, counts, up), kind)


def moe_down_exl2(a: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, down: ExpertStack) -> torch.Tensor:
    """`moe_down` with the experts' down projections read from an EXL2 stack ([K=I] -> [n=H])."""
    ys = _grouped_exl2(a, counts, down)
    return torch.empty_like(ys).index_copy_(0, order, ys)
