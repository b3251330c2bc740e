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
from exlpy.quant.experts import ExpertStack
from exlpy.runtime import options

ROWS = 8  # R: sorted rows per program (one expert's); more rows of an expert take more programs
ROWS_STEP = 2  # a tile computes its live rows rounded up to this (one copy of the K loop per count: R / ROWS_STEP)
ROWS_STEP_MIXED = 4  # the same for mixed-width stacks, whose K loop holds a copy per width already (compile time)
ROWS_MIN_MEAN = 2  # this path above this mean of sorted rows per routed expert (GEMV_MAX_ROWS: the GEMV kernels)
ROWS_MAX_MEAN = 16  # ... and up to this; more rows per expert take the tensor-core tile kernels (0: path off)
# Stacks of mixed widths (converted files) take these kernels too: off, because on an H100 under Triton 3.6 the
# mixed variant (every width's decode in each of the R/RSTEP copies of the K loop) was still in ptxas after 60 s
# at its first call (2026-11-26 21:25), a stall no server can take mid-run; uniform stacks compile in seconds. What
# would turn it on: one kernel per width present, launched per width class (as the GEMV kernels' blocks do).
MIXED = False
ROWS_COLS = 512  # columns per program: 4 per thread at ROWS_WARPS (one 16-byte load per packed word row)
ROWS_WARPS = 4
ROWS_WAVES = 8  # K split while the programs (estimated live row tiles x column blocks x matrices) fill the SMs
#                 fewer than this many times (FMA-bound: a few programs per SM suffice, splits cost atomics)
# 32-row blocks per step by width (packed words loaded before any is used: B * NB 16-byte loads per thread),
# K a whole number of steps (True) or not: fewer words in flight than the GEMV kernels (the R rows' FMAs hide
# the loads, and registers go to the R rows' sums; 2 bits at two blocks took 255 registers under Triton 3.6).
# Register cap per launch by whether K is whole steps (0: ptxas's choice). Unmasked, Triton 3.6 (the GPU image)
# compiles 2-5 bits in 128 registers (4 programs of 4 warps per SM), 6, 8 bits and mixed in 168, unspilled; with
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
def _one_block(xb, qw_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, R: tl.constexpr, XS: tl.constexpr,
               B: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_rows_block` of a block of width B loaded on its own (mixed-width stacks)."""
    ws = _block_words(qw_ptr, word_ptr, at, k0 < K, K - k0, ldq, cols, ok, (), B, EVEN)
    return _rows_block(xb, ws, 0, magic, R, XS, B, BLOCK_N)


@triton.jit
def _scaled(acc, p, s, R: tl.constexpr):
    out = ()
    for m in tl.static_range(R):
        out = out + (acc[m] + p[m] * s,)
    return out


@triton.jit
def _rows_span(xt, qw_ptr, sc_ptr, sm_ptr, word_ptr, info_ptr, e_row, k_lo, k_hi, K, cols, ok, ldq, lds, magic,
               R: tl.constexpr, XS: tl.constexpr, B: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
               EVEN: tl.constexpr):
    """(sum over sorted rows [k_lo, k_hi) of x_m[perm[r]] * W[r, cols] for the tile's first R rows m) of one
    expert's matrix whose tables start at e_row, the rows' x gathered at xt (8-byte words: XS per sorted row):
    per step the packed words of NB blocks loaded first, then each block's codes decoded once into R FMAs, each
    row's block sum scaled once per column. B 0: mixed widths, one block per step at its own width (a run-time
    branch per block). EVEN: every block of every step inside K (no masks)."""
    acc = _zeros(R, BLOCK_N)
    if B == 0:
        for k0 in range(k_lo, k_hi, 32):
            at = e_row + k0
            xb = xt + k0 * XS
            if EVEN:
                bits = (tl.load(info_ptr + at) >> 5) & 15
            else:
                bits = (tl.load(info_ptr + at, mask=k0 < K, other=4 << 5) >> 5) & 15
            s = _col_scale(sc_ptr, sm_ptr, info_ptr, at, k0 < K, cols, ok, lds)
            # each branch scales into acc itself: only acc's tuple leaves the branch
            if bits == 2:
                acc = _scaled(acc, _one_block(xb, qw_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, R, XS, 2, EVEN,
                                              BLOCK_N), s, R)
            elif bits == 3:
                acc = _scaled(acc, _one_block(xb, qw_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, R, XS, 3, EVEN,
                                              BLOCK_N), s, R)
            elif bits == 4:
                acc = _scaled(acc, _one_block(xb, qw_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, R, XS, 4, EVEN,
                                              BLOCK_N), s, R)
            elif bits == 5:
                acc = _scaled(acc, _one_block(xb, qw_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, R, XS, 5, EVEN,
                                              BLOCK_N), s, R)
            elif bits == 6:
                acc = _scaled(acc, _one_block(xb, qw_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, R, XS, 6, EVEN,
                                              BLOCK_N), s, R)
            elif bits == 8:
                acc = _scaled(acc, _one_block(xb, qw_ptr, word_ptr, at, k0, K, ldq, cols, ok, magic, R, XS, 8, EVEN,
                                              BLOCK_N), s, R)
    else:
        for kb in range(k_lo, k_hi, 32 * NB):
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
                 g_qw, g_sc, g_sm, g_word, g_info,
                 u_qw, u_sc, u_sm, u_word, u_info,
                 ws_ptr, E, K, KP, N_OUT, g_ldq, g_lds, u_ldq, u_lds, ld_ws, chunk, splits, tiles, magic,
                 E_P2: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, B: tl.constexpr, NB: tl.constexpr,
                 EVEN: tl.constexpr, GATE_UP: tl.constexpr, TWO_X: tl.constexpr, RSTEP: tl.constexpr):
    """Program (row tile of R sorted rows, column block, matrix x K split) over the gathered x (`_gather_kernel`;
    TWO_X: gate and up each their own). GATE_UP: matrix 0 gate / 1 up (the u_* tables), sums added into
    workspace row r (sorted) at column matrix * N_OUT; else (down) into workspace row order[r] (pair order)."""
    tile = tl.program_id(0)
    expert, row0, end = _tile(counts_ptr, tile, E, E_P2, R)
    if expert < E:
        part = tl.program_id(2)
        mat = part // splits
        qw, sc, sm, word, info, ldq, lds = g_qw, g_sc, g_sm, g_word, g_info, g_ldq, g_lds
        if GATE_UP:
            if mat == 1:
                qw, sc, sm, word, info, ldq, lds = u_qw, u_sc, u_sm, u_word, u_info, u_ldq, u_lds
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < N_OUT
        k_lo = (part - mat * splits) * chunk
        xm = tile
        if TWO_X:
            xm = mat * tiles + tile
        xt = xp_ptr.to(tl.pointer_type(tl.int64)) + xm.to(tl.int64) * KP * (R // 2)
        # The tile's live rows, rounded up to a multiple of RSTEP, are computed: one copy of the K loop per count
        # (the tile height is a device value; rows past it would cost FMAs, the loop's main work).
        nr = tl.minimum(end - row0, R)
        for rr in tl.static_range(RSTEP, R + 1, RSTEP):
            if nr > rr - RSTEP:
                if nr <= rr:
                    acc = _rows_span(xt, qw, sc, sm, word, info, expert.to(tl.int64) * K, k_lo,
                                     tl.minimum(k_lo + chunk, K), K, cols, ok, ldq, lds, magic, rr, R // 2, B, NB,
                                     BLOCK_N, EVEN)
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
def takes(n_pairs: int, n_experts: int, width: int = 4) -> bool:
    """Whether N sorted rows over E experts of a stack of `width` (0: mixed) take these kernels: mean rows per routed
    expert above ROWS_MIN_MEAN (the GEMV kernels' range) and at most ROWS_MAX_MEAN, where the split-K kernels are on
    (EXLPY_MOE_GEMV, on by default) and these ones too (EXLPY_MOE_ROWS, on by default); mixed stacks only where
    MIXED says. Host arithmetic only (the per-expert counts live on the device)."""
    if width == 0 and not MIXED:
        return False
    routed = max(1, min(n_experts, n_pairs))
    opts = options()
    return opts.moe_gemv and opts.moe_rows and ROWS_MIN_MEAN * routed < n_pairs <= ROWS_MAX_MEAN * routed


def _nb(bits: int, k: int) -> tuple[int, bool]:
    """(32-row blocks per step, whether K is whole steps: no masks) for `bits` (0: mixed, one block a step)."""
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
    if ROWS < 2 or ROWS % 2 or any(s < 2 or s % 2 for s in (ROWS_STEP, ROWS_STEP_MIXED)):
        raise ValueError(f"moe_exl2_rows.ROWS ({ROWS}), ROWS_STEP ({ROWS_STEP}) and ROWS_STEP_MIXED "
                         f"({ROWS_STEP_MIXED}) must be even (two rows' x per 8-byte load)")
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


def _step(width: int) -> int:
    """RSTEP of a launch: ROWS_STEP, or for mixed widths (width 0) ROWS_STEP_MIXED, lowered to an even divisor of
    ROWS (the kernel's copies of the K loop must cover every live-row count up to ROWS)."""
    step = min(ROWS, ROWS_STEP if width else ROWS_STEP_MIXED)
    while ROWS % step:
        step -= 2
    return step


def _cap(even: bool, t: torch.Tensor) -> dict[str, int]:
    """The launch's register cap (ROWS_MAXNREG; CUDA only: the interpreter takes no such option)."""
    cap = ROWS_MAXNREG[even]
    return {"maxnreg": cap} if cap and t.is_cuda else {}


def gate_up_rows(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, gate: ExpertStack, up: ExpertStack,
                 top_k: int, kind: str, width: int, out: torch.Tensor) -> torch.Tensor:
    """moe_gate_up_exl2 for aligned stacks (`width`: their one width, 0 for mixed) at a few rows per expert."""
    E, H, inter, N = gate.num_experts, gate.k, gate.n, order.shape[0]
    nb, even = _nb(width, H)
    tiles, cols, warps, col_blocks, splits, chunk = plan(N, E, inter, H, nb, 2, _sms(x))
    two_x = gate.perm_digest != up.perm_digest
    xp = _gathered(x, order, counts, (gate.perm, up.perm) if two_x else (gate.perm,), E, H, splits * chunk, tiles,
                   top_k)
    ws = _workspace(x.device, N * 2 * inter)  # split-K sums: gate | up per sorted row
    _rows_kernel[(tiles, col_blocks, 2 * splits)](
        xp, order, counts, gate.q_weight, gate.scales, gate.scale_max, gate.word, gate.info,
        up.q_weight, up.scales, up.scale_max, up.word, up.info,
        ws, E, H, splits * chunk, inter, gate.q_weight.stride(0), gate.scales.stride(0), up.q_weight.stride(0),
        up.scales.stride(0), 2 * inter, chunk, splits, tiles, _MAGIC,
        E_P2=triton.next_power_of_2(E), R=ROWS, BLOCK_N=cols, B=width, NB=nb, EVEN=even, GATE_UP=True,
        TWO_X=two_x, RSTEP=_step(width), num_warps=warps, num_stages=1, **_cap(even, x))
    block = min(1024, triton.next_power_of_2(inter))
    _act_kernel[(N, triton.cdiv(inter, block))](ws, out, inter, out.stride(0), ACT=_ACTS[kind], BLOCK=block,
                                                num_warps=4)
    return out


def down_rows(a: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, down: ExpertStack, width: int,
              y: torch.Tensor) -> torch.Tensor:
    """moe_down_exl2 for an aligned stack (`width`: its one width, 0 for mixed) at a few rows per expert."""
    E, inter, H, N = down.num_experts, down.k, down.n, order.shape[0]
    nb, even = _nb(width, inter)
    tiles, cols, warps, col_blocks, splits, chunk = plan(N, E, H, inter, nb, 1, _sms(a))
    xp = _gathered(a, order, counts, (down.perm,), E, inter, splits * chunk, tiles, 0)
    ws = _workspace(a.device, N * H)  # split-K sums, rows in pair order
    _rows_kernel[(tiles, col_blocks, splits)](
        xp, order, counts, down.q_weight, down.scales, down.scale_max, down.word, down.info,
        down.q_weight, down.scales, down.scale_max, down.word, down.info,
        ws, E, inter, splits * chunk, H, down.q_weight.stride(0), down.scales.stride(0), down.q_weight.stride(0),
        down.scales.stride(0), H, chunk, splits, tiles, _MAGIC,
        E_P2=triton.next_power_of_2(E), R=ROWS, BLOCK_N=cols, B=width, NB=nb, EVEN=even, GATE_UP=False,
        TWO_X=False, RSTEP=_step(width), num_warps=warps, num_stages=1, **_cap(even, a))
    block = min(1024, triton.next_power_of_2(H))
    _convert_kernel[(N, triton.cdiv(H, block))](ws, y, H, y.stride(0), BLOCK=block, num_warps=4)
    return y
