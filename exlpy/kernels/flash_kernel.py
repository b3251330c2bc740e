"""The flash attention kernel itself (Triton); launch tables and entry points are in flash_attention.py.

Layout of the work: a program owns BLOCK_M query rows of one (sequence, KV head), where a row is one
(token, query head of the group) pair, row = token * G + g. The G query heads that share a KV head are thus
processed together and every K/V tile is loaded once per group; the causal diagonal is also G times narrower
in tokens than in rows. Keys are visited in two loops: the interior, keys every row of the tile sees (no
masks, no -inf bookkeeping, unpredicated loads the compiler can pipeline), then the boundary blocks with the
causal/length/key masks. Softmax is online in the log2 domain, accumulation in fp32. With SPLIT, program
(.., .., s) covers the s-th share of the key range and writes a partial result and its log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

from exlpy.kernels.kv_tiles import load_kv_tile, rotate_rows


@triton.jit
def _attend_block(acc, m_i, l_i, q, start, n, pos, lim, r_hi, kvh, kc_ptr, vc_ptr, ks_ptr, vs_ptr, k_desc, v_desc,
                  bt_row, page, mask_row, mask_len, page_size, k_row_stride, v_row_stride, ks_row_stride, vs_row_stride,
                  qk_scale, kn_ptr, vn_ptr, new_tstride, c0, window, cap_in, cap_out, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, K_FMT: tl.constexpr, K_BITS: tl.constexpr,
                  V_FMT: tl.constexpr, V_BITS: tl.constexpr, PAGING: tl.constexpr, USE_TMA: tl.constexpr,
                  HAS_MASK: tl.constexpr, MASKED: tl.constexpr, FRESH: tl.constexpr, PREC: tl.constexpr,
                  WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """One BLOCK_N block of keys [start, start + BLOCK_N) (those < r_hi) into the running (acc, m_i, l_i).

    Cache rows: PAGING 0 (contiguous: the whole sequence in `page`), 1 (the block inside page `page`, looked
    up by the caller), 2 (a block-table lookup per key). FRESH blocks read this step's own K/V rows
    (unquantized, key t at row t - c0 of kn/vn) instead of the cache, with the unrotated q, into a state of
    their own (merged with the cache's at the end). Row i sees keys t <= lim[i] (its position `pos[i]`, or
    further with the launch's `limits`). WINDOW: keys t > pos - window only (every block is then MASKED);
    SOFTCAP: raw scores s become cap_out * tanh(s * cap_in), i.e. cap * tanh(s * scale / cap) / scale, so that
    the scale applied afterwards leaves cap * tanh(score / cap)."""
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
    elif USE_TMA and not MASKED and PAGING != 2:  # one bulk copy per tile (K_FMT is PLAIN and BLOCK_D == D)
        k = k_desc.load([base.to(tl.int32), kvh * D])
    else:
        k = load_kv_tile(kc_ptr, ks_ptr, base, rows, kvh, n_ok, k_row_stride, ks_row_stride, D, BLOCK_D, BLOCK_N,
                         K_FMT, K_BITS, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)  # scaled by qk_scale (log2 units) inside exp2's FMA
    if SOFTCAP:  # tanh(y) = 1 - 2 / (exp(2y) + 1)
        s = cap_out * (1.0 - 2.0 / (tl.exp(2.0 * cap_in * s) + 1.0))
    if MASKED or HAS_MASK:
        if MASKED:
            ok = (t[None, :] <= lim[:, None]) & n_ok[None, :]
            if WINDOW:
                ok = ok & (t[None, :] > pos[:, None] - window)
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
    elif USE_TMA and not MASKED and PAGING != 2:
        v = v_desc.load([base.to(tl.int32), kvh * D])
    else:
        v = load_kv_tile(vc_ptr, vs_ptr, base, rows, kvh, n_ok, v_row_stride, vs_row_stride, D, BLOCK_D, BLOCK_N,
                         V_FMT, V_BITS, MASKED)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _key_range(acc, m_i, l_i, q, r_lo, r_hi, full, n, pos, lim, kvh, kc_ptr, vc_ptr, ks_ptr, vs_ptr, k_desc, v_desc,
               bt_row, mask_row, mask_len, page_size, k_row_stride, v_row_stride, ks_row_stride, vs_row_stride,
               qk_scale, kn_ptr, vn_ptr, new_tstride, c0, window, cap_in, cap_out, D: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, K_FMT: tl.constexpr, K_BITS: tl.constexpr,
               V_FMT: tl.constexpr, V_BITS: tl.constexpr, PAGING: tl.constexpr, GROUP_PAGES: tl.constexpr,
               USE_TMA: tl.constexpr, HAS_MASK: tl.constexpr, FRESH: tl.constexpr, PREC: tl.constexpr,
               WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Keys [r_lo, r_hi): whole blocks that every row sees (keys < full) unmasked, then the masked rest.

    No load inside the interior loop may feed the K/V addresses: Triton's software pipeline would then wait
    for each tile right before using it (measured in the compiled code: one buffer in flight instead of two).
    So contiguous caches read their page once, and paged ones read the block-table entries of GROUP_PAGES
    pages as one vector before an inner loop over their blocks, which picks its page arithmetically."""
    interior = r_lo + tl.maximum(tl.minimum(full, r_hi) - r_lo, 0) // BLOCK_N * BLOCK_N
    if WINDOW:  # the window's lower edge differs per row: every block goes through the masked loop
        interior = r_lo
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
                acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, start, n, pos, lim, r_hi, kvh, kc_ptr, vc_ptr, ks_ptr,
                                              vs_ptr, k_desc, v_desc, bt_row, pg, mask_row, mask_len, page_size,
                                              k_row_stride, v_row_stride, ks_row_stride, vs_row_stride, qk_scale,
                                              kn_ptr, vn_ptr, new_tstride, c0, window, cap_in, cap_out, D, BLOCK_N,
                                              BLOCK_D, K_FMT, K_BITS, V_FMT, V_BITS, PAGING, USE_TMA, HAS_MASK,
                                              False, FRESH, PREC, WINDOW, SOFTCAP)
    else:
        for start in range(r_lo, interior, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, start, n, pos, lim, r_hi, kvh, kc_ptr, vc_ptr, ks_ptr,
                                          vs_ptr, k_desc, v_desc, bt_row, page, mask_row, mask_len, page_size,
                                          k_row_stride, v_row_stride, ks_row_stride, vs_row_stride, qk_scale, kn_ptr,
                                          vn_ptr, new_tstride, c0, window, cap_in, cap_out, D, BLOCK_N, BLOCK_D, K_FMT,
                                          K_BITS, V_FMT, V_BITS, PAGING, USE_TMA, HAS_MASK, False, FRESH, PREC, WINDOW,
                                          SOFTCAP)
    for start in range(interior, r_hi, BLOCK_N):  # at most a few blocks: a table read per block is fine here
        if PAGING == 1 and not FRESH:
            pg = tl.load(bt_row + start // page_size).to(tl.int64)
        else:
            pg = page
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, start, n, pos, lim, r_hi, kvh, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                                      k_desc, v_desc, bt_row, pg, mask_row, mask_len, page_size, k_row_stride,
                                      v_row_stride, ks_row_stride, vs_row_stride, qk_scale, kn_ptr, vn_ptr, new_tstride,
                                      c0, window, cap_in, cap_out, D, BLOCK_N, BLOCK_D, K_FMT, K_BITS, V_FMT, V_BITS,
                                      PAGING, USE_TMA, HAS_MASK, True, FRESH, PREC, WINDOW, SOFTCAP)
    return acc, m_i, l_i


# Arguments that change with a request's shape (chunk length, table width, split count, mask width) are not
# specialized (Triton would compile a variant for "equal to 1" and "divisible by 16" of each): the serving
# warm-up cannot foresee every combination, and a compile mid-serving stalls every stream for seconds (two such
# compiles in an 8B serving run, 2026-11-26). Strides that set the vectorization of q, K and V loads stay
# specialized: they follow from the model's dimensions.
@triton.jit(do_not_specialize=["pos_bstride", "lim_bstride", "bt_stride", "T", "m_tiles", "n_splits", "mask_stride",
                               "mask_len"])
def _flash_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, k_desc, v_desc, bt_ptr, seqlen_ptr, pos_ptr, lim_ptr, mask_ptr,
                  out_ptr, part_ptr, lse_ptr, kn_ptr, vn_ptr, q_bstride, q_tstride, pos_bstride, pos_tstride,
                  lim_bstride, bt_stride, mask_stride, mask_len, new_bstride, new_tstride, T, hq, hk, page_size,
                  k_row_stride, v_row_stride, ks_row_stride, vs_row_stride, qk_scale, m_tiles, n_splits, window,
                  cap_in, cap_out,
                  G: tl.constexpr, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
                  K_FMT: tl.constexpr, K_BITS: tl.constexpr, V_FMT: tl.constexpr, V_BITS: tl.constexpr,
                  PAGING: tl.constexpr, GROUP_PAGES: tl.constexpr, USE_TMA: tl.constexpr, HAS_MASK: tl.constexpr,
                  HAS_NEW: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr = False,
                  SOFTCAP: tl.constexpr = False, HAS_LIMITS: tl.constexpr = False):
    tile = m_tiles - 1 - tl.program_id(0)  # latest query rows (longest key ranges) first: a shorter tail
    bh = tl.program_id(1)
    b = (bh // hk).to(tl.int64)
    kvh = bh % hk
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < T * G
    tok = (r // G).to(tl.int64)
    head = kvh * G + r % G
    pos = tl.load(pos_ptr + b * pos_bstride + tok * pos_tstride, mask=r_ok, other=-1).to(tl.int64)
    if HAS_LIMITS:  # row i sees keys up to lim[i] >= pos[i] (an image token: the rest of its image)
        lim = tl.load(lim_ptr + b * lim_bstride + tok, mask=r_ok, other=-1).to(tl.int64)
    else:
        lim = pos
    seqlen = tl.load(seqlen_ptr + b).to(tl.int64)
    hi = tl.maximum(tl.minimum(seqlen, tl.max(lim, axis=0) + 1), 0)  # keys any row of the tile sees
    full = tl.minimum(seqlen, tl.min(tl.where(r_ok, lim, seqlen), axis=0) + 1)  # keys every row sees
    first = hi * 0
    if WINDOW:  # keys any row of the tile sees start at the earliest row's window edge
        # aligned down to a key block: blocks never straddle a page (PAGING 1 looks one page up per block)
        first = tl.minimum(tl.maximum(tl.min(tl.where(r_ok, pos, hi), axis=0) + 1 - window, 0), hi)
        first = first // BLOCK_N * BLOCK_N
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(hi - first, n_splits), BLOCK_N) * BLOCK_N
        lo = first + tl.program_id(2) * chunk
        s_hi = tl.minimum(lo + chunk, hi)
    else:
        lo = first
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
        acc, m_i, l_i = _key_range(acc, m_i, l_i, q, lo, tl.minimum(s_hi, c0), full, n, pos, lim, kvh, kc_ptr, vc_ptr,
                                   ks_ptr, vs_ptr, k_desc, v_desc, bt_row, mask_row, mask_len, page_size, k_row_stride,
                                   v_row_stride, ks_row_stride, vs_row_stride, qk_scale, kn_ptr, vn_ptr, 0, c0,
                                   window, cap_in, cap_out, D, BLOCK_N, BLOCK_D, K_FMT, K_BITS, V_FMT, V_BITS, PAGING,
                                   GROUP_PAGES, USE_TMA, HAS_MASK, False, PREC, WINDOW, SOFTCAP)
        if V_FMT == 1:  # (sum p.g).H: back from the rotated value codes, normalized so fp16 parts never overflow
            l_r = tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            acc = rotate_rows(acc / l_r, BLOCK_M, BLOCK_D) * l_r
        # The fresh rows in a softmax state of their own (unrotated q and values), merged below.
        m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l2 = tl.zeros([BLOCK_M], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        acc2, m2, l2 = _key_range(acc2, m2, l2, q_in, tl.maximum(lo, c0), s_hi, full, n, pos, lim, kvh, kc_ptr, vc_ptr,
                                  ks_ptr, vs_ptr, k_desc, v_desc, bt_row, mask_row, mask_len, page_size, k_row_stride,
                                  v_row_stride, ks_row_stride, vs_row_stride, qk_scale, kn_ptr + b * new_bstride,
                                  vn_ptr + b * new_bstride, new_tstride, c0, window, cap_in, cap_out, D, BLOCK_N,
                                  BLOCK_D, K_FMT, K_BITS, V_FMT, V_BITS, PAGING, GROUP_PAGES, USE_TMA, HAS_MASK, True,
                                  PREC, WINDOW, SOFTCAP)
        m_new = tl.maximum(m_i, m2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a1 = tl.exp2(m_i - m_use)
        a2 = tl.exp2(m2 - m_use)
        acc = acc * a1[:, None] + acc2 * a2[:, None]
        l_i = l_i * a1 + l2 * a2
        m_i = m_new
    else:
        acc, m_i, l_i = _key_range(acc, m_i, l_i, q, lo, s_hi, full, n, pos, lim, kvh, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                                   k_desc, v_desc, bt_row, mask_row, mask_len, page_size, k_row_stride, v_row_stride,
                                   ks_row_stride, vs_row_stride, qk_scale, kn_ptr, vn_ptr, 0, 0, window, cap_in,
                                   cap_out, D, BLOCK_N, BLOCK_D, K_FMT, K_BITS, V_FMT, V_BITS, PAGING, GROUP_PAGES,
                                   USE_TMA, HAS_MASK, False, PREC, WINDOW, SOFTCAP)

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
