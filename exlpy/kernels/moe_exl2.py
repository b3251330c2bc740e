"""Grouped GEMMs of a mixture-of-experts block whose experts are EXL2: every routed expert's gate|up (with the
activation) in one launch, every routed expert's down in another, reading the packed weights. Same contracts as
`reference.moe_gate_up_exl2 / moe_down_exl2`; the grid and the row tiles are those of the dense kernels
(exlpy/kernels/moe.py: a fixed grid for N pairs, each program finds its expert and rows from the expert counts
in device memory, programs past the last tile exit), so a launch is CUDA-graph safe and reads only the experts
some token chose.

The experts' weights come from an ExpertStack (exlpy/quant/experts.py): per expert and sorted row a table says
the row's input feature (act order), the stacked q_weight row and bit offset of its code, its width and group.
A program walks its expert's K in steps of BLOCK_K sorted rows; per step it reads the rows' table entries,
gathers x through the act order, decodes the [BLOCK_K, BLOCK_N] codes (a code's word and, for a code straddling
two words, the next one; any width 2-8, any group height: the widths are run-time values, one code path for a
converter's mixed matrices), scales them by their group's 4-bit scale code and maximum, and feeds a tensor-core
dot. The words of a step are few (BLOCK_K * bits / 32 rows of q_weight), so the gathers hit L1 after the first.

Faster cases, chosen per stack at compile time: when every group lies on the 32-row grid (`aligned`: the
converter's and exllamav2's layouts), a step is one 32-row block of one width and one scale row, read from the
block's first table entry, and the scales multiply the dot's columns afterwards; when moreover the whole stack
has one width dividing 32 (2, 4, 8 bits), the block's words are loaded once and split by compile-time shifts,
and decode tiles walk UNROLL_DECODE blocks per trip so that more loads are in flight per program.

Few rows per expert (decode: mean sorted rows per routed expert at most GEMV_MAX_ROWS; EXLPY_MOE_GEMV=0 turns
it off) of aligned stacks take the split-K GEMV kernels of exlpy/kernels/moe_exl2_gemv.py instead, and 3-16 rows
per expert (batched decode) its multi-row variant in exlpy/kernels/moe_exl2_rows.py; the wrappers here choose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.kernels import moe_exl2_gemv, moe_exl2_rows, reference
from exlpy.kernels.moe import (
    _ACTS,
    _dot,
    _sms,
    _store_gated,
    _tile,
    _tile_cols,
    _tile_rows,
    narrow_cols,
    plan,
    rows_and_out,
)
from exlpy.quant.experts import ExpertStack

BLOCK_K = 32  # sorted rows per K step: one 32-row block of an aligned stack
STAGES = 2
COLS = 64  # column tile (fp16 / bf16), before the decode narrowing; `benchmarks/moe.py --sweep` times others
WARPS = 4  # warps per program of 16- and 32-row tiles (64-row tiles and fp32 take 8)
UNROLL_DECODE = 4
WAVES = 3  # decode: column tiles narrowed while the routed experts' programs fill the SMs less than this often


@triton.jit
def _dequant(qw_ptr, sc_ptr, sm_ptr, perm_ptr, word_ptr, info_ptr, e_row, kk, k_ok, cols, col_ok, ldq, lds):
    """(input features [BLOCK_K], W rows [BLOCK_K, BLOCK_N] fp32) of sorted rows kk of the expert whose tables
    start at e_row. Rows past K read width 4, weight 0."""
    perm = tl.load(perm_ptr + e_row + kk, mask=k_ok, other=0)
    word = tl.load(word_ptr + e_row + kk, mask=k_ok, other=0).to(tl.int64)
    info = tl.load(info_ptr + e_row + kk, mask=k_ok, other=4 << 5)
    off = info & 31
    bits = (info >> 5) & 15
    grp = (info >> 9).to(tl.int64)
    m2 = k_ok[:, None] & col_ok[None, :]
    at = qw_ptr + word[:, None] * ldq + cols[None, :]
    lo = tl.load(at, mask=m2, other=0).to(tl.uint32, bitcast=True)
    straddle = (off + bits) > 32
    hi = tl.load(at + ldq, mask=m2 & straddle[:, None], other=0).to(tl.uint32, bitcast=True)
    code = (lo >> off.to(tl.uint32)[:, None]) | (hi << ((32 - off) & 31).to(tl.uint32)[:, None])
    code = code & ((1 << bits) - 1).to(tl.uint32)[:, None]
    q = code.to(tl.int32) - (1 << (bits - 1))[:, None]
    sw = tl.load(sc_ptr + grp[:, None] * lds + (cols // 8)[None, :], mask=m2, other=0).to(tl.uint32, bitcast=True)
    c1 = ((sw >> ((cols % 8) * 4).to(tl.uint32)[None, :]) & 15).to(tl.float32) + 1.0
    s = c1 * c1 * tl.load(sm_ptr + grp, mask=k_ok, other=0.0)[:, None]
    return perm, tl.where(m2, q.to(tl.float32) * s, 0.0)


@triton.jit
def _words_codes(qw_ptr, w0, ldq, cols, col_ok, rows_left, B: tl.constexpr):
    """Codes [32, BLOCK_N] of a 32-row block of width B dividing 32 (2, 4, 8): its B words per column loaded once
    (no per-row gather) and split by compile-time shifts; row 32 / B * w + j is field j of word w. Words holding
    no row below `rows_left` are not read (the last block of the last expert ends the stack). A run-time choice
    between this and the gather (mixed widths) would stop Triton pipelining the loop's loads: the width is a
    property of the stack, a compile-time constant."""
    PER: tl.constexpr = 32 // B
    wi = tl.arange(0, B)
    ok = (wi * PER < rows_left)[:, None] & col_ok[None, :]
    w = tl.load(qw_ptr + (w0 + wi)[:, None] * ldq + cols[None, :], mask=ok, other=0).to(tl.uint32, bitcast=True)
    sh = (tl.arange(0, PER) * B).to(tl.uint32)
    codes = (w[:, None, :] >> sh[None, :, None]) & ((1 << B) - 1)
    return tl.reshape(codes, [32, cols.shape[0]])


@triton.jit
def _codes32(qw_ptr, sc_ptr, sm_ptr, word_ptr, info_ptr, e_row, k0, k_ok, cols, col_ok, ldq, lds, K,
             WIDTH: tl.constexpr):
    """(q - z [32, BLOCK_N] fp32, scale [BLOCK_N] fp32) of the 32-row block of sorted rows from k0, for stacks
    whose every block lies in one group (`ExpertStack.aligned`): one width, one scale row, starting on a word,
    all read from the block's first table entry. The scale is applied per column after the dot. WIDTH 2, 4 or 8
    (every group of the stack that wide): the block's words are loaded once and split by compile-time shifts;
    WIDTH 0 (mixed or 3, 5, 6 bits: codes straddle words): each row's word(s) gathered at the block's width."""
    inside = k0 < K  # an unrolled trip's blocks past K read nothing
    w0 = tl.load(word_ptr + e_row + k0, mask=inside, other=0).to(tl.int64)
    info = tl.load(info_ptr + e_row + k0, mask=inside, other=4 << 5)
    grp = (info >> 9).to(tl.int64)
    if WIDTH != 0:
        bits = WIDTH
        code = _words_codes(qw_ptr, w0, ldq, cols, col_ok, K - k0, WIDTH)
    else:
        bits = (info >> 5) & 15
        bit = tl.arange(0, 32) * bits
        off = bit % 32
        m2 = k_ok[:, None] & col_ok[None, :]
        at = qw_ptr + (w0 + bit // 32)[:, None] * ldq + cols[None, :]
        lo = tl.load(at, mask=m2, other=0).to(tl.uint32, bitcast=True)
        hi = tl.load(at + ldq, mask=m2 & ((off + bits) > 32)[:, None], other=0).to(tl.uint32, bitcast=True)
        code = ((lo >> off.to(tl.uint32)[:, None]) | (hi << ((32 - off) & 31).to(tl.uint32)[:, None])) & \
            ((1 << bits) - 1).to(tl.uint32)
    q = (code.to(tl.int32) - (1 << (bits - 1))).to(tl.float32)
    sw = tl.load(sc_ptr + grp * lds + cols // 8, mask=col_ok, other=0).to(tl.uint32, bitcast=True)
    c1 = ((sw >> ((cols % 8) * 4).to(tl.uint32)) & 15).to(tl.float32) + 1.0
    return q, c1 * c1 * tl.load(sm_ptr + grp)


@triton.jit
def _gate_up_exl2_kernel(x_ptr, order_ptr, counts_ptr,
                         g_qw, g_sc, g_sm, g_perm, g_word, g_info,
                         u_qw, u_sc, u_sm, u_perm, u_word, u_info,
                         out_ptr, E, H, INTER, g_ldq, g_lds, u_ldq, u_lds, top_k, sx, so,
                         E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         ACT: tl.constexpr, IEEE: tl.constexpr, SAME_PERM: tl.constexpr,
                         ALIGNED: tl.constexpr, G_WIDTH: tl.constexpr, U_WIDTH: tl.constexpr,
                         UNROLL: tl.constexpr):
    expert, row0, end = _tile(counts_ptr, tl.program_id(0), E, E_P2, BLOCK_M)
    if expert < E:
        rows, live, pairs = _tile_rows(order_ptr, row0, end, BLOCK_M)
        tok = pairs // top_k
        cols, col_ok = _tile_cols(INTER, BLOCK_N)
        e_row = expert.to(tl.int64) * H
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        xrow = x_ptr + tok[:, None].to(tl.int64) * sx
        for kb in range(0, H, BLOCK_K * UNROLL):  # UNROLL blocks per trip: their loads in flight together
            for j in tl.static_range(UNROLL):
                k0 = kb + j * BLOCK_K
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < H
                xm = live[:, None] & k_ok[None, :]
                pg = tl.load(g_perm + e_row + kk, mask=k_ok, other=0)
                xg = tl.load(xrow + pg[None, :], mask=xm, other=0.0)
                if SAME_PERM:
                    xu = xg
                else:
                    pu = tl.load(u_perm + e_row + kk, mask=k_ok, other=0)
                    xu = tl.load(xrow + pu[None, :], mask=xm, other=0.0)
                if ALIGNED:
                    zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    qg, sg = _codes32(g_qw, g_sc, g_sm, g_word, g_info, e_row, k0, k_ok, cols, col_ok, g_ldq, g_lds, H,
                                      G_WIDTH)
                    acc_g += _dot(xg, qg.to(xg.dtype), zero, IEEE) * sg[None, :]
                    qu, su = _codes32(u_qw, u_sc, u_sm, u_word, u_info, e_row, k0, k_ok, cols, col_ok, u_ldq, u_lds, H,
                                      U_WIDTH)
                    acc_u += _dot(xu, qu.to(xu.dtype), zero, IEEE) * su[None, :]
                else:
                    _, wg = _dequant(g_qw, g_sc, g_sm, g_perm, g_word, g_info, e_row, kk, k_ok, cols, col_ok, g_ldq,
                                     g_lds)
                    _, wu = _dequant(u_qw, u_sc, u_sm, u_perm, u_word, u_info, e_row, kk, k_ok, cols, col_ok, u_ldq,
                                     u_lds)
                    acc_g = _dot(xg, wg.to(xg.dtype), acc_g, IEEE)
                    acc_u = _dot(xu, wu.to(xu.dtype), acc_u, IEEE)
        _store_gated(out_ptr, so, rows, live, cols, col_ok, acc_g, acc_u, ACT)


@triton.jit
def _down_exl2_kernel(a_ptr, order_ptr, counts_ptr, qw, sc, sm, perm_ptr, word_ptr, info_ptr, y_ptr,
                      E, H, INTER, ldq, lds, sa, sy,
                      E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      IEEE: tl.constexpr, ALIGNED: tl.constexpr, WIDTH: tl.constexpr, UNROLL: tl.constexpr):
    expert, row0, end = _tile(counts_ptr, tl.program_id(0), E, E_P2, BLOCK_M)
    if expert < E:
        rows, live, pair = _tile_rows(order_ptr, row0, end, BLOCK_M)
        cols, col_ok = _tile_cols(H, BLOCK_N)
        e_row = expert.to(tl.int64) * INTER
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        arow = a_ptr + rows[:, None].to(tl.int64) * sa
        for kb in range(0, INTER, BLOCK_K * UNROLL):  # UNROLL blocks per trip: their loads in flight together
            for j in tl.static_range(UNROLL):
                k0 = kb + j * BLOCK_K
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < INTER
                p = tl.load(perm_ptr + e_row + kk, mask=k_ok, other=0)
                at = tl.load(arow + p[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
                if ALIGNED:
                    q, sc_n = _codes32(qw, sc, sm, word_ptr, info_ptr, e_row, k0, k_ok, cols, col_ok, ldq, lds, INTER,
                                       WIDTH)
                    acc += _dot(at, q.to(at.dtype), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE) * sc_n[None, :]
                else:
                    _, w = _dequant(qw, sc, sm, perm_ptr, word_ptr, info_ptr, e_row, kk, k_ok, cols, col_ok, ldq, lds)
                    acc = _dot(at, w.to(at.dtype), acc, IEEE)
        tl.store(y_ptr + pair[:, None] * sy + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


def _tiles(n_pairs: int, n_experts: int, n_out: int, sms: int, elem_bytes: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, row tiles): the dense kernels' tile height and grid; column tiles of 64 (32 for
    fp32 activations, which would spill), narrowed at decode while the routed experts' programs would fill the
    device less than WAVES times."""
    block_m, _, _, _, tiles = plan(n_pairs, n_experts)
    routed = max(1, min(n_experts, n_pairs))
    block_n = COLS if elem_bytes <= 2 else 32
    if block_m == 16:
        block_n = narrow_cols(block_n, routed, n_out, sms, WAVES)
    return block_m, block_n, WARPS if block_m <= 32 and elem_bytes <= 2 else 8, tiles


def _unroll(block_m: int, width: int, elem_bytes: int = 2) -> int:
    """32-row blocks per loop trip: decode tiles (16 rows) of one-width stacks take UNROLL_DECODE, whose loads
    are independent, so more bytes are in flight per program (a decode step is a few programs per SM, each
    walking its expert's K); the gather paths and fp32 activations keep one (their registers are spent). 8-bit
    stacks take half: their gate|up tile at 4 blocks per trip spilled 44 bytes under Triton 3.6 (the GPU image;
    benchmarks/moe_compile_check.py), none at 2."""
    if not (block_m == 16 and width and elem_bytes <= 2):
        return 1
    return UNROLL_DECODE // 2 if width == 8 else UNROLL_DECODE


def _width(stack: ExpertStack) -> int:
    """The one width of an aligned stack's codes when it divides 32 (the words-once path), else 0."""
    return stack.width if stack.aligned and stack.width in (2, 4, 8) else 0


def moe_gate_up_exl2(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, gate: ExpertStack,
                     up: ExpertStack, top_k: int, kind: str) -> torch.Tensor:
    """Same contract as `reference.moe_gate_up_exl2` (activations silu and gelu_tanh; ops sends others there)."""
    E, H, inter, N = gate.num_experts, gate.k, gate.n, order.shape[0]
    x, out = rows_and_out(x, N, inter)
    if N == 0:
        return out
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return reference.moe_gate_up_exl2(x, order, counts, gate, up, top_k, kind)
    width = moe_exl2_gemv.gemv_width(gate, up)
    if width is not None and moe_exl2_gemv.gemv_rows(N, E):
        return moe_exl2_gemv.gate_up_gemv(x, order, counts, gate, up, top_k, kind, width, out)
    if width is not None and moe_exl2_rows.takes(N, E, width):  # 3-16 rows per expert: each word decoded once for all
        return moe_exl2_rows.gate_up_rows(x, order, counts, gate, up, top_k, kind, width, out)
    bm, bn, warps, tiles = _tiles(N, E, inter, _sms(x), x.element_size())
    _gate_up_exl2_kernel[(tiles, triton.cdiv(inter, bn))](
        x, order, counts, gate.q_weight, gate.scales, gate.scale_max, gate.perm, gate.word, gate.info,
        up.q_weight, up.scales, up.scale_max, up.perm, up.word, up.info,
        out, E, H, inter, gate.q_weight.stride(0), gate.scales.stride(0), up.q_weight.stride(0),
        up.scales.stride(0), top_k, x.stride(0), out.stride(0),
        E_P2=triton.next_power_of_2(E), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, ACT=_ACTS[kind],
        IEEE=x.dtype == torch.float32, SAME_PERM=gate.perm_digest == up.perm_digest,
        ALIGNED=gate.aligned and up.aligned, G_WIDTH=_width(gate), U_WIDTH=_width(up),
        UNROLL=_unroll(bm, _width(gate) and _width(up), x.element_size()), num_warps=warps,
        num_stages=STAGES)
    return out


def moe_down_exl2(a: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, down: ExpertStack) -> torch.Tensor:
    """Same contract as `reference.moe_down_exl2`."""
    E, inter, H, N = down.num_experts, down.k, down.n, order.shape[0]
    a, y = rows_and_out(a, N, H)
    if N == 0:
        return y
    if a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return reference.moe_down_exl2(a, order, counts, down)
    width = moe_exl2_gemv.gemv_width(down)
    if width is not None and moe_exl2_gemv.gemv_rows(N, E):
        return moe_exl2_gemv.down_gemv(a, order, counts, down, width, y)
    if width is not None and moe_exl2_rows.takes(N, E, width):  # 3-16 rows per expert: each word decoded once for all
        return moe_exl2_rows.down_rows(a, order, counts, down, width, y)
    bm, bn, warps, tiles = _tiles(N, E, H, _sms(a), a.element_size())
    _down_exl2_kernel[(tiles, triton.cdiv(H, bn))](
        a, order, counts, down.q_weight, down.scales, down.scale_max, down.perm, down.word, down.info, y,
        E, H, inter, down.q_weight.stride(0), down.scales.stride(0), a.stride(0), y.stride(0),
        E_P2=triton.next_power_of_2(E), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, IEEE=a.dtype == torch.float32,
        ALIGNED=down.aligned, WIDTH=_width(down), UNROLL=_unroll(bm, _width(down), a.element_size()), num_warps=warps,
        num_stages=STAGES)
    return y
