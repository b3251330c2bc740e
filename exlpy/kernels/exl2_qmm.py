"""Matmul of 2..64 activation rows on packed EXL2/GPTQ weights: y[M, N] = x[M, K] @ W, reading W once per call.

Decode batches and speculative verification steps multiply a few rows by every weight matrix: the packed
weights are what must be read, once, near the memory rate. Dequantizing W to fp16 first (the prefill path)
writes and reads 4x the packed bytes again; this kernel instead dequantizes each weight tile in registers
once and multiplies it into all M rows with tensor cores (fp16 in, fp32 accumulate, M padded to 16/32/64).

How a tile is laid out so that every packed word is loaded once and every code is extracted with
compile-time shifts:

- K is walked in steps of KB blocks of 32 rows. A block of a b-bit segment is b whole words per column, so
  the step loads b word tiles [KB, BLOCK_N] (word j of each block) and code position i (0..31) of every block
  is one [KB, BLOCK_N] tensor taken from word (i*b)//32 (and the next one where it straddles) by constant
  shifts. A tree of tl.join stacks the 32 positions into one [32 KB, BLOCK_N] tile whose K order is each
  block's positions bit-reversed; x is gathered beforehand into that same order (gather_rows: the act-order
  permutation, the bit reversal and the RMSNorm of q|k|v / gate|up in one pass), so one tl.dot per step
  takes a contiguous x tile [BLOCK_M, 32 KB].
- A code becomes fp32 without an int -> float conversion: shifted to the top of the mantissa of 1.0
  (1 + q 2^-b), one FMA by the per-block constants s 2^b and -(2^b + z) s gives (q - z) s (the constant's
  rounding is ~2^-15 of a step); the tile goes to fp16 for the dot.
- Scales are per 32-row block (every group spans whole blocks): a K range may start and end on any block,
  so the split over K is as fine as the grid needs. EXL2: 4-bit scale codes and the group's max; GPTQ: fp16
  scales and per-column zero points.

One launch covers every matrix of a plan (q|k|v, gate|up) and, with CONFIG["ONE_LAUNCH"], every bit width:
each program reads its task (a column block, rows of the plan's segment table) from the plan's int64 table and
branches on each segment's width at run time. Split-K
partial sums meet in a per-device fp32 workspace by atomics; the last program to arrive at a column block
(a self-resetting counter) adds bias and residual, writes y and zeroes its part of the workspace: no memset,
no host sync, CUDA-graph safe. As with the GEMV, two of these must not run concurrently on different streams
of one device (decode runs one stream per device).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exlpy.kernels import pdl
from exlpy.kernels.exl2_gemv_plan import cuda_device as _device
from exlpy.kernels.exl2_qmm_plan import (
    CONFIG,
    FIELDS,
    MAX_ROWS,
    SEG_FIELDS,
    WS_BLOCKS,
    WS_ELEMS,
    QmmPlan,
    block_m,
    plan_for,
)
from exlpy.kernels.exl2_tc_plan import takes as tc_takes
from exlpy.kernels.exl2_tc_plan import wanted as tc_wanted
from exlpy.quant.layout import QuantMatrix

__all__ = ["QmmGroup", "gather_rows", "prepare", "qmm", "run_plan"]

_CB = tl.constexpr(FIELDS.index("cb"))
_N = tl.constexpr(FIELDS.index("n"))
_LD_N = tl.constexpr(FIELDS.index("ld_n"))
_S_QW = tl.constexpr(FIELDS.index("s_qw"))
_O_SC = tl.constexpr(FIELDS.index("o_sc"))
_S_SC = tl.constexpr(FIELDS.index("s_sc"))
_O_AUX = tl.constexpr(FIELDS.index("o_aux"))
_S_AUX = tl.constexpr(FIELDS.index("s_aux"))
_O_BG = tl.constexpr(FIELDS.index("o_bg"))
_O_Y = tl.constexpr(FIELDS.index("o_y"))
_CNT = tl.constexpr(FIELDS.index("cnt"))
_ARRIVALS = tl.constexpr(FIELDS.index("arrivals"))
_SEG_LO = tl.constexpr(FIELDS.index("seg_lo"))
_SEG_HI = tl.constexpr(FIELDS.index("seg_hi"))
_BITS = tl.constexpr(SEG_FIELDS.index("bits"))
_BLK_LO = tl.constexpr(SEG_FIELDS.index("blk_lo"))
_BLK_HI = tl.constexpr(SEG_FIELDS.index("blk_hi"))
_SB0 = tl.constexpr(SEG_FIELDS.index("sb0"))
_O_QW = tl.constexpr(SEG_FIELDS.index("o_qw"))


@triton.jit
def _code(lo, hi, one, i: tl.constexpr, BITS: tl.constexpr):
    """Code position i of a block as fp32 1 + q 2^-BITS: its field moved to mantissa bits [23 - BITS, 23)
    and OR-ed into 1.0 (`one` = 0x3F800000 passed at run time so the AND-OR is one LOP3)."""
    off: tl.constexpr = (i * BITS) % 32
    up: tl.constexpr = 23 - BITS - off  # left shift that puts the field at the top of the mantissa
    if off + BITS > 32:  # straddles into the next word: funnel the two words first
        t = (lo >> off) | (hi << (32 - off))
        t = t << (23 - BITS)
    elif up >= 0:
        t = lo << up
    else:
        t = lo >> (-up)
    return ((t & (((1 << BITS) - 1) << (23 - BITS))) | one).to(tl.float32, bitcast=True)


@triton.jit
def _pairs(t, n: tl.constexpr):
    """Join neighbours of a tuple of n tensors: (t0 | t1, t2 | t3, ...), a new trailing dim of 2 each."""
    out = ()
    for p in tl.static_range(n // 2):
        out = out + (tl.join(t[2 * p], t[2 * p + 1]),)
    return out


@triton.jit
def _opaque(t, ASM: tl.constexpr):
    """t, through an identity PTX move when ASM. The move hides the tl.join tree that built t from Triton's
    choice of the dot operand's kWidth: with a join in the operand's history Triton 3.6 halves the width it
    assumes (kWidth 4 for fp16) and then reads the operand from shared memory with 4-byte LDS instead of
    ldmatrix (+30% instructions per weight, benchmarks/qmm_compile_check.py). The CPU interpreter runs no PTX
    (ASM False there)."""
    if ASM:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [t], dtype=tl.float16, is_pure=False,
                                         pack=2)
    return t


@triton.jit
def _segment(acc, xb_ptr, stride_xm, M, K, qw, s_qw, ld_mask, offs_n, sc, s_sc, aux, s_aux, bg,
             blk_lo, blk_hi, sb0, one, BITS: tl.constexpr, GPTQ: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, KB: tl.constexpr, ASM: tl.constexpr):
    """acc += x[:, blocks blk_lo..blk_hi) @ W[those rows, this program's columns] for one BITS-wide segment."""
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_r = tl.arange(0, KB * 32)
    for b0 in range(blk_lo, blk_hi, KB):
        kb = b0 + tl.arange(0, KB)
        k_mask = kb < blk_hi
        g = tl.load(bg + kb, mask=k_mask, other=0)
        m2 = k_mask[:, None] & ld_mask[None, :]
        if GPTQ:
            s = tl.load(sc + g[:, None] * s_sc + offs_n[None, :], mask=m2, other=0.0).to(tl.float32)
            z = tl.load(aux + g[:, None] * s_aux + offs_n[None, :], mask=m2, other=0.0).to(tl.float32)
            c0 = -((1 << BITS) + z) * s
        else:
            w = tl.load(sc + g[:, None] * s_sc + (offs_n // 8)[None, :], mask=m2, other=0)
            c1 = (((w >> ((offs_n % 8) * 4)[None, :]) & 15) + 1).to(tl.float32)
            s = c1 * c1 * tl.load(aux + g, mask=k_mask, other=0.0)[:, None]
            c0 = s * (-((1 << BITS) + (1 << (BITS - 1))))
        s = s * (1 << BITS)
        # The block's words: a partial last block (K not a multiple of 32) has fewer words than BITS.
        bits_left = (K - kb * 32) * BITS
        wp = qw + ((kb - sb0) * BITS)[:, None] * s_qw + offs_n[None, :]
        ws = ()
        for j in tl.static_range(BITS):
            # (int & int) != 0, not bool & bool: the CPU interpreter mis-types a broadcast bool &
            wm = (m2.to(tl.int32) & (bits_left > j * 32).to(tl.int32)[:, None]) != 0
            ws = ws + (tl.load(wp + j * s_qw, mask=wm, other=0).to(tl.uint32, bitcast=True),)
        # The 32 code positions of every block, dequantized, [KB, BLOCK_N] each ...
        cs = ()
        for i in tl.static_range(32):
            if (i * BITS) % 32 + BITS > 32:
                f = _code(ws[(i * BITS) // 32], ws[(i * BITS) // 32 + 1], one, i, BITS)
            else:
                f = _code(ws[(i * BITS) // 32], ws[(i * BITS) // 32], one, i, BITS)
            cs = cs + ((f * s + c0).to(tl.float16),)
        # ... stacked by a tree of joins into [KB, BLOCK_N, 2, 2, 2, 2, 2], i.e. [KB, BLOCK_N, 32] whose
        # position p holds code bitrev5(p) (blocked x is stored in that order), then [KB * 32, BLOCK_N].
        t = _pairs(_pairs(_pairs(_pairs(_pairs(cs, 32), 16), 8), 4), 2)[0]
        wt = _opaque(tl.reshape(tl.permute(tl.reshape(t, (KB, BLOCK_N, 32)), (0, 2, 1)), (KB * 32, BLOCK_N)), ASM)
        xm = m_mask[:, None] & (b0 * 32 + offs_r < blk_hi * 32)[None, :]
        xv = tl.load(xb_ptr + offs_m[:, None] * stride_xm + b0 * 32 + offs_r[None, :], mask=xm, other=0.0)
        acc = tl.dot(xv, wt, acc)
    return acc


@triton.jit
def _piece(acc, sg, xb_ptr, qw_ptr, stride_xm, M, K, s_qw, ld_mask, offs_n, sc, s_sc, aux, s_aux, bg, one,
           WIDTHS: tl.constexpr, GPTQ: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, KB: tl.constexpr, ASM: tl.constexpr):
    """acc += the segment-table row at `sg` (one width's run of blocks) for this program's columns."""
    bits = tl.load(sg + _BITS).to(tl.int32)
    blk_lo = tl.load(sg + _BLK_LO).to(tl.int32)
    blk_hi = tl.load(sg + _BLK_HI).to(tl.int32)
    sb0 = tl.load(sg + _SB0).to(tl.int32)
    o_qw = tl.load(sg + _O_QW)
    if ALIGNED:
        o_qw = tl.multiple_of(o_qw, 4)
    qw = qw_ptr + o_qw
    # One branch per bit width the launch holds (WIDTHS: bit b set for width b), chosen at run time.
    if (WIDTHS >> 4) & 1:
        if bits == 4:
            acc = _segment(acc, xb_ptr, stride_xm, M, K, qw, s_qw, ld_mask, offs_n, sc, s_sc, aux, s_aux, bg, blk_lo,
                           blk_hi, sb0, one, 4, GPTQ, BLOCK_M, BLOCK_N, KB, ASM)
    if (WIDTHS >> 3) & 1:
        if bits == 3:
            acc = _segment(acc, xb_ptr, stride_xm, M, K, qw, s_qw, ld_mask, offs_n, sc, s_sc, aux, s_aux, bg, blk_lo,
                           blk_hi, sb0, one, 3, GPTQ, BLOCK_M, BLOCK_N, KB, ASM)
    if (WIDTHS >> 2) & 1:
        if bits == 2:
            acc = _segment(acc, xb_ptr, stride_xm, M, K, qw, s_qw, ld_mask, offs_n, sc, s_sc, aux, s_aux, bg, blk_lo,
                           blk_hi, sb0, one, 2, GPTQ, BLOCK_M, BLOCK_N, KB, ASM)
    if (WIDTHS >> 5) & 1:
        if bits == 5:
            acc = _segment(acc, xb_ptr, stride_xm, M, K, qw, s_qw, ld_mask, offs_n, sc, s_sc, aux, s_aux, bg, blk_lo,
                           blk_hi, sb0, one, 5, GPTQ, BLOCK_M, BLOCK_N, KB, ASM)
    if (WIDTHS >> 6) & 1:
        if bits == 6:
            acc = _segment(acc, xb_ptr, stride_xm, M, K, qw, s_qw, ld_mask, offs_n, sc, s_sc, aux, s_aux, bg, blk_lo,
                           blk_hi, sb0, one, 6, GPTQ, BLOCK_M, BLOCK_N, KB, ASM)
    if (WIDTHS >> 8) & 1:
        if bits == 8:
            acc = _segment(acc, xb_ptr, stride_xm, M, K, qw, s_qw, ld_mask, offs_n, sc, s_sc, aux, s_aux, bg, blk_lo,
                           blk_hi, sb0, one, 8, GPTQ, BLOCK_M, BLOCK_N, KB, ASM)
    return acc


@triton.jit(do_not_specialize=["M"])  # one compiled variant per BLOCK_M, whatever the row count
def _qmm(xb_ptr, qw_ptr, sc_ptr, aux_ptr, bg_ptr, bias_ptr, res_ptr, y_ptr, ws_ptr, cnt_ptr, task_ptr, seg_ptr, M,
         K, n_total, stride_xm, stride_ym, stride_rm, one, WIDTHS: tl.constexpr, GPTQ: tl.constexpr,
         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr, ALIGNED: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, NF: tl.constexpr, NS: tl.constexpr,
         MULTI: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr):
    """One program per task row: its column block over the segment-table rows seg_lo..seg_hi. SPLIT 0: each
    column block has one program, which writes y; SPLIT 1: programs add into the workspace [M, n_total], and
    the last to arrive at a column block writes y and resets its workspace and counter. aux: EXL2 scale_max
    [G] / GPTQ zeros [G, Np]."""
    t = task_ptr + tl.program_id(0) * NF
    cb = tl.load(t + _CB).to(tl.int32)
    n = tl.load(t + _N).to(tl.int32)
    ld_n = tl.load(t + _LD_N).to(tl.int32)
    s_qw = tl.load(t + _S_QW)
    if ALIGNED:  # keeps 16-byte word loads with run-time offsets and strides
        ld_n = tl.multiple_of(ld_n, 32)
        s_qw = tl.multiple_of(s_qw, 4)
    sc = sc_ptr + tl.load(t + _O_SC)
    s_sc = tl.load(t + _S_SC)
    aux = aux_ptr + tl.load(t + _O_AUX)
    s_aux = tl.load(t + _S_AUX)
    bg = bg_ptr + tl.load(t + _O_BG)
    seg_lo = tl.load(t + _SEG_LO).to(tl.int32)
    seg_hi = tl.load(t + _SEG_HI).to(tl.int32) if MULTI else seg_lo + 1
    offs_n = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    ld_mask = offs_n < ld_n
    if PDL:  # launched early (exlpy/kernels/pdl.py): the task row above is static; x, y, workspace are not
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if MULTI:  # column blocks computed whole: every segment of the matrix, one after the other
        for si in range(seg_lo, seg_hi):
            acc = _piece(acc, seg_ptr + si * NS, xb_ptr, qw_ptr, stride_xm, M, K, s_qw, ld_mask, offs_n, sc, s_sc,
                         aux, s_aux, bg, one, WIDTHS, GPTQ, ALIGNED, BLOCK_M, BLOCK_N, KB, ASM)
    else:  # one segment piece (an outer loop here costs ~80 registers of the pipelined inner loop)
        acc = _piece(acc, seg_ptr + seg_lo * NS, xb_ptr, qw_ptr, stride_xm, M, K, s_qw, ld_mask, offs_n, sc, s_sc,
                     aux, s_aux, bg, one, WIDTHS, GPTQ, ALIGNED, BLOCK_M, BLOCK_N, KB, ASM)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = tl.arange(0, BLOCK_M)
    out_mask = (offs_m < M)[:, None] & (offs_n < n)[None, :]
    cols = tl.load(t + _O_Y) + offs_n  # columns in the plan's y
    if SPLIT:
        wsp = ws_ptr + offs_m[:, None] * n_total + cols[None, :]
        tl.atomic_add(wsp, acc, mask=out_mask, sem="relaxed")
        tl.debug_barrier()  # every thread's partial is in before the arrival is counted
        cnt = cnt_ptr + tl.load(t + _CNT)
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
        if arrived == tl.load(t + _ARRIVALS).to(tl.int32) - 1:
            # Take the sums and zero them in one atomic exchange per element (in L2, where the atomics put
            # them). Never a load then a store of zeros: compiled, the two are laid out over different threads
            # (Triton 3.6 gives the atomics their own layout) and nothing orders them, so a thread could zero
            # a sum before another had read it: the lost sums (rel_err 0.35-0.68) of the first GPU run.
            # (as int32 words: the CPU interpreter exchanges no floats)
            wsi = ws_ptr.to(tl.pointer_type(tl.int32)) + offs_m[:, None] * n_total + cols[None, :]
            tot = tl.atomic_xchg(wsi, tl.zeros((BLOCK_M, BLOCK_N), tl.int32), mask=out_mask, sem="relaxed").to(
                tl.float32, bitcast=True)
            if HAS_BIAS:
                tot += tl.load(bias_ptr + cols, mask=offs_n < n, other=0.0).to(tl.float32)[None, :]
            if HAS_RES:
                tot += tl.load(res_ptr + offs_m[:, None] * stride_rm + cols[None, :], mask=out_mask,
                               other=0.0).to(tl.float32)
                tl.debug_barrier()  # y may be the residual itself: every read of it before any write
            tl.store(y_ptr + offs_m[:, None] * stride_ym + cols[None, :], tot.to(y_ptr.dtype.element_ty),
                     mask=out_mask)
            tl.atomic_xchg(cnt, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=offs_n < n, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + cols[None, :], mask=out_mask,
                           other=0.0).to(tl.float32)
            tl.debug_barrier()  # y may be the residual itself: every read of it before any write
        tl.store(y_ptr + offs_m[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)


@triton.jit
def _gather(x_ptr, w_ptr, src_ptr, out_ptr, K, P, stride_x, stride_o, eps, NORM: tl.constexpr,
            BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[m, j] = x[m, src[j]] (* w[src[j]] * rsqrt(mean(x[m]²) + eps) with NORM) as fp16; 0 where src < 0."""
    m = tl.program_id(1)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(src_ptr + j, mask=j < P, other=-1)
    ok = src >= 0
    if PDL:  # launched early (exlpy/kernels/pdl.py): x comes from the previous kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    v = tl.load(x_ptr + m * stride_x + src, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        # every program reduces its whole row itself (a few KB from L2): no second launch
        ss = tl.zeros((BLOCK,), tl.float32)
        for k0 in range(0, K, BLOCK):
            xk = tl.load(x_ptr + m * stride_x + k0 + tl.arange(0, BLOCK), mask=k0 + tl.arange(0, BLOCK) < K,
                         other=0.0).to(tl.float32)
            ss += xk * xk
        v = v * tl.load(w_ptr + src, mask=ok, other=0.0).to(tl.float32) * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    tl.store(out_ptr + m * stride_o + j, v.to(tl.float16), mask=j < P)


_GATHER_BLOCK = 1024


def gather_rows(x: torch.Tensor, plan: QmmPlan, norm_weight: torch.Tensor | None = None, eps: float = 0.0
                ) -> torch.Tensor:
    """x [M, K] -> fp16 [M, 32 * nblk] in the plan's blocked act order (rms_norm'd first with norm_weight)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    p = 32 * plan.nblk
    out = torch.empty(m, p, dtype=torch.float16, device=x.device)
    _gather[(triton.cdiv(p, _GATHER_BLOCK), m)](x, norm_weight if norm_weight is not None else x, plan.src, out,
                                                k, p, x.stride(0), out.stride(0), eps, NORM=norm_weight is not None,
                                                BLOCK=_GATHER_BLOCK, num_warps=4, PDL=pdl.enabled(x.device),
                                                **pdl.launch_options(x.device))
    return out


@functools.cache
def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device zeroed (fp32 partial sums, int32 arrival counters); fixed size, kept zero by the kernel."""
    return (torch.zeros(WS_ELEMS, dtype=torch.float32, device=device),
            torch.zeros(WS_BLOCKS, dtype=torch.int32, device=device))


def prepare(device: torch.device) -> None:
    """Allocate the device's workspace now (outside any CUDA-graph capture)."""
    if device.type == "cuda":
        _workspace(_device(device))


_ONE = 0x3F800000  # fp32 1.0


def run_plan(plan: QmmPlan, xb: torch.Tensor, parts: list[QuantMatrix], bias: torch.Tensor | None,
             residual: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Launch `plan` over `parts` (the tensors its offsets are relative to) with blocked x `xb` [M, 32 nblk];
    writes and returns `out` [M, N total] (may be `residual` itself: the residual is added in place)."""
    m = xb.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the multi-row kernel takes 1..{MAX_ROWS} rows, got {m}")
    q0 = parts[0]
    ws, cnt = _workspace(_device(xb.device))
    aux = q0.scale_max if q0.kind == "exl2" else q0.zeros
    assert aux is not None
    bm = block_m(m)
    if plan.block_n != CONFIG[f"BLOCK_N_{bm}"]:
        raise ValueError(f"plan made for BLOCK_N {plan.block_n}, {m} rows launch with {CONFIG[f'BLOCK_N_{bm}']}")
    res = residual if residual is not None else out
    dev = _device(xb.device)
    for ln in plan.launches:
        _qmm[(ln.programs,)](
            xb, q0.q_weight, q0.scales, aux, plan.block_groups, bias if bias is not None else out, res, out, ws,
            cnt, ln.tasks, plan.segments, m, plan.k, plan.n, xb.stride(0), out.stride(0), res.stride(0), _ONE,
            WIDTHS=ln.widths, GPTQ=q0.kind == "gptq", HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            SPLIT=plan.split, ALIGNED=plan.aligned, BLOCK_M=bm, BLOCK_N=plan.block_n, KB=plan.kb, NF=len(FIELDS),
            NS=len(SEG_FIELDS), MULTI=plan.multi, PDL=pdl.enabled(dev), ASM=dev.type == "cuda",
            num_warps=CONFIG[f"WARPS_{bm}"],
            num_stages=CONFIG[f"STAGES_{bm}"] if ln.widths & (ln.widths - 1) == 0 else CONFIG["STAGES_MIXED"],
            **pdl.launch_options(dev))
    return out


def qmm(x: torch.Tensor, parts: list[QuantMatrix], bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0
        ) -> torch.Tensor:
    """x [M, K] (rms_norm'd with norm_weight when given) @ [parts side by side] (+ bias) -> [M, N total] in x's
    dtype, or added into `residual` [M, N total] (contiguous) in place and returned. The parts share K and
    act order; the caller checks exl2_qmm_plan.supports for each. More than 64 rows (EXLPY_TC_MAX_ROWS) run the
    tensor-core kernel, or dequantize + cuBLAS where it cannot plan the layout."""
    if tc_takes(x.shape[0], parts[0].k, sum(p.n for p in parts)):
        from exlpy.kernels.exl2_tc import tc_matmul

        try:
            return tc_matmul(x, parts, bias, residual, norm_weight, eps)
        except ValueError:  # a layout the tensor-core kernel cannot plan (checked before any launch)
            pass
    if x.shape[0] > MAX_ROWS:
        return _dequant_rows(x, parts, bias, residual, norm_weight, eps)
    plan = plan_for(parts, parts[0].perm, block_m(x.shape[0]))
    xb = gather_rows(x, plan, norm_weight, eps)
    out = residual if residual is not None else torch.empty(x.shape[0], plan.n, dtype=x.dtype, device=x.device)
    return run_plan(plan, xb, parts, bias, residual, out)


class QmmGroup:
    """Matrices that read the same x in the same act order (one matrix, q|k|v, gate|up), multiplied by 2..64
    rows in one launch into one output [M, sum N]. The plan (task table, block -> group and x-gather tables on
    the device) is made here, at load time, never inside a CUDA-graph capture, and held for the group's life."""

    def __init__(self, parts: list[QuantMatrix], bias: torch.Tensor | None) -> None:
        self.parts = parts
        self.bias = bias
        self.perm = parts[0].perm
        self.n = sum(p.n for p in parts)
        self._plans: dict[int, tuple[tuple[tuple[str, int], ...], QmmPlan]] = {}
        for bm in (16, 32, 64):
            self.plan(bm)
        prepare(parts[0].device)
        # the tensor-core kernel, where EXLPY_QMM_KERNEL or its table may choose it (its plans are made now, at
        # load time; none are made while it is off, to keep their device tables out of every model's memory)
        self.tc = _tc_group(parts, bias) if tc_wanted() else None

    def plan(self, bm: int) -> QmmPlan:
        """The plan for BLOCK_M `bm`: made at load time for every class, and again after CONFIG changes
        (launch-parameter sweeps, which recapture graphs)."""
        cfg = tuple(sorted(CONFIG.items()))
        held = self._plans.get(bm)
        if held is None or held[0] != cfg:
            held = self._plans[bm] = (cfg, plan_for(self.parts, self.perm, bm))
        return held[1]

    def run(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 0.0) -> torch.Tensor:
        """x [M, K] (rms_norm'd with norm_weight first when given) -> y [M, N total] in x's dtype, or added
        into `residual` [M, N total] (contiguous) in place and returned."""
        if self.tc is not None and tc_takes(x.shape[0], self.parts[0].k, self.n):
            return self.tc.run(x, residual, norm_weight, eps)
        if x.shape[0] > MAX_ROWS:  # prompt rows the tensor-core kernel cannot take here (its plans failed)
            return _dequant_rows(x, self.parts, self.bias, residual, norm_weight, eps)
        plan = self.plan(block_m(x.shape[0]))
        xb = gather_rows(x, plan, norm_weight, eps)
        out = residual if residual is not None else torch.empty(x.shape[0], plan.n, dtype=x.dtype,
                                                                device=x.device)
        return run_plan(plan, xb, self.parts, self.bias, residual, out)


def _dequant_rows(x: torch.Tensor, parts: list[QuantMatrix], bias: torch.Tensor | None,
                  residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The prefill path (dequantize + cuBLAS) with this module's contract: rows past 64 that the tensor-core kernel
    was chosen for but cannot plan (a mixed layout wider than its workspace)."""
    from exlpy.kernels import exl2_matmul, ops

    h = ops.rms_norm(x, norm_weight, eps) if norm_weight is not None else x
    h2 = h.to(torch.float16).contiguous()
    if residual is not None and bias is None and residual.dtype == torch.float16 and residual.is_contiguous():
        return exl2_matmul.dequant_matmul(h2, parts, residual)
    y = exl2_matmul.dequant_matmul(h2, parts)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype) if residual is None else residual.add_(y.to(residual.dtype))


def _tc_group(parts: list[QuantMatrix], bias: torch.Tensor | None) -> object | None:
    """exl2_tc.TcGroup of the parts, or None where that kernel cannot take them."""
    from exlpy.kernels.exl2_tc import TcGroup

    try:
        return TcGroup(parts, bias)
    except ValueError:
        return None
