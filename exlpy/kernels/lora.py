"""Per-row LoRA adapters in one batch: the segmented (grouped) matmuls of exlpy/lora/ as Triton kernels.

Same contracts as `reference.lora_shrink / lora_expand / lora_expand_swiglu` (read those first). A program
owns one adapter slot s and a tile of tokens: it loads the tile's row slots, and only if some token there uses
slot s (and s holds an adapter) does it read s's weights, with tensor-core dots over those tokens. So one
launch serves a batch whose rows use different adapters (and none), an adapter's weights are read once per
token tile however many rows use it, and the grid is static, as CUDA graphs need: the slot of each row and the
rank of each slot are read from device memory. The slot axis of the grid has one program group per slot, or,
when the batch has fewer rows than slots (batch-1 decode), one per row, serving that row's slot if no earlier
row uses it: a batch of n rows uses at most n adapters, so few programs find nothing to do.

- shrink: u = x @ A^T per token, K split over programs (partial sums, no atomics: the expand adds them up).
  Projections sharing an input (q|k|v, gate|up) are one launch (a grid axis over the parts). With a norm
  weight the RMSNorm is fused: each split adds its share of mean(x²) to a scale column of the partials and the
  expand applies rsqrt of the sum (the fused decode GEMVs never materialize the normed input).
- expand: y += u @ B^T in place over the (fused) projection's output; a column tile that spans two parts
  reads each part's u.
- expand_swiglu: for gate|up, adds the adapters to gate and up and writes silu(gate) * up (the activation the
  decode GEMV would have fused); for a few tokens it also emits the down projection's shrink partials from the
  same tile, so an adapted MLP costs three launches more than a plain one, not four.

Rank entries past a slot's rank are masked in every load: a rank-16 adapter in buffers sized for rank 64 reads
rank-16 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.kernels import pdl

# K splits of the shrink: more programs read A in parallel, but every expand program re-adds the splits of its
# tokens, so the split count falls as tokens grow (splits x tokens <= _SPLIT_TOKENS).
_SPLIT_TOKENS = 128
# The gate|up expand emits down_proj's shrink partials (one split per column tile) up to this many tokens; above
# it, re-adding those splits in the down expand costs more than a shrink launch.
_DOWN_FUSED_MAX_TOKENS = 4


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _block_r(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _warps(block_m: int, block_n: int = 0, elem_bytes: int = 2) -> int:
    """8 warps for 64-token tiles and the widest tiles (256 columns of 2-byte weights, 128 of fp32), else 4
    (registers per thread)."""
    return 8 if block_m >= 64 or block_n * elem_bytes >= 512 else 4


def _sb(block_m: int, block_r: int) -> int:
    """Partial sums read per step (a 3-D load of [SB, BLOCK_M, BLOCK_R] fp32, kept to ~2K elements)."""
    return max(1, min(8, 2048 // (block_m * block_r)))


@triton.jit
def _program_slot(adapters_ptr, g, n_rows, num_slots, BY_ROW: tl.constexpr, ROWS_P2: tl.constexpr):
    """The slot program group g serves. Over slots: slot g. BY_ROW (fewer rows than slots, e.g. batch-1 decode,
    so fewer idle programs): row g's slot if row g is the first row using it, else -2 (nothing to do). The group
    after the last (g == rows or slots) stands for the tokens with no adapter: num_slots."""
    if BY_ROW:
        last = n_rows
        s = tl.load(adapters_ptr + tl.minimum(g, n_rows - 1))
        j = tl.arange(0, ROWS_P2)
        before = tl.load(adapters_ptr + j, mask=j < g, other=-3)
        seen = tl.max((before == s).to(tl.int32), axis=0) > 0
        s = tl.where(seen | (s < 0), -2, s)
    else:
        last = num_slots
        s = g
    return tl.where(g >= last, num_slots, s)


@triton.jit
def _slot_rows(adapters_ptr, rows, M, q_len, s, num_slots):
    """Tokens of the tile that use slot s; s == num_slots stands for the tokens with no adapter, s == -2 for
    none."""
    ok = rows < M
    slot = tl.maximum(tl.load(adapters_ptr + rows // q_len, mask=ok, other=-1), -1)
    return ok & (slot == tl.where(s < num_slots, s, -1))


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 models: exact products (on GPUs fp32 dots default to tf32)
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _sum_splits(u_ptr, rows, match, col, r_ok, splits, u_split, u_m,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, SB: tl.constexpr):
    """u[rows, col:col+BLOCK_R] summed over the shrink's K splits (unmatched rows and masked ranks: 0)."""
    r = tl.arange(0, BLOCK_R)
    sp = tl.arange(0, SB)
    base = u_ptr + rows[None, :, None] * u_m + (col + r)[None, None, :]
    keep = match[None, :, None] & r_ok[None, None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for s0 in range(0, splits, SB):
        idx = s0 + sp
        t = tl.load(base + idx[:, None, None] * u_split, mask=keep & (idx < splits)[:, None, None], other=0.0)
        acc += tl.sum(t, axis=0)
    return acc


@triton.jit
def _row_scale(u_ptr, rows, match, col, splits, u_split, u_m, BLOCK_M: tl.constexpr, SB: tl.constexpr):
    """rsqrt of the scale column summed over the splits: each row's RMSNorm scale (1 without a norm)."""
    sp = tl.arange(0, SB)
    base = u_ptr + rows[None, :] * u_m + col
    acc = tl.zeros([BLOCK_M], tl.float32)
    for s0 in range(0, splits, SB):
        idx = s0 + sp
        t = tl.load(base + idx[:, None] * u_split, mask=match[None, :] & (idx < splits)[:, None], other=0.0)
        acc += tl.sum(t, axis=0)
    return tl.rsqrt(tl.where(match, acc, 1.0))


@triton.jit
def _shrink_kernel(x_ptr, nw_ptr, a_ptr, ranks_ptr, adapters_ptr, out_ptr,
                   M, K, q_len, n_rows, num_slots, k_per_split, x_stride, a_s, a_p, a_r, o_split, o_m, eps,
                   P: tl.constexpr, R: tl.constexpr, HAS_NORM: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BY_ROW: tl.constexpr,
                   ROWS_P2: tl.constexpr, PDL: tl.constexpr):
    p = tl.program_id(0) % P
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if PDL:  # launched early (exlpy/kernels/pdl.py): x comes from the previous kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = _program_slot(adapters_ptr, tl.program_id(0) // P, n_rows, num_slots, BY_ROW, ROWS_P2)
    match = _slot_rows(adapters_ptr, rows, M, q_len, s, num_slots)
    rank = tl.load(ranks_ptr + tl.maximum(s, 0))
    if (tl.max(match.to(tl.int32), axis=0) > 0) & (rank > 0) & (s >= 0):
        xrow = x_ptr + rows.to(tl.int64)[:, None] * x_stride
        # Operands in the weights' dtype with fp32 accumulation; x·w of a norm in fp32 (it is not normalized yet).
        wt = tl.float32 if HAS_NORM else a_ptr.dtype.element_ty
        r = tl.arange(0, BLOCK_R)
        r_ok = (r < rank) & (r < R)
        arow = a_ptr + s.to(tl.int64) * a_s + p * a_p + r[:, None] * a_r
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        ss = tl.zeros([BLOCK_M], tl.float32)
        k_lo = tl.program_id(2) * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_hi
            xt = tl.load(xrow + k[None, :], mask=match[:, None] & k_ok[None, :], other=0.0)
            if HAS_NORM:
                xf = xt.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
                xt = xf * tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            at = tl.load(arow + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc += _dot(xt.to(wt), tl.trans(at.to(wt)), IEEE)
        dst = out_ptr + tl.program_id(2) * o_split + rows[:, None] * o_m + p * R + r[None, :]
        tl.store(dst, acc, mask=match[:, None] & (r < R)[None, :])
        # The scale column: this split's share of mean(x²) + eps (the RMSNorm's, applied by the expand), or 1.
        first = (tl.program_id(2) == 0).to(tl.float32)
        if HAS_NORM:
            scale_part = ss / K + first * eps
        else:
            scale_part = tl.zeros([BLOCK_M], tl.float32) + first
        if p == 0:
            tl.store(out_ptr + tl.program_id(2) * o_split + rows * o_m + P * R, scale_part, mask=match)


@triton.jit
def _expand_kernel(y_ptr, u_ptr, b_ptr, ranks_ptr, adapters_ptr,
                   M, N, q_len, n_rows, num_slots, splits, y_stride, u_split, u_m, b_s, b_n, edge1, edge2,
                   P: tl.constexpr, R: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SB: tl.constexpr, BY_ROW: tl.constexpr,
                   ROWS_P2: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = tl.program_id(2) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    if PDL:  # launched early: y and u come from earlier kernels
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = _program_slot(adapters_ptr, tl.program_id(0), n_rows, num_slots, BY_ROW, ROWS_P2)
    match = _slot_rows(adapters_ptr, rows, M, q_len, s, num_slots)
    rank = tl.load(ranks_ptr + tl.maximum(s, 0))
    if (tl.max(match.to(tl.int32), axis=0) > 0) & (rank > 0) & (s >= 0):
        r = tl.arange(0, BLOCK_R)
        r_ok = (r < rank) & (r < R)
        bcol = b_ptr + s.to(tl.int64) * b_s + n.to(tl.int64)[:, None] * b_n + r[None, :]
        scale = _row_scale(u_ptr, rows, match, P * R, splits, u_split, u_m, BLOCK_M, SB)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for p in tl.static_range(P):  # the parts (q, k, v) whose columns this tile covers
            lo = 0 if p == 0 else (edge1 if p == 1 else edge2)
            hi = edge1 if p == 0 else (edge2 if p == 1 else N)
            if (n0 < hi) & (n0 + BLOCK_N > lo):
                u = _sum_splits(u_ptr, rows, match, p * R, r_ok, splits, u_split, u_m, BLOCK_M, BLOCK_R, SB)
                u = u * scale[:, None]
                in_p = (n >= lo) & (n < hi)
                bt = tl.load(bcol, mask=in_p[:, None] & r_ok[None, :], other=0.0)
                acc += _dot(u.to(bt.dtype), tl.trans(bt), IEEE)
        yp = y_ptr + rows.to(tl.int64)[:, None] * y_stride + n[None, :]
        m2 = match[:, None] & (n < N)[None, :]
        yt = tl.load(yp, mask=m2, other=0.0).to(tl.float32)
        tl.store(yp, (yt + acc).to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _expand_swiglu_kernel(gu_ptr, act_ptr, u_ptr, b_ptr, ranks_ptr, adapters_ptr, da_ptr, dranks_ptr, dout_ptr,
                          M, inter, q_len, n_rows, num_slots, splits, gu_stride, act_stride, u_split, u_m, b_s, b_n,
                          da_s, da_r, d_split, d_m,
                          R: tl.constexpr, R2: tl.constexpr, DOWN: tl.constexpr, IEEE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_R2: tl.constexpr, SB: tl.constexpr, BY_ROW: tl.constexpr, ROWS_P2: tl.constexpr,
                          PDL: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # The last program group takes the tokens without an adapter (the activation only).
    s = _program_slot(adapters_ptr, tl.program_id(0), n_rows, num_slots, BY_ROW, ROWS_P2)
    match = _slot_rows(adapters_ptr, rows, M, q_len, s, num_slots)
    if tl.max(match.to(tl.int32), axis=0) > 0:
        rows64 = rows.to(tl.int64)
        m2 = match[:, None] & n_ok[None, :]
        gp = gu_ptr + rows64[:, None] * gu_stride + n[None, :]
        g = tl.load(gp, mask=m2, other=0.0).to(tl.float32)
        up = tl.load(gp + inter, mask=m2, other=0.0).to(tl.float32)
        s_c = tl.minimum(s, num_slots - 1)  # s >= 0 here: some token matched
        rank = tl.load(ranks_ptr + s_c)
        if (s < num_slots) & (rank > 0):
            r = tl.arange(0, BLOCK_R)
            r_ok = (r < rank) & (r < R)
            bcol = b_ptr + s.to(tl.int64) * b_s + n.to(tl.int64)[:, None] * b_n + r[None, :]
            bm = n_ok[:, None] & r_ok[None, :]
            wt = b_ptr.dtype.element_ty
            scale = _row_scale(u_ptr, rows, match, 2 * R, splits, u_split, u_m, BLOCK_M, SB)[:, None]
            u0 = _sum_splits(u_ptr, rows, match, 0, r_ok, splits, u_split, u_m, BLOCK_M, BLOCK_R, SB) * scale
            g += _dot(u0.to(wt), tl.trans(tl.load(bcol, mask=bm, other=0.0)), IEEE)
            u1 = _sum_splits(u_ptr, rows, match, R, r_ok, splits, u_split, u_m, BLOCK_M, BLOCK_R, SB) * scale
            up += _dot(u1.to(wt), tl.trans(tl.load(bcol + inter * b_n, mask=bm, other=0.0)), IEEE)
        dt = act_ptr.dtype.element_ty
        g = g.to(dt).to(tl.float32)  # the adapted projection's output, rounded as the unfused path stores it
        up = up.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g)) * up).to(dt)
        tl.store(act_ptr + rows64[:, None] * act_stride + n[None, :], act, mask=m2)
        if DOWN:
            drank = tl.load(dranks_ptr + s_c)
            if (s < num_slots) & (drank > 0):
                r2 = tl.arange(0, BLOCK_R2)
                r2_ok = (r2 < drank) & (r2 < R2)
                at = tl.load(da_ptr + s.to(tl.int64) * da_s + r2[:, None] * da_r + n[None, :],
                             mask=r2_ok[:, None] & n_ok[None, :], other=0.0)
                part = _dot(act.to(at.dtype), tl.trans(at), IEEE)
                dst = dout_ptr + tl.program_id(2) * d_split + rows[:, None] * d_m + r2[None, :]
                tl.store(dst, part, mask=match[:, None] & (r2 < R2)[None, :])
                first = (tl.program_id(2) == 0).to(tl.float32)  # the scale column (no norm): 1 in split 0
                tl.store(dout_ptr + tl.program_id(2) * d_split + rows * d_m + R2,
                         tl.zeros([BLOCK_M], tl.float32) + first, mask=match)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [M, last] with unit stride along the last dim."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _launch_kw(t: torch.Tensor) -> dict:
    return {"PDL": pdl.enabled(t.device), **pdl.launch_options(t.device)}


def slot_groups(n_rows: int, num_slots: int) -> tuple[int, bool, int]:
    """(program groups along the slot axis, BY_ROW, ROWS_P2): one group per row when there are fewer rows than
    slots (a batch of n rows uses at most n adapters), else one per slot."""
    by_row = n_rows < num_slots
    return (n_rows if by_row else num_slots), by_row, triton.next_power_of_2(max(n_rows, 1))


def shrink_config(M: int, K: int, P: int, R: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_R, BLOCK_K, K splits, K per split) for `lora_shrink`: tiles of ~4K elements; K split
    while splits x tokens stay within _SPLIT_TOKENS."""
    bm, br = _block_m(M), _block_r(R)
    bk = max(32, min(256, 4096 // max(bm, br)))
    chunks = triton.cdiv(K, bk)
    splits = min(chunks, max(1, _SPLIT_TOKENS // max(M, 1)))
    k_per = triton.cdiv(chunks, splits) * bk
    return bm, br, bk, triton.cdiv(K, k_per), k_per


def expand_block_n(M: int, fused_down: bool = False, elem_bytes: int = 2) -> int:
    """Output columns per program: wider tiles as tokens grow (fewer programs re-adding the shrink's splits);
    widest for gate|up with the fused down shrink (each column tile is one split of it). fp32 weights (4 bytes,
    exact dots without tensor cores) take half that widest tile: 256 fp32 columns spill registers (Triton 3.6,
    sm_90: 255 registers and 136 bytes of spills at 8 warps; 128 columns: ~205 registers, none)."""
    if fused_down:
        return 256 if elem_bytes <= 2 else 128
    return 128 if 16 < M <= 64 else 64  # 64-token tiles keep 64 columns (registers)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor, adapters: torch.Tensor, q_len: int,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    x2 = _rows(x)
    M, K = x2.shape
    S, P, R, _ = a.shape
    bm, br, bk, splits, k_per = shrink_config(M, K, P, R)
    mblocks = triton.cdiv(M, bm)
    out = torch.empty(splits, M, P * R + 1, dtype=torch.float32, device=x.device)
    if M == 0:
        return out
    groups, by_row, rows_p2 = slot_groups(adapters.numel(), S)
    _shrink_kernel[(groups * P, mblocks, splits)](
        x2, norm_weight if norm_weight is not None else x2, a, ranks, adapters, out,
        M, K, q_len, adapters.numel(), S, k_per, x2.stride(0), a.stride(0), a.stride(1), a.stride(2),
        out.stride(0), out.stride(1), eps, P=P, R=R, HAS_NORM=norm_weight is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, BY_ROW=by_row, ROWS_P2=rows_p2,
        num_warps=_warps(bm), **_launch_kw(x))
    return out


def lora_expand(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, adapters: torch.Tensor,
                q_len: int, bounds: tuple[int, ...] = ()) -> torch.Tensor:
    if not y.is_contiguous():
        y = y.contiguous()
    N = y.shape[-1]
    M = y.numel() // N
    S, _, R = b.shape
    P = len(bounds) + 1
    assert P <= 3 and u.shape[-1] == P * R + 1, "lora_expand: up to three parts, u of P * R + 1 columns"
    edges = [*bounds, N, N]
    bm, br = _block_m(M), _block_r(R)
    bn = expand_block_n(M)
    if M == 0:
        return y
    groups, by_row, rows_p2 = slot_groups(adapters.numel(), S)
    _expand_kernel[(groups, triton.cdiv(M, bm), triton.cdiv(N, bn))](
        y, u, b, ranks, adapters, M, N, q_len, adapters.numel(), S, u.shape[0], N, u.stride(0), u.stride(1),
        b.stride(0), b.stride(1), edges[0], edges[1], P=P, R=R, IEEE=b.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_R=br, SB=_sb(bm, br), BY_ROW=by_row, ROWS_P2=rows_p2, num_warps=_warps(bm), **_launch_kw(y))
    return y


def lora_expand_swiglu(gu: torch.Tensor, u: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
                       adapters: torch.Tensor, q_len: int, down_a: torch.Tensor | None = None,
                       down_ranks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    g2 = _rows(gu)
    M, two_i = g2.shape
    inter = two_i // 2
    S, _, R = b.shape
    act = torch.empty(*gu.shape[:-1], inter, dtype=gu.dtype, device=gu.device)
    fused = down_a is not None and M <= _DOWN_FUSED_MAX_TOKENS
    bm, br = _block_m(M), _block_r(R)
    bn = expand_block_n(M, fused, b.element_size())
    nblocks = triton.cdiv(inter, bn)
    R2 = down_a.shape[2] if down_a is not None else 16
    dout = torch.empty(nblocks if fused else 0, M, R2 + 1, dtype=torch.float32, device=gu.device)
    if M:
        da = down_a if fused else b
        groups, by_row, rows_p2 = slot_groups(adapters.numel(), S)
        _expand_swiglu_kernel[(groups + 1, triton.cdiv(M, bm), nblocks)](
            g2, act, u, b, ranks, adapters, da, down_ranks if fused else ranks, dout,
            M, inter, q_len, adapters.numel(), S, u.shape[0], g2.stride(0), inter, u.stride(0), u.stride(1),
            b.stride(0), b.stride(1), da.stride(0), da.stride(2) if fused else 0, dout.stride(0), dout.stride(1),
            R=R, R2=R2, DOWN=fused, IEEE=b.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br,
            BLOCK_R2=_block_r(R2), SB=_sb(bm, br), BY_ROW=by_row, ROWS_P2=rows_p2,
            num_warps=_warps(bm, bn, b.element_size()), **_launch_kw(gu))
    if down_a is None:
        return act, None
    if not fused:
        assert down_ranks is not None
        return act, lora_shrink(act, down_a, down_ranks, adapters, q_len)
    return act, dout
