"""Tensor-core dequant GEMM on packed EXL2/GPTQ weights for 1-256 activation rows: y[M, N] = x[M, K] @ W.

The decode batches and verification steps this serves are memory-bound: every packed word must be read once,
near the copy rate, and its codes turned into the dot's operand in a few instructions. exl2_qmm.py (its
predecessor, kept behind EXLPY_QMM_KERNEL) lost most of its time to fixed costs: short split-K programs whose
every step waited for its own loads, and a block -> group -> scale chain of dependent loads per step. Here:

- A program owns a column block over a run of whole groups of one width (exl2_tc_plan.py), walked in K steps of
  KB 32-row blocks that never cross a group boundary. The group of a step is one division (all groups of a task
  have `gsz` rows); its scales are loaded once per step, beside the words, with no table in between.
- PREFETCH: the next step's packed words are loaded into registers before this step's codes are decoded (a
  software pipeline without shared memory), so the memory system always has a step in flight per program.
- A code becomes the exact integer q - z as fp32 in two instructions, as in the decode GEMV (exl2_gemv.py):
  the masked field OR-ed into the mantissa of 2^23, then one FMA by compile-time constants. It is exact in
  fp16, so the dot multiplies exact codes by fp16 x with fp32 accumulation, and the group's scale (and GPTQ's
  zero, as z * sum(x)) is applied once per step to the step's partial product.
- SWAP: the dot computes y^T = W^T x^T, the dequantized [BLOCK_N, 32 KB] tile as the first operand (Hopper's
  wgmma takes it from registers, 64 rows per warp group) and x^T, 16-64 wide, as the second; M needs no padding
  beyond the 16-row minimum of a dot.
- x is gathered once per call into act order as fp16 (RMSNorm fused for q|k|v and gate|up); rows past a task's
  end read as zero, so partial blocks and partial groups need no special path.
- Split-K partial sums meet in a per-device fp32 workspace (exl2_qmm's, shared) by atomics; the last program to
  arrive at a column block (a self-resetting counter) takes the sums with atomic exchanges (never a load and a
  store: Triton lays those out over different threads), adds bias and residual and writes y: no memset, no host
  sync, CUDA-graph safe. As with the other packed kernels, two of them must not run concurrently on one device's
  streams.
- 65-256 rows (prompt chunks; EXLPY_TC_MAX_ROWS, off by default): the same programs over row tiles of TILE_M rows
  on the grid's second axis (exl2_tc_plan.CONFIG[128 / 256]), with a workspace of their own. The packed weights
  are read from memory once and decoded in registers per tile and K step: no dequantized copy of the weights is
  ever written, where dequantize + cuBLAS writes and reads back 2 bytes per weight for every chunk.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exlpy.kernels import pdl
from exlpy.kernels.exl2_gemv_plan import cuda_device as _device
from exlpy.kernels.exl2_qmm import _gather, _workspace
from exlpy.kernels.exl2_qmm import prepare as _qmm_prepare
from exlpy.kernels.exl2_tc_codes import _scale, _tile, _words
from exlpy.kernels.exl2_tc_plan import (
    FIELDS,
    MAX_ROWS,
    NARROW_ROWS,
    WIDE_WS_BLOCKS,
    WIDE_WS_ELEMS,
    TcPlan,
    block_m,
    plan_for,
    wide_classes,
)
from exlpy.quant.layout import QuantMatrix

__all__ = ["TcGroup", "gather_x", "prepare", "run_plan", "tc_matmul"]

_CB = tl.constexpr(FIELDS.index("cb"))
_N = tl.constexpr(FIELDS.index("n"))
_LD_N = tl.constexpr(FIELDS.index("ld_n"))
_S_QW = tl.constexpr(FIELDS.index("s_qw"))
_O_QW = tl.constexpr(FIELDS.index("o_qw"))
_W_END = tl.constexpr(FIELDS.index("w_end"))
_O_SC = tl.constexpr(FIELDS.index("o_sc"))
_S_SC = tl.constexpr(FIELDS.index("s_sc"))
_O_AUX = tl.constexpr(FIELDS.index("o_aux"))
_S_AUX = tl.constexpr(FIELDS.index("s_aux"))
_G0 = tl.constexpr(FIELDS.index("g0"))
_GSZ = tl.constexpr(FIELDS.index("gsz"))
_R0 = tl.constexpr(FIELDS.index("r0"))
_R1 = tl.constexpr(FIELDS.index("r1"))
_XR0 = tl.constexpr(FIELDS.index("xr0"))
_O_Y = tl.constexpr(FIELDS.index("o_y"))
_CNT = tl.constexpr(FIELDS.index("cnt"))
_ARRIVALS = tl.constexpr(FIELDS.index("arrivals"))
_BITS = tl.constexpr(FIELDS.index("bits"))
_LEFT0 = tl.constexpr(FIELDS.index("left0"))


@triton.jit
def _run(acc, x_ptr, xs, M, qw, s_qw, w_end, sc, s_sc, aux, s_aux, g0, gsz, left0, r0, r1, xr0, offs_n, ld_mask,
         magic,
         BITS: tl.constexpr, KB: tl.constexpr, GPTQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         SWAP: tl.constexpr, PREFETCH: tl.constexpr, FOLD: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr):
    """acc += x[:, xr0 + r0 : xr0 + r1] @ W[those rows, this program's columns] for one BITS-wide run. FOLD: the
    scales are applied to every weight before the dot, which then accumulates into acc (one accumulator, one
    FMUL per weight); else the dot takes exact codes and each step's product is scaled once (two accumulators,
    BLOCK_M / (32 KB) FMAs per weight)."""
    Z: tl.constexpr = 0 if GPTQ else (1 << (BITS - 1))
    STEP: tl.constexpr = KB * 32
    offs_b = tl.arange(0, KB)
    offs_k = tl.arange(0, STEP)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = (offs_m < M).to(tl.int32)
    if PREFETCH:
        ws = _words(qw, s_qw, w_end, r0, r1, offs_b, offs_n, ld_mask, BITS)
    g = g0  # the step's group, counted along (a division per step costs ~20 instructions)
    left = left0  # rows of group g from this step on
    for rb in range(r0, r1, STEP):
        if PREFETCH:
            cur = ws
            ws = _words(qw, s_qw, w_end, rb + STEP, r1, offs_b, offs_n, ld_mask, BITS)
        else:
            cur = _words(qw, s_qw, w_end, rb, r1, offs_b, offs_n, ld_mask, BITS)
        s, z = _scale(sc, s_sc, aux, s_aux, g, offs_n, ld_mask, GPTQ)
        left -= STEP
        g += (left <= 0).to(tl.int32)
        left = tl.where(left <= 0, gsz, left)
        w = _tile(cur, magic, s, z, BITS, Z, KB, BLOCK_N, SWAP, FOLD, GPTQ, HALF, ASM)
        # rows at or past r1 read as zero, by whole blocks (the mask is then constant over 32 rows, which keeps the
        # loads 16 bytes wide; x is zero-padded to whole blocks)
        k_ok = ((rb + offs_k) // 32 * 32 < r1).to(tl.int32)
        # x [BLOCK_M, STEP], loaded along K (16-byte loads), transposed in the dot's shared-memory operand
        xm = (m_ok[:, None] & k_ok[None, :]) != 0
        xv = tl.load(x_ptr + offs_m[:, None] * xs + (xr0 + rb + offs_k)[None, :], mask=xm, other=0.0)
        if FOLD:
            if SWAP:
                acc = tl.dot(w, tl.trans(xv), acc)
            else:
                acc = tl.dot(xv, w, acc)
        elif SWAP:
            part = tl.dot(w, tl.trans(xv))
            if GPTQ:
                part -= tl.sum(xv.to(tl.float32), axis=1)[None, :] * z[:, None]
            acc += part * s[:, None]
        else:
            part = tl.dot(xv, w)
            if GPTQ:
                part -= tl.sum(xv.to(tl.float32), axis=1)[:, None] * z[None, :]
            acc += part * s[None, :]
    return acc


@triton.jit
def _task(ti, x_ptr, qw_ptr, sc_ptr, aux_ptr, bias_ptr, res_ptr, y_ptr, ws_ptr, cnt_ptr, task_ptr, M, n_total, xs, ys,
          rs, magic, WIDTHS: tl.constexpr, KBS: tl.constexpr, GPTQ: tl.constexpr, HAS_BIAS: tl.constexpr,
          HAS_RES: tl.constexpr, SPLIT: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, NF: tl.constexpr, SWAP: tl.constexpr, PREFETCH: tl.constexpr, FOLD: tl.constexpr,
          HALF: tl.constexpr, ASM: tl.constexpr):
    """Task row ti: its column block over its run of groups, then the epilogue. SPLIT 0: each column block has
    one task, which writes y; SPLIT 1: tasks add into the workspace [M, n_total] and the last to arrive at a
    column block writes y and resets its part of the workspace and its counter. aux: EXL2 scale_max [G] / GPTQ
    zeros [G, Np]. WIDTHS: bit b set for each width among the task rows (each names its own), KBS their K steps,
    5 bits at 5 (b - 2)."""
    t = task_ptr + ti * NF
    cb = tl.load(t + _CB).to(tl.int32)
    n = tl.load(t + _N).to(tl.int32)
    ld_n = tl.load(t + _LD_N).to(tl.int32)
    s_qw = tl.load(t + _S_QW)
    o_qw = tl.load(t + _O_QW)
    if ALIGNED:  # keeps 16-byte word loads with run-time offsets and strides
        ld_n = tl.multiple_of(ld_n, 32)
        s_qw = tl.multiple_of(s_qw, 4)
        o_qw = tl.multiple_of(o_qw, 4)
    w_end = tl.load(t + _W_END).to(tl.int32)
    sc = sc_ptr + tl.load(t + _O_SC)
    s_sc = tl.load(t + _S_SC)
    aux = aux_ptr + tl.load(t + _O_AUX)
    s_aux = tl.load(t + _S_AUX)
    g0 = tl.load(t + _G0).to(tl.int32)
    gsz = tl.load(t + _GSZ).to(tl.int32)
    left0 = tl.load(t + _LEFT0).to(tl.int32)
    r0 = tl.multiple_of(tl.load(t + _R0).to(tl.int32), 32)  # groups (but a matrix's last) are whole blocks
    r1 = tl.load(t + _R1).to(tl.int32)
    xr0 = tl.multiple_of(tl.load(t + _XR0).to(tl.int32), 32)
    bits = tl.load(t + _BITS).to(tl.int32)
    offs_n = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    ld_mask = offs_n < ld_n  # q_weight holds a multiple of 32 columns: keeps 16-byte loads possible
    qw = qw_ptr + o_qw
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for b in tl.static_range(2, 9):  # one branch per width the launch holds, chosen by the task row at run time
        if (WIDTHS >> b) & 1:
            if bits == b:
                acc = _run(acc, x_ptr, xs, M, qw, s_qw, w_end, sc, s_sc, aux, s_aux, g0, gsz, left0, r0, r1, xr0,
                           offs_n, ld_mask, magic, b, (KBS >> (5 * (b - 2))) & 31, GPTQ, BLOCK_M, BLOCK_N, SWAP,
                           PREFETCH, FOLD, HALF, ASM)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.load(t + _O_Y) + offs_n  # columns in the plan's y
    if SWAP:  # element (i, j) of acc is row j, column cols[i]
        row2 = offs_m[None, :]
        col2 = cols[:, None]
        out_mask = ((offs_n < n).to(tl.int32)[:, None] & (offs_m < M).to(tl.int32)[None, :]) != 0
    else:
        row2 = offs_m[:, None]
        col2 = cols[None, :]
        out_mask = ((offs_m < M).to(tl.int32)[:, None] & (offs_n < n).to(tl.int32)[None, :]) != 0
    if SPLIT:
        tl.atomic_add(ws_ptr + row2 * n_total + col2, acc, mask=out_mask, sem="relaxed")
        tl.debug_barrier()  # every thread's partial is in before the arrival is counted
        cnt = cnt_ptr + tl.load(t + _CNT)
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
        if arrived == tl.load(t + _ARRIVALS).to(tl.int32) - 1:
            # take the sums and zero them in one atomic exchange per element (as int32 words: the CPU
            # interpreter exchanges no floats)
            wsi = ws_ptr.to(tl.pointer_type(tl.int32)) + row2 * n_total + col2
            acc = tl.atomic_xchg(wsi, tl.zeros_like(acc).to(tl.int32), mask=out_mask, sem="relaxed").to(
                tl.float32, bitcast=True)
            _store(acc, row2, col2, cols, out_mask, offs_n < n, bias_ptr, res_ptr, y_ptr, ys, rs, HAS_BIAS, HAS_RES,
                   SWAP)
            tl.atomic_xchg(cnt, 0)
    else:
        _store(acc, row2, col2, cols, out_mask, offs_n < n, bias_ptr, res_ptr, y_ptr, ys, rs, HAS_BIAS, HAS_RES, SWAP)


@triton.jit(do_not_specialize=["M", "n_cnt"])  # one compiled variant per BLOCK_M, whatever the row count
def _tc(x_ptr, qw_ptr, sc_ptr, aux_ptr, bias_ptr, res_ptr, y_ptr, ws_ptr, cnt_ptr, task_ptr, range_ptr, M, n_total, xs,
        ys, rs, magic, n_cnt, WIDTHS: tl.constexpr, KBS: tl.constexpr, GPTQ: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr, SPLIT: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, NF: tl.constexpr, SWAP: tl.constexpr, PREFETCH: tl.constexpr, FOLD: tl.constexpr,
        HALF: tl.constexpr, PERSIST: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, TILED: tl.constexpr):
    """One program per task row, or (PERSIST, stream-K) a grid of a few programs per SM, program p running task
    rows range[p] .. range[p + 1] (an equal share of all K steps, exl2_tc_plan._stream). TILED (65-256 rows): the
    grid's second axis is the row tile of BLOCK_M rows; each tile's rows of x, y, the residual and the split-K
    workspace start BLOCK_M rows further, and its arrival counters n_cnt further (the tiles of a task are
    neighbours in the launch order, so the packed words the first tile reads are in L2 for the others)."""
    if PDL:  # launched early (exlpy/kernels/pdl.py): x, y and the workspace come from earlier kernels
        tl.extra.cuda.gdc_wait()
    if TILED:
        rt = tl.program_id(1)
        row0 = rt * BLOCK_M
        x_ptr += row0 * xs
        y_ptr += row0 * ys
        res_ptr += row0 * rs
        ws_ptr += row0 * n_total
        cnt_ptr += rt * n_cnt
        M -= row0
    if PERSIST:
        for ti in range(tl.load(range_ptr + tl.program_id(0)), tl.load(range_ptr + tl.program_id(0) + 1)):
            _task(ti, x_ptr, qw_ptr, sc_ptr, aux_ptr, bias_ptr, res_ptr, y_ptr, ws_ptr, cnt_ptr, task_ptr, M, n_total,
                  xs, ys, rs, magic, WIDTHS, KBS, GPTQ, HAS_BIAS, HAS_RES, SPLIT, ALIGNED, BLOCK_M, BLOCK_N, NF, SWAP,
                  PREFETCH, FOLD, HALF, ASM)
    else:
        _task(tl.program_id(0), x_ptr, qw_ptr, sc_ptr, aux_ptr, bias_ptr, res_ptr, y_ptr, ws_ptr, cnt_ptr, task_ptr,
              M, n_total, xs, ys, rs, magic, WIDTHS, KBS, GPTQ, HAS_BIAS, HAS_RES, SPLIT, ALIGNED, BLOCK_M, BLOCK_N,
              NF, SWAP, PREFETCH, FOLD, HALF, ASM)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _store(acc, row2, col2, cols, out_mask, n_mask, bias_ptr, res_ptr, y_ptr, ys, rs, HAS_BIAS: tl.constexpr,
           HAS_RES: tl.constexpr, SWAP: tl.constexpr):
    """y = acc + bias + residual in y's dtype (y may be the residual itself)."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)
        if SWAP:
            acc += bias[:, None]
        else:
            acc += bias[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + row2 * rs + col2, mask=out_mask, other=0.0).to(tl.float32)
        tl.debug_barrier()  # y may be the residual itself: every read of it before any write
    tl.store(y_ptr + row2 * ys + col2, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


_GATHER_BLOCK = 1024


def gather_x(x: torch.Tensor, plan: TcPlan, norm_weight: torch.Tensor | None = None, eps: float = 0.0
             ) -> torch.Tensor:
    """x [M, K] -> fp16 [M, K rounded up to 32] in the plan's act order (rms_norm'd first with norm_weight), zero
    past K."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    p = plan.src.numel()
    out = torch.empty(m, p, dtype=torch.float16, device=x.device)
    _gather[(triton.cdiv(p, _GATHER_BLOCK), m)](x, norm_weight if norm_weight is not None else x, plan.src, out, k,
                                                p, x.stride(0), out.stride(0), eps, NORM=norm_weight is not None,
                                                BLOCK=_GATHER_BLOCK, num_warps=4, PDL=pdl.enabled(x.device),
                                                **pdl.launch_options(x.device))
    return out


def prepare(device: torch.device, wide: bool = False) -> None:
    """Allocate the device's workspace (exl2_qmm's, shared; with `wide` the 65-256-row one too) now, outside any
    CUDA-graph capture."""
    _qmm_prepare(device)
    if wide and device.type == "cuda":
        _wide_workspace(_device(device))


@functools.cache
def _wide_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device zeroed fp32 sums [256 rows x 32,768 columns] and arrival counters of the 65-256-row classes
    (row tiles of several column blocks); fixed size, kept zero by the kernel. Made only where EXLPY_TC_MAX_ROWS
    lets those classes run (32 MiB)."""
    return (torch.zeros(WIDE_WS_ELEMS, dtype=torch.float32, device=device),
            torch.zeros(WIDE_WS_BLOCKS, dtype=torch.int32, device=device))


_MAGIC = 0x4B000000  # fp32 2^23


def run_plan(plan: TcPlan, xg: torch.Tensor, parts: list[QuantMatrix], bias: torch.Tensor | None,
             residual: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Launch `plan` over `parts` (the tensors its offsets are relative to) with act-order fp16 x `xg` [M, K];
    writes and returns `out` [M, N total] (may be `residual` itself: the residual is added in place)."""
    m = xg.shape[0]
    if not 1 <= m <= MAX_ROWS or block_m(m) != plan.bm:
        raise ValueError(f"a BLOCK_M {plan.bm} plan takes up to {plan.bm} rows (at most {MAX_ROWS}), got {m}")
    q0 = parts[0]
    dev = _device(xg.device)
    tiled = plan.bm > NARROW_ROWS
    # up to 64 rows exl2_qmm's workspace (both kernels leave it zeroed), past 64 rows one of their own
    ws, cnt = _wide_workspace(dev) if tiled else _workspace(dev)
    aux = q0.scale_max if q0.kind == "exl2" else q0.zeros
    assert aux is not None
    c = plan.config
    res = residual if residual is not None else out
    launch = {"num_warps": c["WARPS"], "num_stages": c["STAGES"]}
    if c["MAXNREG"] and dev.type == "cuda":
        launch["maxnreg"] = c["MAXNREG"]
    # row tiles on the grid's second axis (past 64 rows only: 1-64 rows launch as they always did)
    grid2 = (triton.cdiv(m, plan.tile),) if tiled else ()
    for ln in plan.launches:
        _tc[(ln.grid, *grid2)](
            xg, q0.q_weight, q0.scales, aux, bias if bias is not None else out, res, out, ws, cnt, ln.tasks,
            ln.ranges if ln.ranges is not None else ln.tasks, m, plan.n, xg.stride(0), out.stride(0), res.stride(0),
            _MAGIC, plan.counters, WIDTHS=ln.widths, KBS=ln.kbs, GPTQ=q0.kind == "gptq", HAS_BIAS=bias is not None,
            HAS_RES=residual is not None, SPLIT=plan.split, ALIGNED=plan.aligned, BLOCK_M=plan.tile,
            BLOCK_N=c["BLOCK_N"], NF=len(FIELDS), SWAP=bool(c["SWAP"]), PREFETCH=bool(c["PREFETCH"]),
            FOLD=bool(c["FOLD"]), HALF=bool(c["HALF"]), PERSIST=ln.ranges is not None, PDL=pdl.enabled(dev),
            ASM=dev.type == "cuda", TILED=tiled, **launch, **pdl.launch_options(dev))
    return out


def tc_matmul(x: torch.Tensor, parts: list[QuantMatrix], bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0
              ) -> torch.Tensor:
    """x [M <= 256, K] (rms_norm'd with norm_weight when given) @ [parts side by side] (+ bias) -> [M, N total] in
    x's dtype, or added into `residual` [M, N total] (contiguous) in place and returned. Same contract as
    exl2_qmm.qmm; the parts share K and act order and each passes exl2_tc_plan.supports."""
    plan = plan_for(parts, block_m(x.shape[0]))
    xg = gather_x(x, plan, norm_weight, eps)
    out = residual if residual is not None else torch.empty(x.shape[0], plan.n, dtype=x.dtype, device=x.device)
    return run_plan(plan, xg, parts, bias, residual, out)


class TcGroup:
    """Matrices that read the same x in the same act order, multiplied by 1-64 rows (and 65-256 where
    EXLPY_TC_MAX_ROWS says) in one launch into one output [M, sum N]. Plans (task tables on the device) are made
    here, at load time, never inside a CUDA-graph capture, and again only when the launch table changes (sweeps,
    which recapture graphs)."""

    def __init__(self, parts: list[QuantMatrix], bias: torch.Tensor | None) -> None:
        self.parts = parts
        self.bias = bias
        self.n = sum(p.n for p in parts)
        self._plans: dict[int, TcPlan] = {}
        wide = wide_classes()
        for bm in (16, 32, 64, *wide):
            self.plan(bm)
        prepare(parts[0].device, bool(wide))

    def plan(self, bm: int) -> TcPlan:
        held = self._plans.get(bm)
        if held is None or held.cfg != _cfg_key(self.parts, self.n, bm):
            held = self._plans[bm] = plan_for(self.parts, bm)
        return held

    def run(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 0.0) -> torch.Tensor:
        """x [M, K] (rms_norm'd with norm_weight first when given) -> y [M, N total] in x's dtype, or added into
        `residual` [M, N total] (contiguous) in place and returned."""
        plan = self.plan(block_m(x.shape[0]))
        xg = gather_x(x, plan, norm_weight, eps)
        out = residual if residual is not None else torch.empty(x.shape[0], self.n, dtype=x.dtype, device=x.device)
        return run_plan(plan, xg, self.parts, self.bias, residual, out)


def _cfg_key(parts: list[QuantMatrix], n: int, bm: int) -> tuple[tuple[str, int], ...]:
    from exlpy.kernels.exl2_tc_plan import launch_config

    return tuple(sorted(launch_config(parts[0].k, n, bm).items()))
