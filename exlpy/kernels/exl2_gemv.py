"""Single-row (decode) matmul on packed EXL2/GPTQ weights: y[1, N] = x[1, K] @ W, memory-bound by design.

At one activation row every packed word is used once, so the kernel must unpack a code in a handful of
instructions or it becomes instruction-bound (an H100 delivers ~6e12 4-bit codes/s but issues only ~3e13
lane-ops/s). How the kernel keeps to ~3-4 operations per code:

- Each packed word is loaded once (16-byte loads, coalesced across N: a warp reads consecutive columns of one
  q_weight row) and all its codes are taken out with compile-time shifts and masks.
- int -> float without I2F (a quarter-rate conversion): OR the masked field (at bit offset o <= 22 - bits) into
  the mantissa of 2^23, reinterpret as fp32 = 2^23 + q*2^o, then one FMA by the exact constants 2^-o and
  -(2^(23-o) + zero) yields q - zero exactly. Fields above bit 22 come from one shared `word >> 16`.
- Per group and column only `part += x[r] * (q - z)` runs per code; the scale multiply happens once per group
  (EXL2 zero points are constants; GPTQ's per-column zeros are folded out as z * sum(x) per group).
- x arrives in act order as fp32, zero-padded past K (exlpy/kernels/act_order.py makes it, usually fused into
  the producer: the RMSNorm before q|k|v and gate|up, SwiGLU before down), so the loop reads it with scalar
  loads at compile-time offsets and needs no row masks.
- Split-K over whole groups fills the SMs; partial sums go to a per-device fp32 workspace by atomics, and the
  last program to arrive at a column block (a self-resetting counter) adds bias and residual, writes fp16 y and
  zeroes the workspace again: no memset, no host sync, CUDA-graph safe.

One launch covers several matrices that read the same x (q|k|v, gate|up) and all their segments of one bit width:
each program reads its task (matrix, column block, groups) from a small int64 table made once by
exl2_gemv_plan.py, with the matrices' tensors addressed as element offsets from the first one's.

The workspace is shared by all matmuls on a device: two of them must not run concurrently on different streams
of one device (decode runs one stream per device).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exlpy.kernels import pdl
from exlpy.kernels.act_order import act_order
from exlpy.kernels.exl2_gemv_plan import (
    CONFIG,
    FIELDS,
    ROW_PAD,
    WS_BLOCKS,
    WS_COLS,
    GemvPlan,
    cuda_device,
    plan_for,
    supports,
)
from exlpy.quant.layout import QuantMatrix

__all__ = ["CONFIG", "MAX_ROWS", "ROW_PAD", "GemvGroup", "exl2_gemv", "gemv_takes", "prepare", "supports"]

# Up to MAX_ROWS activation rows run through this kernel: each decoded code feeds one FMA per row, so a few rows
# cost little more than one (the code's unpacking and the weight read are shared); past that the FMAs dominate
# and the tensor-core kernel (exl2_qmm.py) wins. Register caps per row count (more rows hold more accumulators).
# Per row count (register cap, packed words in flight per thread and step): more rows hold more accumulators.
# Measured on an H100 (benchmarks/exl2_speed.py --parts micro --gemv-variants, 2026-11-26): 3-4 rows are fastest
# with few words in flight and 4 programs per SM (128 registers, 8 words: 31.6 us for 4096x14336 against 37-40 us
# with 16 words); 8 rows with 16 words in flight and no cap that spills (sm_90a compile:
# benchmarks/gemv_compile_check.py). Up to 4 rows this kernel beats the tensor-core one (exl2_qmm.py) 1.3-2.1x; at
# 8 rows the two are even (EXLPY_GEMV_ROWS, default 4).
MAX_ROWS = 8
ROWS_CONFIG: dict[int, tuple[int, int]] = {2: (128, 16), 3: (128, 8), 4: (128, 8), 5: (232, 16), 6: (232, 16),
                                           7: (255, 16), 8: (255, 16)}


def _rows_nb(nb: int, bits: int, rows: int) -> int:
    """A launch's blocks per step for `rows` rows: the plan's (made for one row) cut to the row count's words in
    flight, and still a divisor of it (so a step never crosses a group boundary the plan's step would not)."""
    if rows == 1:
        return nb
    want = max(1, ROWS_CONFIG[rows][1] // bits)
    while nb > want:
        nb = max(d for d in range(1, nb) if nb % d == 0)  # a divisor of a divisor divides the plan's nb
    return nb

# task-table columns (exl2_gemv_plan.FIELDS), as compile-time constants for the kernel
_CB = tl.constexpr(FIELDS.index("cb"))
_N = tl.constexpr(FIELDS.index("n"))
_LD_N = tl.constexpr(FIELDS.index("ld_n"))
_S_QW = tl.constexpr(FIELDS.index("s_qw"))
_O_QW = tl.constexpr(FIELDS.index("o_qw"))
_O_SC = tl.constexpr(FIELDS.index("o_sc"))
_S_SC = tl.constexpr(FIELDS.index("s_sc"))
_O_AUX = tl.constexpr(FIELDS.index("o_aux"))
_S_AUX = tl.constexpr(FIELDS.index("s_aux"))
_O_GR = tl.constexpr(FIELDS.index("o_gr"))
_GA = tl.constexpr(FIELDS.index("ga"))
_GB = tl.constexpr(FIELDS.index("gb"))
_ROW0 = tl.constexpr(FIELDS.index("row0"))
_O_Y = tl.constexpr(FIELDS.index("o_y"))
_CNT = tl.constexpr(FIELDS.index("cnt"))
_ARRIVALS = tl.constexpr(FIELDS.index("arrivals"))
_BITS = tl.constexpr(FIELDS.index("bits"))


@triton.jit
def _deq(t, magic, oo: tl.constexpr, BITS: tl.constexpr, Z: tl.constexpr):
    """q - Z for the BITS-wide field of uint32 t at bit oo (oo + BITS <= 23). `magic` = 0x4B000000 comes in as a
    run-time value: it then lives in one register and the AND-OR is one LOP3 with the mask as its immediate
    (with both constants immediate, ptxas re-materializes the mask for every code)."""
    f = ((t & (((1 << BITS) - 1) << oo)) | magic).to(tl.float32, bitcast=True)
    return f * (1.0 / (1 << oo)) - ((1 << (23 - oo)) + Z)


@triton.jit
def _rows_fma(p0, p1, p2, p3, p4, p5, p6, p7, s0, s1, s2, s3, s4, s5, s6, s7, xb, xs, d,
              MR: tl.constexpr, GPTQ: tl.constexpr):
    """p_m += x[m, r] * d for the MR activation rows (row m at xb + m * xs); s_m += x[m, r] for GPTQ's zeros.
    Eight named accumulators rather than a [MR, BLOCK_N] tile: every value keeps the 1-D layout of the packed
    words, so the code decoded once feeds MR FMAs with no layout conversion (a 2-D tile broadcast from the
    words' layout can go through shared memory per code)."""
    x = tl.load(xb)
    p0 += x * d
    if GPTQ:
        s0 += x
    if MR > 1:
        x = tl.load(xb + xs)
        p1 += x * d
        if GPTQ:
            s1 += x
    if MR > 2:
        x = tl.load(xb + 2 * xs)
        p2 += x * d
        if GPTQ:
            s2 += x
    if MR > 3:
        x = tl.load(xb + 3 * xs)
        p3 += x * d
        if GPTQ:
            s3 += x
    if MR > 4:
        x = tl.load(xb + 4 * xs)
        p4 += x * d
        if GPTQ:
            s4 += x
    if MR > 5:
        x = tl.load(xb + 5 * xs)
        p5 += x * d
        if GPTQ:
            s5 += x
    if MR > 6:
        x = tl.load(xb + 6 * xs)
        p6 += x * d
        if GPTQ:
            s6 += x
    if MR > 7:
        x = tl.load(xb + 7 * xs)
        p7 += x * d
        if GPTQ:
            s7 += x
    return p0, p1, p2, p3, p4, p5, p6, p7, s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _scaled(acc, part, xsum, s, z, GPTQ: tl.constexpr):
    """acc + one group's partial sum times its per-column scale (GPTQ: zeros folded out as z * sum(x))."""
    if GPTQ:
        return acc + (part - xsum * z) * s
    return acc + part * s


@triton.jit
def _finish(acc, row, cols, out_mask, y_ptr, res_ptr, bias_ptr, ws_ptr, ys, wss, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, FROM_WS: tl.constexpr):
    """Row `row` of y: acc (or, FROM_WS, the workspace's sums) + bias + residual, stored in y's dtype."""
    if FROM_WS:
        # Take the sums and zero them in one atomic exchange per element (in L2, where the atomics put
        # them). Never a load then a store of zeros: compiled, the two may be laid out over different
        # threads (Triton 3.6 gives atomics their own layout), and with no barrier between them a thread
        # zeroes a sum before another has read it (the lost sums of the first GPU run).
        # (as int32 words: the CPU interpreter exchanges no floats)
        wsi = ws_ptr.to(tl.pointer_type(tl.int32)) + row * wss + cols
        zero = tl.zeros_like(cols).to(tl.int32)
        acc = tl.atomic_xchg(wsi, zero, mask=out_mask, sem="relaxed").to(tl.float32, bitcast=True)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=out_mask, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(res_ptr + row * ys + cols, mask=out_mask, other=0.0).to(tl.float32)
        tl.debug_barrier()  # y may be the residual itself: every read of it before any write
    tl.store(y_ptr + row * ys + cols, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _groups(x_ptr, qw, sc_ptr, aux_ptr, gr, o_sc, s_sc, o_aux, s_aux, s_qw, ga, gb, row0, offs_n, ld_mask, magic, xs,
            BITS: tl.constexpr, GPTQ: tl.constexpr, NB: tl.constexpr, MR: tl.constexpr, BLOCK_N: tl.constexpr):
    """The MR rows' sums over groups [ga, gb) of one BITS-wide segment, each group's partial times its scale."""
    Z: tl.constexpr = 0 if GPTQ else (1 << (BITS - 1))
    a0 = tl.zeros((BLOCK_N,), tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    for g in range(ga, gb):
        r_lo = tl.load(gr + g)
        r_hi = tl.load(gr + g + 1)
        p0 = tl.zeros((BLOCK_N,), tl.float32)
        p1, p2, p3, p4, p5, p6, p7 = p0, p0, p0, p0, p0, p0, p0
        s0 = 0.0
        s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
        for rb in range(r_lo, r_hi, 32 * NB):
            # All packed words of this step are loaded before any is used: NB * BITS loads in flight per thread.
            ws = ()
            for blk in tl.static_range(NB):
                r0 = rb + blk * 32
                nbits = (r_hi - r0) * BITS  # valid stream bits left in this block (<= 0: block is past the group)
                wp = qw + ((r0 - row0) // 32 * BITS) * s_qw + offs_n
                for wi in tl.static_range(BITS):
                    # (int & int) != 0, not bool & bool: the CPU interpreter mis-types a scalar-broadcast bool &
                    wmask = (ld_mask.to(tl.int32) & (nbits > wi * 32).to(tl.int32)) != 0
                    ws = ws + (tl.load(wp + wi * s_qw, mask=wmask, other=0).to(tl.uint32, bitcast=True),)
            for blk in tl.static_range(NB):
                # A block of 32 rows is BITS whole words: every code's word and offset are compile-time.
                xb = x_ptr + rb + blk * 32  # each code's x address is this base + a compile-time offset
                prev = ws[blk * BITS]
                for wi in tl.static_range(BITS):
                    cur = ws[blk * BITS + wi]
                    cur_hi = cur >> 16
                    for i in tl.static_range(32):
                        if (i * BITS + BITS - 1) // 32 == wi:  # code i ends in this word
                            if (i * BITS) // 32 != wi:  # straddles from the previous word
                                d = _deq((prev >> ((i * BITS) % 32)) | (cur << (32 - (i * BITS) % 32)), magic, 0,
                                         BITS, Z)
                            elif (i * BITS) % 32 + BITS <= 23:
                                d = _deq(cur, magic, (i * BITS) % 32, BITS, Z)
                            else:
                                d = _deq(cur_hi, magic, (i * BITS) % 32 - 16, BITS, Z)
                            p0, p1, p2, p3, p4, p5, p6, p7, s0, s1, s2, s3, s4, s5, s6, s7 = _rows_fma(
                                p0, p1, p2, p3, p4, p5, p6, p7, s0, s1, s2, s3, s4, s5, s6, s7, xb + i, xs, d,
                                MR, GPTQ)
                    prev = cur
        if GPTQ:
            sc = tl.load(sc_ptr + o_sc + g * s_sc + offs_n, mask=ld_mask, other=0.0).to(tl.float32)
            z = tl.load(aux_ptr + o_aux + g * s_aux + offs_n, mask=ld_mask, other=0.0).to(tl.float32)
        else:
            w = tl.load(sc_ptr + o_sc + g * s_sc + offs_n // 8, mask=ld_mask, other=0)
            c1 = (((w >> ((offs_n % 8) * 4)) & 15) + 1).to(tl.float32)
            sc = c1 * c1 * tl.load(aux_ptr + o_aux + g)
            z = sc
        a0 = _scaled(a0, p0, s0, sc, z, GPTQ)
        if MR > 1:
            a1 = _scaled(a1, p1, s1, sc, z, GPTQ)
        if MR > 2:
            a2 = _scaled(a2, p2, s2, sc, z, GPTQ)
        if MR > 3:
            a3 = _scaled(a3, p3, s3, sc, z, GPTQ)
        if MR > 4:
            a4 = _scaled(a4, p4, s4, sc, z, GPTQ)
        if MR > 5:
            a5 = _scaled(a5, p5, s5, sc, z, GPTQ)
        if MR > 6:
            a6 = _scaled(a6, p6, s6, sc, z, GPTQ)
        if MR > 7:
            a7 = _scaled(a7, p7, s7, sc, z, GPTQ)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _gemv(x_ptr, qw_ptr, sc_ptr, aux_ptr, gr_ptr, bias_ptr, res_ptr, y_ptr, ws_ptr, cnt_ptr, task_ptr, magic,
          xs, ys, wss, BITS: tl.constexpr, GPTQ: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
          MODE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
          NF: tl.constexpr, MR: tl.constexpr, PDL: tl.constexpr, WIDTHS: tl.constexpr = 0, NBS: tl.constexpr = 0):
    """One program per task row, for MR (1-8) activation rows: x row m at x_ptr + m * xs, y / residual row m at
    + m * ys, workspace row m at + m * wss. MODE 0: every column block has one program, which writes y; MODE 1:
    add into the workspace, and the last program to arrive at a column block writes y and resets workspace and
    counter. aux: EXL2 scale_max [G] / GPTQ zeros [G, Np]. WIDTHS > 0: the bit widths of this launch's task rows
    (a mask; each row names its own), with NBS their blocks per step, 5 bits each at 5 * width index."""
    t = task_ptr + tl.program_id(0) * NF
    cb = tl.load(t + _CB).to(tl.int32)
    n = tl.load(t + _N).to(tl.int32)
    ld_n = tl.load(t + _LD_N).to(tl.int32)
    s_qw = tl.load(t + _S_QW)
    o_qw = tl.load(t + _O_QW)
    if ALIGNED:  # lets the compiler keep 16-byte loads with run-time offsets and strides
        ld_n = tl.multiple_of(ld_n, 32)
        s_qw = tl.multiple_of(s_qw, 4)
        o_qw = tl.multiple_of(o_qw, 4)
    o_sc = tl.load(t + _O_SC)
    s_sc = tl.load(t + _S_SC)
    o_aux = tl.load(t + _O_AUX)
    s_aux = tl.load(t + _S_AUX)
    gr = gr_ptr + tl.load(t + _O_GR)
    ga = tl.load(t + _GA).to(tl.int32)
    gb = tl.load(t + _GB).to(tl.int32)
    row0 = tl.load(t + _ROW0).to(tl.int32)
    offs_n = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    ld_mask = offs_n < ld_n  # q_weight holds a multiple of 32 columns: keeps 16-byte loads possible
    qw = qw_ptr + o_qw
    if PDL:  # launched early (exlpy/kernels/pdl.py): the task row above is static, x and the workspace are not
        tl.extra.cuda.gdc_wait()
    if WIDTHS == 0:  # one bit width, the launch's
        a0, a1, a2, a3, a4, a5, a6, a7 = _groups(x_ptr, qw, sc_ptr, aux_ptr, gr, o_sc, s_sc, o_aux, s_aux, s_qw,
                                                 ga, gb, row0, offs_n, ld_mask, magic, xs, BITS, GPTQ, NB, MR,
                                                 BLOCK_N)
    else:
        # Several widths in one launch (a converter's mixed matrix): each task row names its width and runs that
        # width's code, compiled once per width present. One launch per width instead ends each in its own tail
        # (a mixed 4096x4096 took 23.6 us against 9.1 for uniform 4-bit, H100).
        bits = tl.load(t + _BITS).to(tl.int32)
        a0 = tl.zeros((BLOCK_N,), tl.float32)
        a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
        for b in tl.static_range(2, 9):  # widths 2, 3, 4, 5, 6, 8 (index b - 2, and 5 for 8 bits)
            if (WIDTHS >> b) & 1:
                if bits == b:
                    a0, a1, a2, a3, a4, a5, a6, a7 = _groups(
                        x_ptr, qw, sc_ptr, aux_ptr, gr, o_sc, s_sc, o_aux, s_aux, s_qw, ga, gb, row0, offs_n, ld_mask,
                        magic, xs, b, GPTQ, (NBS >> (5 * (b - 2 - b // 8))) & 31, MR, BLOCK_N)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out_mask = offs_n < n
    cols = tl.load(t + _O_Y) + offs_n  # column in the group's y
    if MODE == 1:
        tl.atomic_add(ws_ptr + cols, a0, mask=out_mask, sem="relaxed")
        if MR > 1:
            tl.atomic_add(ws_ptr + wss + cols, a1, mask=out_mask, sem="relaxed")
        if MR > 2:
            tl.atomic_add(ws_ptr + 2 * wss + cols, a2, mask=out_mask, sem="relaxed")
        if MR > 3:
            tl.atomic_add(ws_ptr + 3 * wss + cols, a3, mask=out_mask, sem="relaxed")
        if MR > 4:
            tl.atomic_add(ws_ptr + 4 * wss + cols, a4, mask=out_mask, sem="relaxed")
        if MR > 5:
            tl.atomic_add(ws_ptr + 5 * wss + cols, a5, mask=out_mask, sem="relaxed")
        if MR > 6:
            tl.atomic_add(ws_ptr + 6 * wss + cols, a6, mask=out_mask, sem="relaxed")
        if MR > 7:
            tl.atomic_add(ws_ptr + 7 * wss + cols, a7, mask=out_mask, sem="relaxed")
        tl.debug_barrier()  # every thread's partials are in before the arrival is counted
        cnt = cnt_ptr + tl.load(t + _CNT)
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
        if arrived == tl.load(t + _ARRIVALS).to(tl.int32) - 1:
            for r in tl.static_range(MR):
                _finish(a0, r, cols, out_mask, y_ptr, res_ptr, bias_ptr, ws_ptr, ys, wss, HAS_BIAS, HAS_RES, True)
            tl.atomic_xchg(cnt, 0)
    else:
        _finish(a0, 0, cols, out_mask, y_ptr, res_ptr, bias_ptr, ws_ptr, ys, wss, HAS_BIAS, HAS_RES, False)
        if MR > 1:
            _finish(a1, 1, cols, out_mask, y_ptr, res_ptr, bias_ptr, ws_ptr, ys, wss, HAS_BIAS, HAS_RES, False)
        if MR > 2:
            _finish(a2, 2, cols, out_mask, y_ptr, res_ptr, bias_ptr, ws_ptr, ys, wss, HAS_BIAS, HAS_RES, False)
        if MR > 3:
            _finish(a3, 3, cols, out_mask, y_ptr, res_ptr, bias_ptr, ws_ptr, ys, wss, HAS_BIAS, HAS_RES, False)
        if MR > 4:
            _finish(a4, 4, cols, out_mask, y_ptr, res_ptr, bias_ptr, ws_ptr, ys, wss, HAS_BIAS, HAS_RES, False)
        if MR > 5:
            _finish(a5, 5, cols, out_mask, y_ptr, res_ptr, bias_ptr, ws_ptr, ys, wss, HAS_BIAS, HAS_RES, False)
        if MR > 6:
            _finish(a6, 6, cols, out_mask, y_ptr, res_ptr, bias_ptr, ws_ptr, ys, wss, HAS_BIAS, HAS_RES, False)
        if MR > 7:
            _finish(a7, 7, cols, out_mask, y_ptr, res_ptr, bias_ptr, ws_ptr, ys, wss, HAS_BIAS, HAS_RES, False)


@functools.cache
def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device zeroed (fp32 partial sums, int32 arrival counters); fixed size, kept zero by the kernel."""
    return (torch.zeros(WS_COLS, dtype=torch.float32, device=device),
            torch.zeros(WS_BLOCKS, dtype=torch.int32, device=device))


def prepare(device: torch.device) -> None:
    """Allocate the device's workspace now (outside any CUDA-graph capture)."""
    if device.type == "cuda":
        _workspace(cuda_device(device))


_MAGIC = 0x4B000000  # fp32 2^23: OR-ing a field below bit 23 into its mantissa gives 2^23 + field


_WIDTH_INDEX = {2: 0, 3: 1, 4: 2, 5: 3, 6: 4, 8: 5}  # where a width's blocks per step sit in NBS (5 bits each)


def _rows_nbs(nbs: int, rows: int) -> int:
    """NBS of a mixed launch with each width's blocks per step cut for `rows` rows (see _rows_nb)."""
    out = 0
    for bits, i in _WIDTH_INDEX.items():
        nb = (nbs >> (5 * i)) & 31
        if nb:
            out |= _rows_nb(nb, bits, rows) << (5 * i)
    return out


def run_plan(plan: GemvPlan, xp: torch.Tensor, parts: list[QuantMatrix], bias: torch.Tensor | None,
             residual: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Launch `plan` over `parts` (the tensors its offsets are relative to) with act-order x `xp` ([KP] for one
    row, [m, KP] for m <= MAX_ROWS rows); writes and returns `out` [m, N total] (may be `residual` itself: the
    residual is added in place)."""
    q0 = parts[0]
    dev = cuda_device(xp.device)
    ws, cnt = _workspace(dev)
    aux = q0.scale_max if q0.kind == "exl2" else q0.zeros
    assert aux is not None
    rows = 1 if xp.dim() == 1 else xp.shape[0]
    n = out.shape[-1]
    if not 1 <= rows <= MAX_ROWS or rows * n > WS_COLS:
        raise ValueError(f"the decode GEMV takes 1-{MAX_ROWS} rows of at most {WS_COLS // rows} columns")
    launch = {"num_warps": plan.num_warps}
    maxnreg = CONFIG["MAXNREG"] if rows == 1 else ROWS_CONFIG[rows][0]
    if maxnreg and dev.type == "cuda":
        launch["maxnreg"] = maxnreg
    for ln in plan.launches:
        _gemv[(ln.programs,)](
            xp, q0.q_weight, q0.scales, aux, q0.group_rows, bias if bias is not None else out,
            residual if residual is not None else out, out, ws, cnt, ln.tasks, _MAGIC, xp.shape[-1], n, n,
            BITS=ln.bits, GPTQ=q0.kind == "gptq", HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            MODE=plan.mode, ALIGNED=plan.aligned, BLOCK_N=plan.block_n,
            NB=_rows_nb(ln.nb, ln.bits, rows) if ln.bits else 1, NF=len(FIELDS), MR=rows, WIDTHS=ln.widths,
            NBS=_rows_nbs(ln.nbs, rows) if ln.widths else 0,
            PDL=pdl.enabled(dev), **launch, **pdl.launch_options(dev))
    return out


def gemv_takes(m: int, n: int, k: int = 0) -> bool:
    """Whether m rows of a [k, n] product (n: all output columns of a group) run here: one row, 2 up to
    EXLPY_GEMV_ROWS rows while their workspace rows fit; not where the tensor-core kernel takes them
    (exl2_tc_plan.takes: EXLPY_QMM_KERNEL=tc, or its table; k = 0: not asked)."""
    from exlpy.kernels.exl2_tc_plan import takes
    from exlpy.runtime import options

    if k and takes(m, k, n):
        return False
    return m == 1 or (2 <= m <= min(options().gemv_rows, MAX_ROWS) and m * n <= WS_COLS)


def exl2_gemv(x: torch.Tensor, qm: QuantMatrix, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, K] (m <= MAX_ROWS, any float dtype) -> y [m, N] in x's dtype (+ bias, + residual in place when
    given: then the result is `residual`, which must be contiguous with m * N elements). The caller checks
    `supports(qm)`."""
    plan = plan_for([qm], cuda_device(x.device))
    m = x.numel() // qm.k
    xp = act_order(x, qm.perm, ROW_PAD)
    out = residual if residual is not None else torch.empty(m, qm.n, dtype=x.dtype, device=x.device)
    run_plan(plan, xp, [qm], bias, None if residual is None else out.view(m, qm.n), out.view(m, qm.n))
    return out


class GemvGroup:
    """Matrices that read the same x in the same act order (q|k|v, gate|up), computed by one launch per bit
    width into one output [.., sum N]. The matrices stay where they are; the plan holds their offsets."""

    def __init__(self, parts: list[QuantMatrix], bias: torch.Tensor | None) -> None:
        self.parts = parts
        self.bias = bias
        self.k = parts[0].k
        self.n = sum(p.n for p in parts)
        self.perm = parts[0].perm
        # made now, not inside a CUDA-graph capture (the task table is copied to the device)
        self._plan = (tuple(sorted(CONFIG.items())), plan_for(parts, cuda_device(parts[0].device)))
        prepare(parts[0].device)

    @property
    def plan(self) -> GemvPlan:
        """Made again after CONFIG changes (launch-parameter sweeps, which recapture graphs)."""
        cfg = tuple(sorted(CONFIG.items()))
        if self._plan[0] != cfg:
            self._plan = (cfg, plan_for(self.parts, cuda_device(self.parts[0].device)))
        return self._plan[1]

    def run(self, xp: torch.Tensor, dtype: torch.dtype, residual: torch.Tensor | None = None) -> torch.Tensor:
        """xp: act-order fp32 x [K + ROW_PAD] or [m, K + ROW_PAD] (exlpy/kernels/act_order.py) -> y [m, N total]
        in dtype, or added into `residual` [m, N total] in place and returned."""
        m = 1 if xp.dim() == 1 else xp.shape[0]
        out = residual if residual is not None else torch.empty(m, self.n, dtype=dtype, device=xp.device)
        return run_plan(self.plan, xp, self.parts, self.bias, residual, out)
