"""Grouped EXL2 expert GEMMs at a few rows per expert (3-16: batched decode, e.g. Mixtral at 32 tokens = 64
(token, expert) pairs over 8 experts): a multi-row variant of moe_exl2_gemv's GEMV kernels. Same contracts as
`reference.moe_gate_up_exl2 / moe_down_exl2`; moe_exl2 routes here by the launch's pair and expert counts.

Why not the tile kernels: at ~8 rows per expert they decode every 32-row block into a [32, 64] tile, convert it to
the tensor-core operand layout and dot it with 16 rows of which half are padding; on an H100 that ran at 13-15% of
the copy rate (Mixtral EXL2 4.0 at 32 tokens, 2026-11-26), while the GEMV kernels decode the same words at 84%
for one row. Why not the GEMV kernels: they run one program per sorted row, so 8 rows of an expert decode its
words 8 times.

Here one program runs (row tile of R sorted rows of one expert, column block, K split): it loads and decodes each
packed word once exactly as the GEMV kernels do (16-byte loads of a step's words, compile-time shifts, the fp32
mantissa trick) and feeds each decoded code to R FMAs, one per row, with that row's x gathered through the
expert's act order (one perm load per code shared by the R rows). Each row keeps its own accumulators as a tuple
of 1-D [BLOCK_N] values in the words' layout (a [R, BLOCK_N] tile would spread rows over warps and decode every
word once per warp). An expert with more than R rows takes several tiles (the dense kernels' fixed grid of
`_tile`: ceil(N / R) + min(E, N) row tiles, those past the last exit); rows past an expert's end compute on a copy
of its last row and are not stored. gate|up runs gate and up as separate programs (the third grid axis is matrix x
K split: half the registers of a fused program, so R = 8 rows of 4 columns keep their partial and scaled sums
unspilled). The K splits add their fp32 sums into moe_exl2_gemv's zeroed workspace by atomics; its epilogue
kernels take them (atomic exchange with zero) and write act(gate) * up, or down's y. No host sync, no memset:
CUDA-graph safe.

Mixed-width stacks (the converter's: each expert's sorted rows in groups of 2-8 bits) take one launch of the main
kernel per width present, each compiled for that width alone: its programs walk only their expert's blocks of
that width, listed at load (ExpertStack.blocks), and add into the same workspace; one gather of x before, one
epilogue after. Launch count: widths present + 2, whatever the experts; every compiled variant holds one width's
decode (one variant holding all six took ptxas minutes).

Cost model (why R = 8 and few splits): per code and thread of 4 columns ~2.5 decode operations per column, then R
FMAs per column plus R scalar x loads; at R = 8 that is ~1.6 instructions per multiply-add, so Mixtral's gate|up
and down at 64 pairs are bound by the FMA pipes (~0.6 ms per layer at full issue against 2.07 ms for the tile
kernels), not by memory. Programs need only fill the SMs a few times; more K splits add atomics (each split adds
R x BLOCK_N sums per program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.kernels.exl2_gemv import _MAGIC
from exlpy.kernels.moe import _ACTS, _sms, _tile
from exlpy.kernels.moe_exl2_gemv import (
    _act_kernel,
    _block_words,
    _code,
    _col_scale,
    _convert_kernel,
    _workspace,
)
from exlpy.quant.exl2_ref import EXL2_BITS
from exlpy.quant.experts import ExpertStack
from exlpy.runtime import options

ROWS = 8  # R: sorted rows per program (one expert's); more rows of an expert take more programs
ROWS_STEP = 2  # a tile computes its live rows rounded up to this (one copy of the K loop per count: R / ROWS_STEP)
ROWS_MIN_MEAN = 2  # this path above this mean of sorted rows per routed expert (GEMV_MAX_ROWS: the GEMV kernels)
ROWS_MAX_MEAN = 16  # ... and up to this; more rows per expert take the tensor-core tile kernels (0: path off)
# Stacks of mixed widths (converted files) launch the kernel once per width present, each variant compiled for
# that one width (`launches`): a single variant holding every width's decode in each of the R / RSTEP copies of
# the K loop was still in ptxas after 60 s on an H100 under Triton 3.6 (2026-11-26 21:25), a first-call stall no
# server can take mid-run.
ROWS_COLS = 512  # columns per program: 4 per thread at ROWS_WARPS (one 16-byte load per packed word row)
ROWS_WARPS = 4
ROWS_WAVES = 8  # K split while the programs (estimated live row tiles x column blocks x matrices) fill the SMs
#                 fewer than this many times (FMA-bound: a few programs per SM suffice, splits cost atomics)
# 32-row blocks per step by width (packed words loaded before any is used: B * NB 16-byte loads per thread),
# K a whole number of steps (True) or not: fewer words in flight than the GEMV kernels (the R rows' FMAs hide
# the loads, and registers go to the R rows' sums; 2 bits at two blocks took 255 registers under Triton 3.6).
# Register cap per launch by whether K is whole steps (0: ptxas's choice). Unmasked, Triton 3.6 (the GPU image)
# compiles 2-5 bits in 128 registers (4 programs of 4 warps per SM), 6 and 8 bits in 168, unspilled; with
# masks ptxas stayed at 128 and spilled 72 bytes (4 bits), and Triton 3.9 spilled 160 bytes at a cap of 168: 232
# spills nowhere (benchmarks/moe_rows_compile_check.py).
ROWS_MAXNREG = {True: 0, False: 232}
ROWS_NB = {True: {2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 8: 1}, False: {2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 8: 1}}


@triton.jit
def _zeros(R: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tuple of R fp32 zero vectors [BLOCK_N]."""
    out = ()
    for _m in tl.static_range(R):
        out = out + (tl.zeros([BLOCK_N], tl.float32),)
    return out


@triton.jit
def _gather_kernel(x_ptr, order_ptr, counts_ptr, g_perm, u_perm, xp_ptr, E, K, KP, top_k, sx, tiles,
                   E_P2: tl.constexpr, R: tl.constexpr, R_P2: tl.constexpr, BLOCK: tl.constexpr,
                   GATE_UP: tl.constexpr):
    """xp[mat, tile, k, m] = x_m[perm_mat[k]] in fp32 for the R rows m of each live row tile and k < KP (0 from
    K on): the act-order gather done once per launch, so that the main kernel reads two rows' x with one 8-byte
    load at a compile-time offset (no perm load, no int -> float conversion, no mask per code). Rows past the
    expert's end repeat its last row. GATE_UP: x rows are tokens order[r] // top_k, mat = program_id(2) picks
    gate's or up's act order; else rows r of x."""
    tile = tl.program_id(0)
    expert, row0, end = _tile(counts_ptr, tile, E, E_P2, R)
    if expert < E:
        mat = tl.program_id(2)
        kk = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        kin = kk < K
        perm_ptr = g_perm
        if mat == 1:
            perm_ptr = u_perm
        p = tl.load(perm_ptr + expert.to(tl.int64) * K + kk, mask=kin, other=0)
        m = tl.arange(0, R_P2)  # R padded to a power of two (tl.arange); columns from R on are not stored
        r = tl.minimum(row0 + m, end - 1)
        if GATE_UP:
            xi = tl.load(order_ptr + r) // top_k
        else:
            xi = r.to(tl.int64)
        v = tl.load(x_ptr + xi[None, :] * sx + p[:, None], mask=kin[:, None], other=0.0).to(tl.float32)
        base = xp_ptr + (mat * tiles + tile).to(tl.int64) * KP * R
        tl.store(base + kk[:, None] * R + m[None, :], v, mask=(kk < KP)[:, None] & (m < R)[None, :])


@triton.jit
def _fma_rows(p, xb, d, R: tl.constexpr):
    """p[m] + x_m * d for the first R rows of the tile, their x (fp32) two per 8-byte word at xb[0 .. R / 2)."""
    out = ()
    for j in tl.static_range(R // 2):
        v = tl.load(xb + j)
        out = out + (p[2 * j] + v.to(tl.int32).to(tl.float32, bitcast=True) * d,
                     p[2 * j + 1] + (v >> 32).to(tl.int32).to(tl.float32, bitcast=True) * d)
    return out


@triton.jit
def _rows_block(xb, ws, w_at: tl.constexpr, magic, R: tl.constexpr, XS: tl.constexpr, B: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The first R rows' unscaled sums over one 32-row B-bit block whose words are ws[w_at : w_at + B] and whose
    rows' x start at xb (XS words per sorted row): each code decoded once, then R FMAs."""
    p = _zeros(R, BLOCK_N)
    prev = ws[w_at]
    for wi in tl.static_range(B):
        cur = ws[w_at + wi]
        hi = cur >> 16
        for i in tl.static_range(32):
            if (i * B + B - 1) // 32 == wi:  # code i ends in this word
                p = _fma_rows(p, xb + i * XS, _code(prev, cur, hi, magic, i, B), R)
        prev = cur
    return p


@triton.jit
def _scaled(acc, p, s, R: tl.constexpr):
    out = ()
    for m in tl.static_range(R):
        out = out + (acc[m] + p[m] * s,)
    return out


@triton.jit
def _rows_span(xt, qw_ptr, sc_ptr, sm_ptr, word_ptr, blk_ptr, info_ptr, e_row, lo, hi, K, cols, ok, ldq, lds, magic,
               R: tl.constexpr, XS: tl.constexpr, B: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
               EVEN: tl.constexpr, LISTED: tl.constexpr):
    """(sum over the span's sorted rows r of x_m[perm[r]] * W[r, cols] for the tile's first R rows m) of one B-bit
    expert matrix whose tables start at e_row, the rows' x gathered at xt (8-byte words: XS per sorted row): each
    block's codes decoded once into R FMAs, each row's block sum scaled once per column. The span: sorted rows
    [lo, hi), per step the packed words of NB blocks loaded first; LISTED (mixed-width stacks, one launch per
    width): entries [lo, hi) of the expert's list of B-bit blocks at blk_ptr (ExpertStack.blocks), one block a
    step. EVEN: no block reaches past K (no masks)."""
    acc = _zeros(R, BLOCK_N)
    if LISTED:
        for j in range(lo, hi):
            k0 = tl.load(blk_ptr + j) * 32
            ws = _block_words(qw_ptr, word_ptr, e_row + k0, k0 < K, K - k0, ldq, cols, ok, (), B, EVEN)
            p = _rows_block(xt + k0 * XS, ws, 0, magic, R, XS, B, BLOCK_N)
            acc = _scaled(acc, p, _col_scale(sc_ptr, sm_ptr, info_ptr, e_row + k0, k0 < K, cols, ok, lds), R)
    else:
        for kb in range(lo, hi, 32 * NB):
            ws = ()
            for blk in tl.static_range(NB):
                k0 = kb + blk * 32
                ws = _block_words(qw_ptr, word_ptr, e_row + k0, k0 < K, K - k0, ldq, cols, ok, ws, B, EVEN)
            for blk in tl.static_range(NB):
                k0 = kb + blk * 32
                p = _rows_block(xt + k0 * XS, ws, blk * B, magic, R, XS, B, BLOCK_N)
                acc = _scaled(acc, p, _col_scale(sc_ptr, sm_ptr, info_ptr, e_row + k0, k0 < K, cols, ok, lds), R)
    return acc


@triton.jit
def _rows_kernel(xp_ptr, order_ptr, counts_ptr,
                 g_qw, g_sc, g_sm, g_word, g_info, g_blk, g_bst,
                 u_qw, u_sc, u_sm, u_word, u_info, u_blk, u_bst,
                 ws_ptr, E, K, KP, N_OUT, g_ldq, g_lds, u_ldq, u_lds, ld_ws, chunk, splits, tiles, magic,
                 E_P2: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, B: tl.constexpr, NB: tl.constexpr,
                 EVEN: tl.constexpr, GATE_UP: tl.constexpr, TWO_X: tl.constexpr, RSTEP: tl.constexpr,
                 LISTED: tl.constexpr, SLOT: tl.constexpr, NSLOT: tl.constexpr):
    """Program (row tile of R sorted rows, column block, matrix x K split) over the gathered x (`_gather_kernel`;
    TWO_X: gate and up each their own). GATE_UP: matrix 0 gate / 1 up (the u_* tables), sums added into
    workspace row r (sorted) at column matrix * N_OUT; else (down) into workspace row order[r] (pair order).
    K split `part` takes sorted rows [part * chunk, +chunk), or where LISTED (one width of a mixed stack) the
    expert's B-bit blocks [start + part * chunk, +chunk) of its list (ExpertStack.blocks / block_starts, the
    width's slot SLOT of NSLOT - 1); a split with none exits."""
    tile = tl.program_id(0)
    expert, row0, end = _tile(counts_ptr, tile, E, E_P2, R)
    if expert < E:
        part = tl.program_id(2)
        mat = part // splits
        qw, sc, sm, word, info, blk, bst, ldq, lds = g_qw, g_sc, g_sm, g_word, g_info, g_blk, g_bst, g_ldq, g_lds
        if GATE_UP:
            if mat == 1:
                qw, sc, sm, word, info, blk, bst, ldq, lds = u_qw, u_sc, u_sm, u_word, u_info, u_blk, u_bst, u_ldq, \
                    u_lds
        lo = (part - mat * splits) * chunk
        hi = tl.minimum(lo + chunk, K)
        if LISTED:
            first = tl.load(bst + expert * NSLOT + SLOT)
            hi = tl.minimum(first + lo + chunk, tl.load(bst + expert * NSLOT + SLOT + 1))
            lo = first + lo
            blk = blk + expert.to(tl.int64) * tl.cdiv(K, 32)
        if lo < hi:
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = cols < N_OUT
            xm = tile
            if TWO_X:
                xm = mat * tiles + tile
            xt = xp_ptr.to(tl.pointer_type(tl.int64)) + xm.to(tl.int64) * KP * (R // 2)
            # The tile's live rows, rounded up to a multiple of RSTEP, are computed: one copy of the K loop per
            # count (the tile height is a device value; rows past it would cost FMAs, the loop's main work).
            nr = tl.minimum(end - row0, R)
            for rr in tl.static_range(RSTEP, R + 1, RSTEP):
                if nr > rr - RSTEP:
                    if nr <= rr:
                        acc = _rows_span(xt, qw, sc, sm, word, blk, info, expert.to(tl.int64) * K, lo, hi, K, cols,
                                         ok, ldq, lds, magic, rr, R // 2, B, NB, BLOCK_N, EVEN, LISTED)
                        _store_rows(acc, ws_ptr, order_ptr, row0, end, ld_ws, mat * N_OUT, cols, ok, rr, GATE_UP)


@triton.jit
def _store_rows(acc, ws_ptr, order_ptr, row0, end, ld_ws, col0, cols, ok, R: tl.constexpr, GATE_UP: tl.constexpr):
    """Add the R rows' sums into the workspace: GATE_UP at sorted row r, column col0 on; else at row order[r]."""
    for m in tl.static_range(R):
        r = row0 + m
        live = r < end
        if GATE_UP:
            at = ws_ptr + r.to(tl.int64) * ld_ws + col0 + cols
        else:
            at = ws_ptr + tl.load(order_ptr + tl.minimum(r, end - 1)) * ld_ws + cols
        # (int & int) != 0, not bool & bool: the CPU interpreter mis-types a scalar-broadcast bool &
        tl.atomic_add(at, acc[m], mask=(ok.to(tl.int32) & live.to(tl.int32)) != 0, sem="relaxed")


# --- host side --------------------------------------------------------------------------------------------------
def takes(n_pairs: int, n_experts: int) -> bool:
    """Whether N sorted rows over E experts take these kernels: mean rows per routed expert above ROWS_MIN_MEAN (the
    GEMV kernels' range) and at most ROWS_MAX_MEAN, where the split-K kernels are on (EXLPY_MOE_GEMV, on by
    default) and these ones too (EXLPY_MOE_ROWS, on by default). Host arithmetic only (the per-expert counts live
    on the device)."""
    routed = max(1, min(n_experts, n_pairs))
    opts = options()
    return opts.moe_gemv and opts.moe_rows and ROWS_MIN_MEAN * routed < n_pairs <= ROWS_MAX_MEAN * routed


def _nb(bits: int, k: int) -> tuple[int, bool]:
    """(32-row blocks per step, whether K is whole steps: no masks) for `bits` (0: one width of a mixed stack,
    listed blocks, one a step)."""
    nb = ROWS_NB[True][bits] if bits else 1
    if k % (32 * nb):
        nb = ROWS_NB[False][bits] if bits else 1
    return nb, k % (32 * nb) == 0


def plan(n_pairs: int, n_experts: int, n_out: int, k: int, nb: int, matrices: int, sms: int
         ) -> tuple[int, int, int, int, int, int]:
    """(row tiles, columns per program, warps, column blocks, K splits, sorted rows per split). Row tiles: the
    fixed grid of ROWS-row tiles (ceil(N / R) + min(E, N)); column blocks of ROWS_COLS, halved while the last one
    would leave more than an eighth of the columns idle (down to one column a thread); K cut into whole steps of
    nb blocks, into as many splits as keep the estimated live programs (row tiles max(ceil(N / R), routed experts))
    within ROWS_WAVES per SM (on the CPU every step its own split, so the interpreter tests cover the workspace's
    sums)."""
    if ROWS < 2 or ROWS % 2 or ROWS_STEP < 2 or ROWS_STEP % 2:
        raise ValueError(f"moe_exl2_rows.ROWS ({ROWS}) and ROWS_STEP ({ROWS_STEP}) must be even (two rows' x per "
                         "8-byte load)")
    routed = max(1, min(n_experts, n_pairs))
    tiles = triton.cdiv(n_pairs, ROWS) + routed
    live = max(triton.cdiv(n_pairs, ROWS), routed)
    cols, warps = ROWS_COLS, ROWS_WARPS
    while cols > 32 * warps and (triton.cdiv(n_out, cols) * cols - n_out) * 8 > n_out:
        cols //= 2
    col_blocks = triton.cdiv(n_out, cols)
    step = 32 * nb
    steps = triton.cdiv(k, step)
    want = triton.cdiv(ROWS_WAVES * sms, live * col_blocks * matrices) if sms else steps
    per = triton.cdiv(steps, max(1, min(steps, want)))
    return tiles, cols, warps, col_blocks, triton.cdiv(steps, per), per * step


def launches(width: int, k: int, *stacks: ExpertStack) -> list[tuple[int, int, bool]]:
    """(width, sorted rows to plan K splits over, listed) per main-kernel launch over `stacks` (gate and up, or
    down): a one-width stack one launch over K; a mixed one a launch per width present, each compiled for that
    width alone and walking only the experts' blocks of it (ExpertStack.blocks), over as many rows as the expert
    with the most such blocks has (widths 2-8 in one K loop took ptxas minutes: the first call's stall)."""
    if width:
        return [(width, k, False)]
    return [(b, 32 * most, True) for s, b in enumerate(EXL2_BITS)
            if (most := max(st.width_blocks[s] for st in stacks))]


def _gathered(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, perms: tuple[torch.Tensor, ...],
              n_experts: int, k: int, kp: int, tiles: int, top_k: int) -> torch.Tensor:
    """The row tiles' x in act order, fp32 [len(perms), tiles, kp, ROWS] (`_gather_kernel`; rows of x are tokens
    order[r] // top_k, or sorted rows where top_k is 0). A fresh buffer per launch (the caching allocator's, or a
    CUDA graph's pool): its live tiles are written before the main kernel reads them."""
    xp = torch.empty(len(perms), tiles, kp, ROWS, dtype=torch.float32, device=x.device)
    block = 128
    _gather_kernel[(tiles, triton.cdiv(kp, block), len(perms))](
        x, order, counts, perms[0], perms[-1], xp, n_experts, k, kp, max(top_k, 1), x.stride(0), tiles,
        E_P2=triton.next_power_of_2(n_experts), R=ROWS, R_P2=triton.next_power_of_2(ROWS), BLOCK=block,
        GATE_UP=top_k > 0, num_warps=4)
    return xp


def _step() -> int:
    """RSTEP: ROWS_STEP lowered to an even divisor of ROWS (the kernel's copies of the K loop must cover every
    live-row count up to ROWS)."""
    step = min(ROWS, ROWS_STEP)
    while ROWS % step:
        step -= 2
    return step


def _cap(even: bool, t: torch.Tensor) -> dict[str, int]:
    """The launch's register cap (ROWS_MAXNREG; CUDA only: the interpreter takes no such option)."""
    cap = ROWS_MAXNREG[even]
    return {"maxnreg": cap} if cap and t.is_cuda else {}


def _rows(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, stacks: tuple[ExpertStack, ...], top_k: int,
          width: int, ws: torch.Tensor, ld_ws: int) -> None:
    """Add the main kernels' sums into the workspace `ws`: gate and up (two stacks, x rows are tokens
    order[r] // top_k) or down (one stack, x rows sorted), one launch per `launches` entry after one gather of x
    shared by them (its rows padded to the longest launch's K splits)."""
    first, last = stacks[0], stacks[-1]
    E, K, n_out, N, mats = first.num_experts, first.k, first.n, order.shape[0], len(stacks)
    runs = []
    for bits, k_run, listed in launches(width, K, *stacks):
        nb, even = _nb(0 if listed else bits, K)
        tiles, cols, warps, col_blocks, splits, chunk = plan(N, E, n_out, k_run, nb, mats, _sms(x))
        runs.append((bits, listed, nb, even, tiles, cols, warps, col_blocks, splits, chunk))
    kp = max(r[8] * r[9] if not r[1] else triton.cdiv(K, 32) * 32 for r in runs)
    two_x = mats == 2 and first.perm_digest != last.perm_digest
    xp = _gathered(x, order, counts, (first.perm, last.perm) if two_x else (first.perm,), E, K, kp, runs[0][4],
                   top_k if mats == 2 else 0)
    for bits, listed, nb, even, tiles, cols, warps, col_blocks, splits, chunk in runs:
        _rows_kernel[(tiles, col_blocks, mats * splits)](
            xp, order, counts, first.q_weight, first.scales, first.scale_max, first.word, first.info, first.blocks,
            first.block_starts, last.q_weight, last.scales, last.scale_max, last.word, last.info, last.blocks,
            last.block_starts, ws, E, K, kp, n_out, first.q_weight.stride(0), first.scales.stride(0),
            last.q_weight.stride(0), last.scales.stride(0), ld_ws, chunk // 32 if listed else chunk, splits, tiles,
            _MAGIC, E_P2=triton.next_power_of_2(E), R=ROWS, BLOCK_N=cols, B=bits, NB=nb, EVEN=even, GATE_UP=mats == 2,
            TWO_X=two_x, RSTEP=_step(), LISTED=listed, SLOT=EXL2_BITS.index(bits), NSLOT=len(EXL2_BITS) + 1,
            num_warps=warps, num_stages=1, **_cap(even, x))


def gate_up_rows(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, gate: ExpertStack, up: ExpertStack,
                 top_k: int, kind: str, width: int, out: torch.Tensor) -> torch.Tensor:
    """moe_gate_up_exl2 for aligned stacks (`width`: their one width, 0 for mixed) at a few rows per expert."""
    inter, N = gate.n, order.shape[0]
    ws = _workspace(x.device, N * 2 * inter)  # split-K sums: gate | up per sorted row
    _rows(x, order, counts, (gate, up), top_k, width, ws, 2 * inter)
    block = min(1024, triton.next_power_of_2(inter))
    _act_kernel[(N, triton.cdiv(inter, block))](ws, out, inter, out.stride(0), ACT=_ACTS[kind], BLOCK=block,
                                                num_warps=4)
    return out


def down_rows(a: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, down: ExpertStack, width: int,
              y: torch.Tensor) -> torch.Tensor:
    """moe_down_exl2 for an aligned stack (`width`: its one width, 0 for mixed) at a few rows per expert."""
    H, N = down.n, order.shape[0]
    ws = _workspace(a.device, N * H)  # split-K sums, rows in pair order
    _rows(a, order, counts, (down,), 0, width, ws, H)
    block = min(1024, triton.next_power_of_2(H))
    _convert_kernel[(N, triton.cdiv(H, block))](ws, y, H, y.stride(0), BLOCK=block, num_warps=4)
    return y
