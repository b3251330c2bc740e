"""Decode attention over a paged (or contiguous-as-paged) KV cache: split-K "flash decoding" with GQA.

Grid (query token, KV head, split). A program handles all query heads of one KV head group, so every K/V
row is read once per query token. Each query's key range comes from device memory (`seqlens`, `positions`),
never from host values, and is divided evenly over the fixed number of splits; so the kernel can be
captured in a CUDA graph whose grid is fixed by the batch size and the cache capacity only.

A sliding window (Gemma 2, Cohere 2, Phi-3, StarCoder2) narrows each query's key range to its last `window`
positions before the split, so a windowed layer reads only those; soft-capped scores (Gemma 2:
cap * tanh(s / cap)) are capped before the online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E_J = tl.constexpr(_LOG2E)
_TARGET_PROGRAMS = 512  # about four waves of programs on an H100 (132 SMs): short programs


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seqlen_ptr, pos_ptr, mask_ptr, out_ptr, part_ptr, lse_ptr,
                   q_tok_stride, bt_stride, mask_stride, mask_len, q_len, page_size, hq, hk, qk_scale, window,
                   softcap, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = tok // q_len
    seqlen = tl.load(seqlen_ptr + b)
    pos = tl.load(pos_ptr + tok)
    hi = tl.minimum(seqlen.to(tl.int64), pos + 1)  # keys this query may see
    hi = tl.maximum(hi, 0)
    first = tl.zeros_like(hi)
    if WINDOW:  # keys pos - window < t <= pos
        first = tl.minimum(tl.maximum(pos + 1 - window, 0), hi)
    chunk = tl.cdiv(tl.cdiv(hi - first, SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    end = tl.minimum(lo + chunk, hi)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    heads = kvh * G + g
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok * q_tok_stride + heads[:, None] * D + d[None, :], mask=q_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, end, BLOCK_N):
        t = start + n
        ok = t < end
        page = tl.load(bt_ptr + b * bt_stride + t // page_size, mask=ok, other=0).to(tl.int64)
        row = page * page_size + t % page_size
        off = (row * hk + kvh)[:, None] * D + d[None, :]
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(kc_ptr + off, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PREC) * qk_scale  # [G, N], log2 units
        if SOFTCAP:  # cap * tanh(s / cap) in natural units; tanh(y) = 1 - 2 / (exp(2y) + 1)
            y = s * (_LN2 / softcap)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * _LOG2E_J
        if HAS_MASK:
            keep = tl.load(mask_ptr + b * mask_stride + t, mask=ok & (t < mask_len), other=0) != 0
            ok = ok & keep
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + off, mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    out_mask = g_ok[:, None] & d_ok[None, :]
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + (tok * hq + heads[:, None]) * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        idx = (tok * hq + heads) * SPLITS + split
        tl.store(part_ptr + idx[:, None] * D + d[None, :], o, mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + idx, lse, mask=g_ok)


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (token, query head)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sp_ok = sp < SPLITS
    lse = tl.load(lse_ptr + row * SPLITS + sp, mask=sp_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    o_mask = sp_ok[:, None] & (d < D)[None, :]
    o = tl.load(part_ptr + (row * SPLITS + sp)[:, None] * D + d[None, :], mask=o_mask, other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * D + d, res.to(out_ptr.dtype.element_ty), mask=d < D)


def num_splits(programs: int, max_keys: int, block_n: int = 64) -> int:
    """Enough splits to fill the GPU, never more than there are key blocks."""
    fill = triton.cdiv(_TARGET_PROGRAMS, max(programs, 1))
    return max(1, min(fill, triton.cdiv(max(max_keys, 1), block_n)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, page_size: int, seqlens: torch.Tensor, max_seqlen: int,
                           positions: torch.Tensor, scale: float, key_mask: torch.Tensor | None = None,
                           window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Same contract as `reference.paged_attention`. `max_seqlen` only sizes the split count."""
    B, T, hq, D = q.shape
    hk = k_cache.shape[-2]
    G = hq // hk
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-1] == D
    if not (q.stride(-1) == 1 and q.stride(-2) == D and (B == 1 or q.stride(0) == T * q.stride(1))):
        q = q.contiguous()
    q3 = q.as_strided((B * T, hq, D), (q.stride(1), D, 1))
    pos = positions.reshape(-1).contiguous()
    bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    if bt.data_ptr() % 16:  # a row of a larger table: not another compiled variant (see flash_attention.py)
        bt = bt.clone()
    out = torch.empty((B, T, hq, D), dtype=q.dtype, device=q.device)
    if B * T == 0:
        return out
    capacity = bt.shape[1] * page_size
    bound = max_seqlen if 0 < max_seqlen <= capacity else capacity
    block_n = 64
    splits = num_splits(B * T * hk, min(bound, window) if window else bound, block_n)
    part = lse = out
    if splits > 1:
        part = torch.empty((B * T * hq * splits, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((B * T * hq * splits,), dtype=torch.float32, device=q.device)
    mask = key_mask if key_mask is not None else seqlens
    mask_len = key_mask.shape[-1] if key_mask is not None else 0
    if key_mask is not None and key_mask.dtype == torch.bool:
        mask = key_mask.view(torch.uint8)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    mask_stride = mask.stride(0) if key_mask is not None else 0
    _decode_kernel[(B * T, hk, splits)](
        q3, k_cache, v_cache, bt, seqlens, pos, mask, out, part, lse,
        q3.stride(0), bt.stride(0), mask_stride, mask_len, T, page_size, hq, hk, scale * _LOG2E, window,
        float(softcap), G=G, D=D, BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_N=block_n, SPLITS=splits,
        HAS_MASK=key_mask is not None, PREC=prec, WINDOW=window > 0, SOFTCAP=softcap > 0, num_warps=4)
    if splits > 1:
        _combine_kernel[(B * T * hq,)](part, lse, out, D=D, BLOCK_D=triton.next_power_of_2(D), SPLITS=splits,
                                       BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out
