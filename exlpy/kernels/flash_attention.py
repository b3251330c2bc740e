"""Flash-style causal attention of a query block over the KV cache itself (prefill chunks, verify and decode steps).

One kernel serves contiguous caches ([B, S, Hkv, D] addressed as pages of S rows, block table [[b]]) and paged
ones (block table [B, P], any page size), fp16/bf16 and the quantized formats of kv_tiles (read at their own
width, dequantized in registers), with the K/V of earlier chunks: query row i of sequence b sees the keys
t <= positions[b, i], t < seqlens[b] (and key_mask[b, t] when given).

Layout of the work: a program owns BLOCK_M query rows of one (sequence, KV head), where a row is one
(token, query head of the group) pair, row = token * G + g. The G query heads that share a KV head are thus
processed together and every K/V tile is loaded once per group; the causal diagonal is also G times narrower
in tokens than in rows. Keys are visited in two loops: the interior, keys every row of the tile sees (no
masks, no -inf bookkeeping, unpredicated loads the compiler can pipeline), then the boundary blocks with the
causal/length/key masks. Softmax is online in the log2 domain, accumulation in fp32.

Short query blocks (decode, speculative verification) leave too few programs to fill the GPU, so the key range
is split over `splits` programs whose partial results a second kernel combines (flash-decoding). Every bound is
read from device memory (seqlens, positions) and the launch grid depends only on host ints (shapes,
max_seqlen), so the kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from exlpy.errors import ConfigError
from exlpy.kernels.kv_tiles import FP8, INT, PLAIN, fmt_code, load_kv_tile, next_pow2, rotate_rows
from exlpy.kernels.paged_attention import _combine_kernel

_LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by head_dim for long query blocks (prefill chunks). Chosen for the
# H100: BLOCK_M = 128 rows feed two warpgroups' wgmma with a [128, D] fp32 accumulator that fits the register
# file next to the [128, BLOCK_N] score tile; BLOCK_N = 64 keeps three K and V stages in shared memory at
# D = 128 (3 x 2 x 64 x 128 x 2 B = 96 KB). Screened offline with ptxas for sm_90a
# (benchmarks/flash_compile_check.py): D 128 -> 244 registers, D 64 with 8 warps -> 184, no spills (D 64
# with 4 warps spills, as does BLOCK_N 128 at D 128). benchmarks/flash_sweep.py times the alternatives;
# EXLPY_FLASH_CONFIG="BM,BN,warps,stages" overrides the table for a run.
PREFILL_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    64: (128, 64, 8, 3),
    128: (128, 64, 8, 3),
    256: (64, 32, 8, 2),
}
# Short query blocks (<= 64 rows per KV head: decode, verify steps) are bound by the K/V read: small M tiles,
# 4 warps, keys split over programs. (BLOCK_N, num_warps, num_stages) per cache format.
DECODE_CONFIGS: dict[str, tuple[int, int, int]] = {"plain": (64, 4, 3), "quant": (64, 4, 3)}
SHORT_ROWS = 64
_MAX_SPLITS = 64
GROUP_PAGES = 8  # block-table entries read at once by the paged interior loop (2,048 keys of 256-token pages)


@triton.jit
def _attend_block(acc, m_i, l_i, q, start, n, pos, r_hi, kvh, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, page,
                  mask_row, mask_len, page_size, k_row_stride, v_row_stride, ks_row_stride, vs_row_stride, qk_scale,
                  kn_ptr, vn_ptr, new_tstride, c0,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, K_FMT: tl.constexpr,
                  K_BITS: tl.constexpr, V_FMT: tl.constexpr, V_BITS: tl.constexpr, PAGING: tl.constexpr,
                  HAS_MASK: tl.constexpr, MASKED: tl.constexpr, FRESH: tl.constexpr, PREC: tl.constexpr):
    """One BLOCK_N block of keys [start, start + BLOCK_N) (those < r_hi) into the running (acc, m_i, l_i).

    Cache rows: PAGING 0 (contiguous: the whole sequence in `page`), 1 (the block inside page `page`, looked
    up by the caller), 2 (a block-table lookup per key). FRESH blocks read this step's own K/V rows
    (unquantized, key t at row t - c0 of kn/vn) instead of the cache, with the unrotated q, into a state of
    their own (merged with the cache's at the end)."""
    t = start + n
    n_ok = t < r_hi
    if FRESH:
        base = start - c0
        rows = n
    elif PAGING == 0:
        base = page * page_size + start
        rows = n
    elif PAGING == 1:
        base = page * page_size + start % page_size
        rows = n
    else:
        base = 0
        if MASKED:
            rows = tl.load(bt_row + t // page_size, mask=n_ok, other=0).to(tl.int64) * page_size + t % page_size
        else:
            rows = tl.load(bt_row + t // page_size).to(tl.int64) * page_size + t % page_size
    if FRESH:
        k = load_kv_tile(kn_ptr, kn_ptr, base, rows, kvh, n_ok, new_tstride, 0, D, BLOCK_D, BLOCK_N, 0, 16, MASKED)
    else:
        k = load_kv_tile(kc_ptr, ks_ptr, base, rows, kvh, n_ok, k_row_stride, ks_row_stride, D, BLOCK_D, BLOCK_N,
                         K_FMT, K_BITS, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)  # scaled by qk_scale (log2 units) inside exp2's FMA
    if MASKED or HAS_MASK:
        if MASKED:
            ok = (t[None, :] <= pos[:, None]) & n_ok[None, :]
        else:
            ok = n_ok[None, :]
        if HAS_MASK:
            keep = tl.load(mask_row + t, mask=n_ok & (t < mask_len), other=0) != 0
            ok = ok & keep[None, :]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet stays at zero
    else:  # interior: every row sees every key, scores are finite
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FRESH:
        v = load_kv_tile(vn_ptr, vn_ptr, base, rows, kvh, n_ok, new_tstride, 0, D, BLOCK_D, BLOCK_N, 0, 16, MASKED)
    else:
        v = load_kv_tile(vc_ptr, vs_ptr, base, rows, kvh, n_ok, v_row_stride, vs_row_stride, D, BLOCK_D, BLOCK_N,
                         V_FMT, V_BITS, MASKED)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _key_range(acc, m_i, l_i, q, r_lo, r_hi, full, n, pos, kvh, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, mask_row,
               mask_len, page_size, k_row_stride, v_row_stride, ks_row_stride, vs_row_stride, qk_scale, kn_ptr,
               vn_ptr, new_tstride, c0, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               K_FMT: tl.constexpr, K_BITS: tl.constexpr, V_FMT: tl.constexpr, V_BITS: tl.constexpr,
               PAGING: tl.constexpr, GROUP_PAGES: tl.constexpr, HAS_MASK: tl.constexpr, FRESH: tl.constexpr,
               PREC: tl.constexpr):
    """Keys [r_lo, r_hi): whole blocks that every row sees (keys < full) unmasked, then the masked rest.

    No load inside the interior loop may feed the K/V addresses: Triton's software pipeline would then wait
    for each tile right before using it (measured in the compiled code: one buffer in flight instead of two).
    So contiguous caches read their page once, and paged ones read the block-table entries of GROUP_PAGES
    pages as one vector before an inner loop over their blocks, which picks its page arithmetically."""
    interior = r_lo + tl.maximum(tl.minimum(full, r_hi) - r_lo, 0) // BLOCK_N * BLOCK_N
    page = tl.load(bt_row).to(tl.int64) if PAGING == 0 and not FRESH else 0
    if PAGING == 1 and not FRESH:
        span = GROUP_PAGES * page_size
        gi = tl.arange(0, GROUP_PAGES)
        for g0 in range(r_lo // span * span, interior, span):
            first = g0 // page_size
            pages = tl.load(bt_row + first + gi, mask=first + gi < tl.cdiv(interior, page_size), other=0)
            pages = pages.to(tl.int64)
            for start in range(tl.maximum(g0, r_lo), tl.minimum(g0 + span, interior), BLOCK_N):
                pg = tl.sum(tl.where(gi == start // page_size - first, pages, 0), axis=0)
                acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, start, n, pos, r_hi, kvh, kc_ptr, vc_ptr, ks_ptr,
                                              vs_ptr, bt_row, pg, mask_row, mask_len, page_size, k_row_stride,
                                              v_row_stride, ks_row_stride, vs_row_stride, qk_scale, kn_ptr, vn_ptr,
                                              new_tstride, c0, D, BLOCK_N, BLOCK_D, K_FMT, K_BITS, V_FMT, V_BITS,
                                              PAGING, HAS_MASK, False, FRESH, PREC)
    else:
        for start in range(r_lo, interior, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, start, n, pos, r_hi, kvh, kc_ptr, vc_ptr, ks_ptr,
                                          vs_ptr, bt_row, page, mask_row, mask_len, page_size, k_row_stride,
                                          v_row_stride, ks_row_stride, vs_row_stride, qk_scale, kn_ptr, vn_ptr,
                                          new_tstride, c0, D, BLOCK_N, BLOCK_D, K_FMT, K_BITS, V_FMT, V_BITS, PAGING,
                                          HAS_MASK, False, FRESH, PREC)
    for start in range(interior, r_hi, BLOCK_N):  # at most a few blocks: a table read per block is fine here
        if PAGING == 1 and not FRESH:
            pg = tl.load(bt_row + start // page_size).to(tl.int64)
        else:
            pg = page
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, start, n, pos, r_hi, kvh, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                                      bt_row, pg, mask_row, mask_len, page_size, k_row_stride, v_row_stride,
                                      ks_row_stride, vs_row_stride, qk_scale, kn_ptr, vn_ptr, new_tstride, c0,
                                      D, BLOCK_N, BLOCK_D, K_FMT, K_BITS, V_FMT, V_BITS, PAGING, HAS_MASK, True,
                                      FRESH, PREC)
    return acc, m_i, l_i


@triton.jit
def _flash_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, seqlen_ptr, pos_ptr, mask_ptr, out_ptr,
                  part_ptr, lse_ptr, kn_ptr, vn_ptr, q_bstride, q_tstride, pos_bstride, pos_tstride, bt_stride,
                  mask_stride, mask_len, new_bstride, new_tstride, T, hq, hk, page_size, k_row_stride, v_row_stride,
                  ks_row_stride, vs_row_stride, qk_scale, m_tiles, n_splits,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, K_FMT: tl.constexpr, K_BITS: tl.constexpr,
                  V_FMT: tl.constexpr, V_BITS: tl.constexpr, PAGING: tl.constexpr, GROUP_PAGES: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_NEW: tl.constexpr, PREC: tl.constexpr):
    tile = m_tiles - 1 - tl.program_id(0)  # latest query rows (longest key ranges) first: a shorter tail
    bh = tl.program_id(1)
    b = (bh // hk).to(tl.int64)
    kvh = bh % hk
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < T * G
    tok = (r // G).to(tl.int64)
    head = kvh * G + r % G
    pos = tl.load(pos_ptr + b * pos_bstride + tok * pos_tstride, mask=r_ok, other=-1).to(tl.int64)
    seqlen = tl.load(seqlen_ptr + b).to(tl.int64)
    hi = tl.maximum(tl.minimum(seqlen, tl.max(pos, axis=0) + 1), 0)  # keys any row of the tile sees
    full = tl.minimum(seqlen, tl.min(tl.where(r_ok, pos, seqlen), axis=0) + 1)  # keys every row sees
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(hi, n_splits), BLOCK_N) * BLOCK_N
        lo = tl.program_id(2) * chunk
        s_hi = tl.minimum(lo + chunk, hi)
    else:
        lo = hi * 0
        s_hi = hi

    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = b * q_bstride + tok * q_tstride + head * D
    q_in = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    if K_FMT == 0:
        q = q_in.to(kc_ptr.dtype.element_ty)
    elif K_FMT == 1:
        q = rotate_rows(q_in.to(tl.float32), BLOCK_M, BLOCK_D).to(tl.float16)  # q.H: dotted with rotated codes
    else:
        q = q_in.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b * bt_stride
    mask_row = mask_ptr + b * mask_stride
    if HAS_NEW:  # keys before this step's first position from the cache, the step's own from kn/vn
        c0 = tl.load(pos_ptr + b * pos_bstride).to(tl.int64)
        acc, m_i, l_i = _key_range(acc, m_i, l_i, q, lo, tl.minimum(s_hi, c0), full, n, pos, kvh, kc_ptr, vc_ptr,
                                   ks_ptr, vs_ptr, bt_row, mask_row, mask_len, page_size, k_row_stride,
                                   v_row_stride, ks_row_stride, vs_row_stride, qk_scale, kn_ptr, vn_ptr, 0, c0, D,
                                   BLOCK_N, BLOCK_D, K_FMT, K_BITS, V_FMT, V_BITS, PAGING, GROUP_PAGES, HAS_MASK,
                                   False, PREC)
        if V_FMT == 1:  # (sum p.g).H: back from the rotated value codes, normalized so fp16 parts never overflow
            l_r = tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            acc = rotate_rows(acc / l_r, BLOCK_M, BLOCK_D) * l_r
        # The fresh rows in a softmax state of their own (unrotated q and values), merged below.
        m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l2 = tl.zeros([BLOCK_M], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        acc2, m2, l2 = _key_range(acc2, m2, l2, q_in, tl.maximum(lo, c0), s_hi, full, n, pos, kvh, kc_ptr, vc_ptr,
                                  ks_ptr, vs_ptr, bt_row, mask_row, mask_len, page_size, k_row_stride,
                                  v_row_stride, ks_row_stride, vs_row_stride, qk_scale, kn_ptr + b * new_bstride,
                                  vn_ptr + b * new_bstride, new_tstride, c0, D, BLOCK_N, BLOCK_D, K_FMT, K_BITS,
                                  V_FMT, V_BITS, PAGING, GROUP_PAGES, HAS_MASK, True, PREC)
        m_new = tl.maximum(m_i, m2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a1 = tl.exp2(m_i - m_use)
        a2 = tl.exp2(m2 - m_use)
        acc = acc * a1[:, None] + acc2 * a2[:, None]
        l_i = l_i * a1 + l2 * a2
        m_i = m_new
    else:
        acc, m_i, l_i = _key_range(acc, m_i, l_i, q, lo, s_hi, full, n, pos, kvh, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                                   bt_row, mask_row, mask_len, page_size, k_row_stride, v_row_stride,
                                   ks_row_stride, vs_row_stride, qk_scale, kn_ptr, vn_ptr, 0, 0, D, BLOCK_N,
                                   BLOCK_D, K_FMT, K_BITS, V_FMT, V_BITS, PAGING, GROUP_PAGES, HAS_MASK, False,
                                   PREC)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if V_FMT == 1 and not HAS_NEW:
        o = rotate_rows(o, BLOCK_M, BLOCK_D)  # (sum p.g).H / l: back from the rotated value codes
    row = (b * T + tok) * hq + head  # [B, T, Hq] flattened
    o_mask = r_ok[:, None] & d_ok[None, :]
    if SPLIT:
        idx = row * n_splits + tl.program_id(2)
        tl.store(part_ptr + idx[:, None] * D + d[None, :], o, mask=o_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + idx, lse, mask=r_ok)
    else:
        tl.store(out_ptr + row[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)


@dataclass
class KVOperand:
    """One of K or V as the kernel reads it: values (or codes), optional fp16 group scales, the format."""

    values: torch.Tensor
    scales: torch.Tensor | None
    fmt: int
    bits: int

    @property
    def row_stride(self) -> int:
        """Elements (code bytes) from one cache row (token slot) to the next."""
        return self.values.stride(-3) if self.fmt == PLAIN else self.values.stride(-2)

    def kv_heads(self, head_dim: int) -> int:
        if self.fmt == PLAIN:
            return self.values.shape[-2]
        return self.values.shape[-1] * 8 // (self.bits * head_dim)

    @property
    def srow_stride(self) -> int:
        return self.scales.stride(-2) if self.scales is not None else 0


def plain_operand(cache: torch.Tensor) -> KVOperand:
    if not cache.is_contiguous():
        raise ConfigError("attention kernels need contiguous K/V caches")
    return KVOperand(cache, None, PLAIN, 16)


def quant_operand(codes: torch.Tensor, scales: torch.Tensor | None, bits: int) -> KVOperand:
    fmt, bits = fmt_code(scales, bits)
    if not codes.is_contiguous() or (scales is not None and not scales.is_contiguous()):
        raise ConfigError("attention kernels need contiguous quantized K/V tensors")
    return KVOperand(codes, scales, fmt, bits)


@functools.lru_cache(maxsize=16)
def _sm_count(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: the H100's count, so CPU tests take the same split decisions


def _config(D: int, rows: int, quant: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this head size and query rows per KV head."""
    if rows <= SHORT_ROWS:
        bn, warps, stages = DECODE_CONFIGS["quant" if quant else "plain"]
        return max(16, next_pow2(rows)), bn, warps, stages
    env = os.environ.get("EXLPY_FLASH_CONFIG", "")
    if env:
        bm, bn, warps, stages = (int(x) for x in env.split(","))
        return bm, bn, warps, stages
    return PREFILL_CONFIGS.get(next_pow2(max(D, 64)), PREFILL_CONFIGS[256])


def num_splits(programs: int, bound: int, block_n: int, sms: int) -> int:
    """Key-range splits for `programs` (query tiles x KV heads): none once two waves are busy, else enough to
    fill about four waves, about no more than there are key blocks. A power of two, so that the combine
    kernel (which takes the count as a constexpr) has a handful of variants to compile, not one per length."""
    if programs >= 2 * sms:
        return 1
    n = min(triton.cdiv(4 * sms, max(programs, 1)), triton.cdiv(max(bound, 1), block_n), _MAX_SPLITS)
    return min(next_pow2(n), _MAX_SPLITS)


def flash_attention_launch(q: torch.Tensor, k: KVOperand, v: KVOperand, block_table: torch.Tensor,
                           page_size: int, seqlens: torch.Tensor, max_seqlen: int, positions: torch.Tensor,
                           scale: float, key_mask: torch.Tensor | None = None,
                           k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                           config: tuple[int, int, int, int] | None = None, splits: int | None = None
                           ) -> torch.Tensor:
    """Causal attention of q [B, T, Hq, D] over the cache operands; [B, T, Hq, D] in q's dtype.

    `max_seqlen` (a host-side bound of seqlens, or the cache capacity) only sizes the key-range split;
    `k_new`/`v_new` [B, T, Hkv, D]: this step's own K/V, read instead of the cache for keys at positions
    >= positions[b, 0] (the step's tokens sit at consecutive positions); `config` / `splits` override the
    tables (benchmarks/flash_sweep.py).
    """
    B, T, hq, D = q.shape
    hk = k.kv_heads(D)
    if hk < 1 or hq % hk or v.kv_heads(D) != hk:
        raise ConfigError(f"{hq} query heads do not match the caches' K/V heads ({hk}, {v.kv_heads(D)})")
    G = hq // hk
    if (k.fmt == INT or v.fmt == INT) and (D < 32 or D & (D - 1)):
        raise ConfigError(f"quantized K/V caches need a power-of-two head_dim >= 32, got {D}")
    if not (q.stride(-1) == 1 and q.stride(-2) == D):
        q = q.contiguous()
    out = torch.empty((B, T, hq, D), dtype=q.dtype, device=q.device)
    if B * T == 0:
        return out
    bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    rows = T * G
    bm, bn, warps, stages = config or _config(D, rows, k.fmt != PLAIN or v.fmt != PLAIN)
    m_tiles = triton.cdiv(rows, bm)
    capacity = bt.shape[1] * page_size
    bound = max_seqlen if 0 < max_seqlen <= capacity else capacity
    n_split = splits or num_splits(m_tiles * B * hk, bound, bn, _sm_count(str(q.device)))
    part = lse = out
    if n_split > 1:
        part = torch.empty((B * T * hq * n_split, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((B * T * hq * n_split,), dtype=torch.float32, device=q.device)
    mask = seqlens
    mask_len = mask_stride = 0
    if key_mask is not None:
        mask = key_mask if key_mask.stride(-1) == 1 else key_mask.contiguous()
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        mask_len, mask_stride = mask.shape[-1], mask.stride(0)
    kn = vn = q
    new_bstride = new_tstride = 0
    if k_new is not None and v_new is not None:
        kn, vn = k_new, v_new
        if not (kn.stride() == vn.stride() and kn.stride(-1) == 1 and kn.stride(-2) == D):
            kn, vn = kn.contiguous(), vn.contiguous()
        new_bstride, new_tstride = kn.stride(0), kn.stride(1)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    # Contiguous caches (one page per sequence, which holds every key) read no block table in the loop;
    # pages holding whole key blocks are looked up per group of pages; other page sizes per key.
    paging = 0 if bt.shape[1] == 1 else (1 if page_size % bn == 0 else 2)
    ks = k.scales if k.scales is not None else k.values
    vs = v.scales if v.scales is not None else v.values
    _flash_kernel[(m_tiles, B * hk, n_split)](
        q, k.values, v.values, ks, vs, bt, seqlens, positions, mask, out, part, lse, kn, vn,
        q.stride(0), q.stride(1), positions.stride(0), positions.stride(1), bt.stride(0), mask_stride, mask_len,
        new_bstride, new_tstride, T, hq, hk, page_size, k.row_stride, v.row_stride, k.srow_stride, v.srow_stride,
        scale * _LOG2E, m_tiles, n_split,
        G=G, D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, next_pow2(D)), SPLIT=n_split > 1,
        K_FMT=k.fmt, K_BITS=k.bits, V_FMT=v.fmt, V_BITS=v.bits, PAGING=paging, GROUP_PAGES=GROUP_PAGES,
        HAS_MASK=key_mask is not None, HAS_NEW=k_new is not None, PREC=prec, num_warps=warps, num_stages=stages)
    if n_split > 1:
        _combine_kernel[(B * T * hq,)](part, lse, out, D=D, BLOCK_D=next_pow2(D), SPLITS=n_split,
                                       BLOCK_S=max(2, next_pow2(n_split)), num_warps=4)
    return out


def flash_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    page_size: int, seqlens: torch.Tensor, max_seqlen: int, positions: torch.Tensor, scale: float,
                    key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.flash_attention` (= `reference.paged_attention`); caches [rows, S, Hkv, D]."""
    return flash_attention_launch(q, plain_operand(k_cache), plain_operand(v_cache), block_table, page_size,
                                  seqlens, max_seqlen, positions, scale, key_mask)


def quant_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor | None, v_codes: torch.Tensor,
                    v_scales: torch.Tensor | None, block_table: torch.Tensor, page_size: int, seqlens: torch.Tensor,
                    max_seqlen: int, positions: torch.Tensor, scale: float, k_bits: int, v_bits: int,
                    key_mask: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.quant_attention`: K/V read as codes [rows, S, W] (+ scales [rows, S, E/32])."""
    return flash_attention_launch(q, quant_operand(k_codes, k_scales, k_bits),
                                  quant_operand(v_codes, v_scales, v_bits), block_table, page_size, seqlens,
                                  max_seqlen, positions, scale, key_mask, k_new, v_new)


__all__ = ["FP8", "INT", "PLAIN", "KVOperand", "flash_attention", "flash_attention_launch", "quant_attention"]
