"""Pure-torch references of every fused op. They are the CPU path and the oracle for the Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlpy.cache import qcodec

# The sampling ops', the MoE ops' and the quantized-weight ops' references live in modules of their own (seams
# along their kernels); this module re-exports them, the references' one namespace.
from exlpy.kernels.reference_moe import (  # noqa: F401 - re-exported
    moe_combine,
    moe_down,
    moe_down_exl2,
    moe_experts,
    moe_gate_up,
    moe_gate_up_exl2,
    moe_route,
    moe_sort,
)
from exlpy.kernels.reference_quant import (  # noqa: F401 - re-exported
    act_order,
    gptq_block,
    quant_matmul,
    rms_norm_act_order,
)
from exlpy.kernels.reference_sampling import (  # noqa: F401 - re-exported
    philox_uniform,
    sample_top,
    sample_top_candidates,
    sorted_draw,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * w over the last dim, computed in fp32 as transformers does; in the weight's dtype (the
    compute dtype: an fp32 residual stream, Gemma 2's, is normed into it)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(weight.dtype)


def rms_norm_add(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x + rms_norm(y, weight, eps): a post-norm block's residual add (x may be fp32, Gemma 2). The CUDA
    version writes the sum into x and returns it; callers use the return value."""
    return x + rms_norm(y, weight, eps)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += r in place (rounded to x's dtype), then rms_norm(x, weight, eps): a two-GPU all-reduce's last step
    (this GPU's partial plus the peer's, exlpy/parallel/tp_copy.py) with the next block's input norm. Returns the
    norm; x holds the sum, the next residual."""
    x.add_(r)
    return rms_norm(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(x - mean) / std * w + b over the last dim, statistics in fp32 (as transformers' LayerNorms and
    Cohere's bias-free one); the weight may be [H, D] over the last two dims (Cohere's per-head q/k norm)."""
    xf = x.float()
    y = (xf - xf.mean(-1, keepdim=True)) * torch.rsqrt(xf.var(-1, keepdim=True, unbiased=False) + eps)
    y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.result_type(x, weight))


def act(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The MLP activation: silu, gelu_tanh (GELU's tanh approximation), gelu (exact, erf) or relu."""
    if kind == "silu":
        return F.silu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "gelu":
        return F.gelu(x)
    if kind == "relu":
        return F.relu(x)
    raise ValueError(f"unknown activation {kind!r}")


def act_mul(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """act(gate) * up: a gated MLP's activation (SwiGLU, GeGLU)."""
    return act(gate, kind) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NEOX rotary embedding. q [B,T,Hq,D], k [B,T,Hk,D], cos/sin [S,D] tables, positions [B,T] int64."""
    c = cos[positions].unsqueeze(2)  # [B,T,1,D]
    s = sin[positions].unsqueeze(2)
    return ((q * c + rotate_half(q) * s).to(q.dtype), (k * c + rotate_half(k) * s).to(k.dtype))


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x @ weight^T (weight [N, K] as in F.linear); just the product when residual is None.

    The CUDA version may write the sum into `residual` and return it; callers use the return value.
    """
    y = F.linear(x, weight)
    return y if residual is None else residual + y


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """rms_norm(x, norm_weight, eps) @ weight^T: a pre-norm block's first projection."""
    return F.linear(rms_norm(x, norm_weight, eps), weight)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write k/v [B,T,H,D] into flat cache rows `slots` [B,T] of caches viewed as [rows*S, H, D].

    Negative slots are skipped: padding rows of a batch-size bucket (CUDA graphs) write nowhere.
    """
    kf = k_cache.view(-1, *k_cache.shape[-2:])
    vf = v_cache.view(-1, *v_cache.shape[-2:])
    idx = slots.reshape(-1)
    ks, vs = k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:])
    if bool((idx < 0).any()):
        keep = idx >= 0
        idx, ks, vs = idx[keep], ks[keep], vs[keep]
    kf.index_copy_(0, idx, ks.to(kf.dtype))
    vf.index_copy_(0, idx, vs.to(vf.dtype))


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope then store_kv of the rotated k (and v); returns the rotated (q, k).

    The CUDA version rotates q and k in place and writes the cache in the same kernel.
    """
    q, k = apply_rope(q, k, cos, sin, positions)
    store_kv(k_cache, v_cache, slots, k, v)
    return q, k


def norm_linear_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
                       ) -> torch.Tensor:
    """silu(gate) * up of norm_linear with weight [2I, K] = [gate; up] stacked by rows: [..., I]."""
    gate, up = norm_linear(x, norm_weight, eps, weight).chunk(2, dim=-1)
    return silu_mul(gate, up)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """Gather the first `length` tokens of every sequence: cache [rows, S, H, D] -> [B, length, H, D]."""
    t = torch.arange(length, device=cache.device)
    pages = block_table[:, t // page_size].long()  # [B, L]
    slots = pages * page_size + (t % page_size)
    flat = cache.view(-1, *cache.shape[-2:])
    return flat[slots]


def _cache_mask(positions: torch.Tensor, seqlens: torch.Tensor, max_seqlen: int,
                key_mask: torch.Tensor | None, window: int = 0, limits: torch.Tensor | None = None
                ) -> torch.Tensor:
    """[B,1,T,L] keep-mask: key t is visible to query i of row b when t <= positions[b,i] (limits[b,i] when
    given), t < seqlens[b] (and, with a sliding window, positions[b,i] - t < window)."""
    t = torch.arange(max_seqlen, device=positions.device)
    last = positions if limits is None else limits
    mask = (t.view(1, 1, -1) <= last.unsqueeze(-1)) & (t.view(1, 1, -1) < seqlens.view(-1, 1, 1))
    if window:
        mask = mask & (positions.unsqueeze(-1) - t.view(1, 1, -1) < window)
    if key_mask is not None:
        mask = mask & key_mask[:, None, :max_seqlen]
    return mask.unsqueeze(1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    page_size: int, seqlens: torch.Tensor, max_seqlen: int, positions: torch.Tensor,
                    scale: float, key_mask: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0, limits: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [B,T,Hq,D] over cached keys.

    Query i of row b sits at absolute position positions[b,i] and sees keys t <= positions[b,i] with
    t < seqlens[b] (and key_mask[b,t] when given; and positions[b,i] - t < window with a sliding window).
    Scores are soft-capped (softcap * tanh(s / softcap)) when softcap > 0. `limits` [B,T] (>= positions):
    query i sees keys up to limits[b,i] instead, the window still counted from its position (Gemma 3's image
    tokens see the rest of their image: exlpy/vision/mm.py). Returns [B,T,Hq,D].
    """
    k = gather_kv(k_cache, block_table, page_size, max_seqlen)  # [B,L,Hk,D]
    v = gather_kv(v_cache, block_table, page_size, max_seqlen)
    mask = _cache_mask(positions, seqlens, max_seqlen, key_mask, window, limits)
    return sdpa(q, k, v, scale, mask, softcap=softcap)


def flash_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    page_size: int, seqlens: torch.Tensor, max_seqlen: int, positions: torch.Tensor,
                    scale: float, key_mask: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0, limits: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention`'s contract for query blocks of any length (prefill chunks, verify steps): the CUDA
    version is the flash kernel, which reads K/V from the cache in place and never builds the [T, L] mask."""
    return paged_attention(q, k_cache, v_cache, block_table, page_size, seqlens, max_seqlen, positions, scale,
                           key_mask, window, softcap, limits)


def _dequant_rows(codes: torch.Tensor, scales: torch.Tensor | None, bits: int, dtype: torch.dtype
                  ) -> torch.Tensor:
    """Quantized cache rows [..., W] -> values [..., E]; scales None is the FP8 cache."""
    if scales is None:
        return qcodec.fp8_decode(codes, dtype)
    return qcodec.dequantize(codes, scales, bits, dtype)


def _overwrite_step_rows(vals: torch.Tensor, new: torch.Tensor, positions: torch.Tensor, max_seqlen: int
                         ) -> torch.Tensor:
    """vals [B, L, H, D] with the step's own rows new [B, T, H, D] written at positions[b, 0] + i (those below
    max_seqlen). No boolean indexing: rows past the end go to a spare position that is then dropped, so the
    shapes never depend on the data and the op runs inside a CUDA-graph capture (the quantized-cache decode of
    head sizes the Triton kernel lacks takes this path on CUDA)."""
    B, T = new.shape[:2]
    t = positions[:, :1] + torch.arange(T, device=vals.device)  # [B, T] positions of the step's rows
    t = torch.where((t >= 0) & (t < max_seqlen), t, max_seqlen)
    out = torch.cat([vals, vals.new_zeros(B, 1, *vals.shape[2:])], dim=1)
    out[torch.arange(B, device=vals.device).view(-1, 1), t] = new.to(vals.dtype)
    return out[:, :max_seqlen]


def quant_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor | None, v_codes: torch.Tensor,
                    v_scales: torch.Tensor | None, block_table: torch.Tensor, page_size: int, seqlens: torch.Tensor,
                    max_seqlen: int, positions: torch.Tensor, scale: float, k_bits: int, v_bits: int,
                    key_mask: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                    limits: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention` over a quantized cache (exlpy.cache.quant layout): codes [rows, S, W] uint8 and fp16
    group scales [rows, S, Hkv*D/32] per K and V, `*_bits` 4 or 8; scales None means the FP8 cache (8 bits).

    With `k_new`/`v_new` [B,T,Hkv,D] (this step's own K/V, the step's tokens at consecutive positions from
    positions[b, 0]), keys at those positions are taken unquantized from them, as exllamav2 attends over its
    fp16 working copy in which the step's rows are still fresh."""
    B, T, Hq, D = q.shape
    kv = []
    for codes, scales, bits, new in ((k_codes, k_scales, k_bits, k_new), (v_codes, v_scales, v_bits, v_new)):
        c = gather_kv(codes.reshape(-1, 1, codes.shape[-1]), block_table, page_size, max_seqlen)
        s = None if scales is None else gather_kv(scales.reshape(-1, 1, scales.shape[-1]), block_table,
                                                  page_size, max_seqlen)
        vals = _dequant_rows(c.squeeze(2), None if s is None else s.squeeze(2), bits, q.dtype)
        vals = vals.view(B, max_seqlen, -1, D)
        if new is not None:
            vals = _overwrite_step_rows(vals, new, positions, max_seqlen)
        kv.append(vals)
    return sdpa(q, kv[0], kv[1], scale, _cache_mask(positions, seqlens, max_seqlen, key_mask, window, limits),
                softcap=softcap)


def store_kv_quant(k_codes: torch.Tensor, k_scales: torch.Tensor | None, v_codes: torch.Tensor,
                   v_scales: torch.Tensor | None, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_bits: int, v_bits: int) -> None:
    """`store_kv` into a quantized cache: k/v [B,T,Hkv,D] quantized as exlpy.cache.qcodec does (Hadamard groups
    + absmax codes, or FP8 where scales is None) into flat rows `slots` [B,T]; negative slots are skipped."""
    idx = slots.reshape(-1)
    keep = idx >= 0
    for codes, scales, x, bits in ((k_codes, k_scales, k, k_bits), (v_codes, v_scales, v, v_bits)):
        rows = x.reshape(idx.shape[0], -1)[keep]
        flat = codes.view(-1, codes.shape[-1])
        if scales is None:
            flat[idx[keep]] = qcodec.fp8_encode(rows)
            continue
        c, s = qcodec.quantize(rows, bits)
        flat[idx[keep]] = c
        scales.view(-1, scales.shape[-1])[idx[keep]] = s


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
         is_causal: bool = False, softcap: float = 0.0) -> torch.Tensor:
    """q [B,T,Hq,D], k/v [B,L,Hk,D] (GQA: Hq multiple of Hk), mask broadcastable to [B,Hq,T,L] (True=keep).
    softcap > 0: scores become softcap * tanh(score / softcap) before the mask (Gemma 2)."""
    Hq, Hk = q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if Hq != Hk:
        kt = kt.repeat_interleave(Hq // Hk, dim=1)
        vt = vt.repeat_interleave(Hq // Hk, dim=1)
    if is_causal and mask is None and softcap:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        # A fully masked row (a padding query) would produce NaN; let it see key 0, its output is unused.
        mask = mask | ~mask.any(-1, keepdim=True)
    if softcap:
        s = torch.matmul(qt.float(), kt.float().transpose(-1, -2)) * scale
        s = torch.tanh(s / softcap) * softcap
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1).to(q.dtype), vt)
        return o.transpose(1, 2)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=is_causal and mask is None,
                                       scale=scale)
    return o.transpose(1, 2)


def peer_all_reduce(tensors: list[torch.Tensor], state: object = None, spin: int = 0) -> None:
    """In-place sum over `tensors` (float32 accumulation), the result in every one of them."""
    acc = torch.zeros(tensors[0].shape, dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        acc += t.to(acc.device, torch.float32)
    for t in tensors:
        t.copy_(acc.to(t.device, t.dtype))


def embed_slice(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """A vocabulary-parallel embedding lookup: `weight` holds table rows [start, start + n); ids in that range
    get their row, others a zero row (the all-reduce over GPUs completes them). [*ids.shape, hidden]."""
    n, hidden = weight.shape
    local = ids - start
    mine = (local >= 0) & (local < n)
    if not n:
        return weight.new_zeros(*ids.shape, hidden)
    h = F.embedding(local.clamp(0, n - 1), weight)
    return h * mine.unsqueeze(-1).to(h.dtype)


def host_all_reduce(tensors: list[torch.Tensor], state: object = None, spin: int = 0) -> None:
    """The host-memory all-reduce's contract (kernels/host_allreduce.py): `peer_all_reduce`'s in-place sum,
    accumulated in float32 in rank order, so that every tensor receives the same bits."""
    peer_all_reduce(tensors, state, spin)


def host_all_reduce_norm(tensors: list[torch.Tensor], weights: list[torch.Tensor], eps: float, state: object = None,
                         spin: int = 0) -> list[torch.Tensor]:
    """`host_all_reduce`, then every device's RMSNorm of the sum with its copy of the next block's norm weight
    (the fused kernel's epilogue): the normed tensors, one per device."""
    host_all_reduce(tensors, state, spin)
    return [rms_norm(t, w, eps) for t, w in zip(tensors, weights)]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token whose bit is 0 set to -inf (a new tensor). bitmask [B, W] int32, bit
    t % 32 of word t // 32 allows token t (llguidance/xgrammar layout); tokens past 32·W are excluded."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.to(torch.int32).unsqueeze(-1) >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    vocab = logits.shape[-1]
    if allowed.shape[-1] < vocab:
        allowed = F.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    return logits.masked_fill(~allowed[:, :vocab].to(logits.device), float("-inf"))


# --- LoRA: per-row adapters in one batch (exlpy/lora/) ----------------------------------------------------------
# Adapter weights live in slot buffers: a [S, P, R, K] holds the down-projections (lora_A) of P projections that
# read the same input, b [S, N, R] the up-projections (lora_B, scaling folded in) of their N output columns side
# by side; ranks [S] says how many of the R rank rows slot s uses. Token m belongs to row m // q_len, whose slot
# is adapters[row] (-1: no adapter). The first op (shrink) returns fp32 partials [splits, M, P*R + 1]: summed
# over dim 0, columns :P*R times rsqrt(column P*R) give u = h @ A^T per token (h = x, or its RMSNorm: the kernels
# split K over programs and leave the norm's scale to the expand that adds the splits up). This reference returns
# one split and scale column 1. Rows without a slot, or whose slot has rank 0, may hold anything: the expand
# never reads them.

def _token_slots(adapters: torch.Tensor, q_len: int, m: int) -> torch.Tensor:
    return adapters.view(-1, 1).expand(-1, q_len).reshape(-1)[:m]


def _slot_rows(adapters: torch.Tensor, q_len: int, m: int) -> list[tuple[int, torch.Tensor | None]]:
    """(slot, its token indices, or None when it has every token) for the slots in use."""
    slot = _token_slots(adapters, q_len, m)
    out: list[tuple[int, torch.Tensor | None]] = []
    for s in slot.unique().tolist():
        if s >= 0:
            rows = slot == s
            out.append((s, None if bool(rows.all()) else rows.nonzero().squeeze(1)))
    return out


def _rank_rows(w: torch.Tensor, rank: torch.Tensor, dim: int) -> torch.Tensor:
    """w in fp32 with the rank entries >= `rank` along `dim` zeroed (slots hold stale rows past their rank)."""
    keep = torch.arange(w.shape[dim], device=w.device) < rank.to(w.device)
    shape = [1] * w.dim()
    shape[dim] = -1
    return w.float() * keep.view(shape)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor, adapters: torch.Tensor, q_len: int,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Partials [splits, M, P*R + 1] (fp32) of x [..., K] (rms_norm(x, norm_weight, eps) first when norm_weight
    is given) with each token's slot of a [S, P, R, K]; see the comment above."""
    K = x.shape[-1]
    M = x.numel() // K
    S, P, R, _ = a.shape
    h = (rms_norm(x, norm_weight, eps) if norm_weight is not None else x).reshape(M, K).float()
    u = torch.zeros(M, P * R + 1, dtype=torch.float32, device=x.device)
    u[:, -1] = 1.0
    for s, idx in _slot_rows(adapters, q_len, M):
        a_s = _rank_rows(a[s], ranks[s], 1).reshape(P * R, K)
        if idx is None:
            u[:, :-1] = h @ a_s.t()
        else:
            u[idx, :-1] = h.index_select(0, idx) @ a_s.t()
    return u.unsqueeze(0)


def lora_expand(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, adapters: torch.Tensor,
                q_len: int, bounds: tuple[int, ...] = ()) -> torch.Tensor:
    """y [..., N] + the adapters' outputs, in place: columns [edge p, edge p+1) of part p (edges 0, *bounds, N)
    get u's part p [.., p*R:(p+1)*R] @ b[slot, cols]^T. u: the partials of `lora_shrink`. Returns y."""
    N = y.shape[-1]
    M = y.numel() // N
    R = b.shape[-1]
    edges = [0, *bounds, N]
    total = u.sum(0)
    us = total[:, :-1] * total[:, -1:].rsqrt()
    if not y.is_contiguous():
        y = y.contiguous()
    yv = y.view(M, N)
    for s, idx in _slot_rows(adapters, q_len, M):
        bs = _rank_rows(b[s], ranks[s], 1)
        us_s = us if idx is None else us.index_select(0, idx)
        delta = torch.cat([us_s[:, p * R:(p + 1) * R] @ bs[edges[p]:edges[p + 1]].t()
                           for p in range(len(edges) - 1)], dim=1)
        if idx is None:
            yv.copy_(yv.float() + delta)
        else:
            yv.index_copy_(0, idx, (yv.index_select(0, idx).float() + delta).to(y.dtype))
    return y


def lora_expand_swiglu(gu: torch.Tensor, u: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
                       adapters: torch.Tensor, q_len: int, down_a: torch.Tensor | None = None,
                       down_ranks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """silu(gate) * up of a [gate; up] projection's output gu [..., 2I] with the adapters' outputs added first
    (b [S, 2I, R]; u: the partials of `lora_shrink` over both parts). Returns (act [..., I], and with `down_a`
    [S, 1, R2, I] the `lora_shrink` partials of act for the next projection, else None). gu is not modified."""
    inter = gu.shape[-1] // 2
    y = lora_expand(gu.clone(), u, b, ranks, adapters, q_len, (inter,))
    act = silu_mul(y[..., :inter], y[..., inter:])
    if down_a is None:
        return act, None
    assert down_ranks is not None
    return act, lora_shrink(act, down_a, down_ranks, adapters, q_len)
