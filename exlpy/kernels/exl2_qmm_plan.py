"""Work split of the multi-row quantized matmul (exl2_qmm.py), and where it hands over to dequantize + cuBLAS.

A plan is made once per set of matrices that read the same x (one matrix, q|k|v, gate|up) and lives on the
device as an int64 task table, one row per program: (column block, one bit width's run of 32-row blocks). The
K ranges are cut so that the grid fills the device about WAVES times over, in proportion to the packed bytes
of each (matrix, segment), as the decode GEMV's plan does (exl2_gemv_plan.py). Two small int32 tables go with
it: the group of every 32-row block of every matrix (scales are applied per block, so a K range may start
and end anywhere on a block boundary), and the source column of every position of the blocked x layout the
kernel reads (act order and the layout change in one gather, see exl2_qmm.gather_rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from exlpy.kernels.exl2_gemv_plan import cuda_device, element_offset, num_sms, supports
from exlpy.quant.layout import QuantLayout, QuantMatrix
from exlpy.runtime import options

__all__ = ["CONFIG", "FIELDS", "MAX_ROWS", "SEG_FIELDS", "QmmPlan", "plan_for", "rows_kernel_takes", "supports"]

MAX_ROWS = 64  # rows (tokens) the multi-row kernel takes at most; BLOCK_M is 16, 32 or 64
WS_ELEMS = 1 << 21  # fp32 split-K workspace per device: rows_pad * output columns (8 MiB)
WS_BLOCKS = 1 << 14  # arrival counters per device

# Columns of a task row. o_*: element offsets of the matrix's tensors from the plan's first matrix; s_*: row
# strides; o_bg: the matrix's block -> group table in the plan's table; o_y: first output column of the matrix;
# cnt/arrivals: the column block's arrival counter and how many programs add into it (split-K); seg_lo/seg_hi:
# the program's rows of the segment table, run one after the other (one row: a split-K piece of one width; all of
# a matrix's segments: a column block computed whole, no workspace).
FIELDS = ("cb", "n", "ld_n", "s_qw", "o_sc", "s_sc", "o_aux", "s_aux", "o_bg", "o_y", "cnt", "arrivals", "seg_lo",
          "seg_hi")
# Columns of a segment-table row: the bit width, the 32-row blocks [blk_lo, blk_hi) of the matrix it covers, the
# segment's first block sb0 and o_qw, the element offset of the segment's first q_weight row.
SEG_FIELDS = ("bits", "blk_lo", "blk_hi", "sb0", "o_qw")

# Launch parameters (benchmarks/exl2_speed.py --parts sweep measures alternatives). Per BLOCK_M class (16, 32,
# 64 rows): BLOCK_N_<m> output columns per program, WARPS_<m> warps, STAGES_<m> software-pipelining depth of the
# packed-word loads (cp.async into shared memory) of a one-width launch. STAGES_MIXED: the depth of launches that
# hold several widths (pipelined, those take up to 255 registers per thread, unpipelined ~165 as one width). KB:
# 32-row blocks per K step (one tl.dot with K = 32 KB); WAVES: programs per SM the K split aims for (6: whole
# waves both at 2 and at 3 resident programs per SM, the two occupancies the variants have); ONE_LAUNCH:
# all bit widths of a plan in one launch (a run-time branch per task) instead of one launch per width.
# Defaults: chosen offline for Triton 3.6 on sm_90a (benchmarks/qmm_compile_check.py: 5.4-6.3 SASS
# instructions per 4-bit weight, no spills, 3 programs per SM at 16 and 64 rows, 2 at 32); to be confirmed by
# the H100 sweep (2026-11-26: one stage at 16 and 32 rows, 42.8 against 50.3 us at M = 8 and 48.5 against 64.3 at
# M = 32 on 4096x14336; benchmarks/results/exl2_speed.md).
CONFIG: dict[str, int] = {"KB": 4, "WAVES": 6, "ONE_LAUNCH": 1, "STAGES_MIXED": 1,
                          "BLOCK_N_16": 128, "WARPS_16": 4, "STAGES_16": 1,
                          "BLOCK_N_32": 128, "WARPS_32": 4, "STAGES_32": 1,
                          "BLOCK_N_64": 64, "WARPS_64": 4, "STAGES_64": 1}

# Where dequantize-to-fp16 + cuBLAS starts to win: the fewest rows that take it, per (K, N) of a product (N: all
# output columns of a fused group); shapes not listed switch above the runtime option `quant_rows`
# (EXLPY_QUANT_ROWS; default 64, see exlpy/runtime.py), or with EXLPY_TC_MAX_ROWS past 64 above that many rows
# (the tensor-core kernel takes 65-256, exl2_tc_plan.takes). A value above 65 lets the tensor-core kernel take
# the rows below it.
# benchmarks/exl2_speed.py times both paths per shape and row count (--parts micro up to 64 rows, --parts wide
# 65-256) and prints the crossover it measured, in this table's form.
CROSSOVER: dict[tuple[int, int], int] = {}


def rows_kernel_takes(m: int, k: int, n: int) -> bool:
    """Whether m rows of a [k, n] product run the multi-row path (exl2_qmm, or exl2_tc where
    exl2_tc_plan.takes says so), not dequantize + cuBLAS or the decode GEMV: 2 up to EXLPY_QUANT_ROWS rows below
    the shape's crossover, one row only where the tensor-core kernel takes it, and 65-256 rows (prompt chunks)
    where it takes them (EXLPY_TC_MAX_ROWS, below the crossover)."""
    from exlpy.kernels.exl2_tc_plan import takes

    if m == 1 or m > MAX_ROWS:
        return takes(m, k, n)
    return 2 <= m <= options().quant_rows and m < CROSSOVER.get((k, n), MAX_ROWS + 1)


def block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


@dataclass(frozen=True)
class Launch:
    widths: int  # bit mask of the widths its tasks use (bit b set: some task is b-bit)
    programs: int
    tasks: torch.Tensor  # int64 [programs, len(FIELDS)]


@dataclass(frozen=True)
class QmmPlan:
    k: int
    n: int  # output columns of all matrices together
    nblk: int  # 32-row blocks of K (the last one possibly partial)
    block_n: int
    kb: int
    split: bool  # several programs add into one column block (workspace + arrival counters)
    multi: bool  # some program runs several segment-table rows
    aligned: bool  # every q_weight offset and stride keeps 16-byte loads
    launches: tuple[Launch, ...]
    segments: torch.Tensor  # int64 [pieces, len(SEG_FIELDS)]
    block_groups: torch.Tensor  # int32: every matrix's block -> group table, side by side
    src: torch.Tensor  # int32 [32 * nblk]: source column of each blocked-x position (-1: zero)


@dataclass(frozen=True)
class MatrixPart:
    """What the plan needs of one matrix: hashable, so equal sets of matrices share a cached plan."""

    layout: QuantLayout
    n: int
    ld_n: int
    s_qw: int
    s_sc: int
    s_aux: int
    o_qw: int
    o_sc: int
    o_aux: int


def describe_parts(parts: list[QuantMatrix], what: str = "multi-row") -> tuple[MatrixPart, ...]:
    """The plan's view of a group's matrices (checked to share kind, device and K and whole 32-row blocks); also
    exl2_tc_plan's (`what` names the kernel in the errors)."""
    q0 = parts[0]
    aux0 = q0.scale_max if q0.kind == "exl2" else q0.zeros
    out = []
    for p in parts:
        if p.kind != q0.kind or p.device != q0.device or p.k != q0.k:
            raise ValueError(f"a {what} group needs matrices of one kind, device and K")
        if not supports(p):
            raise ValueError(f"the {what} kernel needs groups of whole 32-row blocks")
        aux = p.scale_max if p.kind == "exl2" else p.zeros
        assert aux is not None and aux0 is not None
        out.append(MatrixPart(p.layout, p.n, p.q_weight.shape[1], p.q_weight.stride(0), p.scales.stride(0),
                         aux.stride(0) if aux.dim() > 1 else 0, element_offset(p.q_weight, q0.q_weight),
                         element_offset(p.scales, q0.scales), element_offset(aux, aux0)))
    return tuple(out)


def plan_for(parts: list[QuantMatrix], perm: torch.Tensor | None, bm: int = 16) -> QmmPlan:
    """The plan for x @ [parts side by side] (parts share K and act order `perm`) at BLOCK_M `bm`, cached by
    the matrices' layouts, relative placement, the permutation's identity and CONFIG. Made outside CUDA-graph
    capture (the tables are copied to the device): QuantLinear and FusedQuant make theirs at load time."""
    dev = cuda_device(parts[0].device)
    cfg = (CONFIG["KB"], CONFIG["WAVES"], CONFIG["ONE_LAUNCH"], CONFIG[f"BLOCK_N_{bm}"])
    return _plan_cached(describe_parts(parts), dev, num_sms(dev), cfg, PermKey(perm))


class PermKey:
    """Hashes a permutation tensor by identity (plans hold device tables derived from it); also exl2_tc_plan's."""

    def __init__(self, perm: torch.Tensor | None) -> None:
        self.perm = perm

    def __hash__(self) -> int:
        return id(self.perm)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PermKey) and other.perm is self.perm


BITREV5 = [int(f"{p:05b}"[::-1], 2) for p in range(32)]


@functools.lru_cache(maxsize=4096)
def _src_cached(k: int, perm: PermKey, device: torch.device) -> torch.Tensor:
    """_src_table once per permutation (shared by a matrix's plans and the groups it leads)."""
    return _src_table(k, perm.perm, device)


def _src_table(k: int, perm: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Blocked x position 32 b + p holds sorted row 32 b + bitrev5(p) (the order the kernel stacks a block's
    codes in), i.e. input column perm[that row]."""
    nblk = -(-k // 32)
    rows = 32 * torch.arange(nblk)[:, None] + torch.tensor(BITREV5)[None, :]  # [nblk, 32] sorted row
    src = perm.to("cpu", torch.int64)[rows.clamp(max=k - 1)] if perm is not None else rows.clone()
    src[rows >= k] = -1
    return src.reshape(-1).to(device=device, dtype=torch.int32)


def _block_groups(lay: QuantLayout) -> list[int]:
    nblk = -(-lay.k // 32)
    out = []
    g = 0
    for b in range(nblk):
        while lay.group_rows[g + 1] <= b * 32:
            g += 1
        out.append(g)
    return out


@functools.lru_cache(maxsize=4096)
def _plan_cached(parts: tuple[MatrixPart, ...], device: torch.device, sms: int, cfg: tuple[int, int, int, int],
                 perm: PermKey) -> QmmPlan:
    kb, waves, one_launch, bn = cfg
    k = parts[0].layout.k
    nblk = -(-k // 32)
    n_total = sum(p.n for p in parts)
    want = waves * sms
    cols = sum(triton.cdiv(p.n, bn) for p in parts)
    # split-K only where the workspace holds MAX_ROWS rows of every output column
    may_split = n_total * MAX_ROWS <= WS_ELEMS and cols <= WS_BLOCKS
    segs = [(m, s) for m, p in enumerate(parts) for s in p.layout.segments]

    def seg_blocks(m: int, s: object) -> tuple[int, int]:
        lay = parts[m].layout
        return s.row0 // 32, -(-lay.group_rows[s.g_hi] // 32)  # type: ignore[attr-defined]

    cost = {(m, s): (parts[m].layout.group_rows[s.g_hi] - s.row0) * s.bits * parts[m].n for m, s in segs}
    total = sum(cost.values())
    tasks: list[tuple[list[int], int, int]] = []  # (task row, widths mask, cost)
    pieces: list[list[int]] = []
    bg_all: list[int] = []
    o_y = cnt0 = 0
    for m, p in enumerate(parts):
        pn = triton.cdiv(p.n, bn)
        o_bg = len(bg_all)
        bg_all += _block_groups(p.layout)
        head = [p.n, p.ld_n, p.s_qw, p.o_sc, p.s_sc, p.o_aux, p.s_aux, o_bg, o_y]
        split = []  # per segment: its pieces' (blk_lo, blk_hi)
        for s in p.layout.segments:
            b_lo, b_hi = seg_blocks(m, s)
            blocks = b_hi - b_lo
            nk = max(1, min(triton.cdiv(blocks, kb), round(want * cost[(m, s)] / total / pn))) if may_split else 1
            per = triton.cdiv(triton.cdiv(blocks, nk), kb) * kb  # whole K steps per program where possible
            split.append([(lo, min(lo + per, b_hi)) for lo in range(b_lo, b_hi, per)])
        widths = sum(1 << b for b in {s.bits for s in p.layout.segments})
        whole = all(len(sp) == 1 for sp in split) and (one_launch or len(p.layout.segments) == 1 or not may_split)
        first = len(pieces)
        for s, sp in zip(p.layout.segments, split):
            for lo, hi in sp:
                pieces.append([s.bits, lo, hi, s.row0 // 32, p.o_qw + s.word0 * p.s_qw])
        for cb in range(pn):
            if whole:  # one program per column block runs every segment: nothing to add up across programs
                c = sum((pc[2] - pc[1]) * pc[0] for pc in pieces[first:])
                tasks.append(([cb, *head, cnt0 + cb, 0, first, len(pieces)], widths, c))
            else:
                for j in range(first, len(pieces)):
                    pc = pieces[j]
                    tasks.append(([cb, *head, cnt0 + cb, 0, j, j + 1], 1 << pc[0], (pc[2] - pc[1]) * pc[0]))
        o_y += p.n
        cnt0 += pn
    arrivals = [0] * cnt0
    ci, ai = FIELDS.index("cnt"), FIELDS.index("arrivals")
    for r, _, _ in tasks:
        arrivals[r[ci]] += 1
    for r, _, _ in tasks:
        r[ai] = arrivals[r[ci]]
    if max(arrivals) > 1 and not may_split:
        raise AssertionError("split-K planned for a product the workspace cannot hold")
    tasks.sort(key=lambda t: -t[2])  # largest first: the tail of the grid is made of short programs
    by_launch: dict[int, list[list[int]]] = {}
    for r, w, _ in tasks:
        by_launch.setdefault(0 if one_launch else w, []).append(r)
    launches = []
    for key, rs in sorted(by_launch.items()):
        w = key or sum(1 << b for b in {pc[0] for pc in pieces})
        launches.append(Launch(w, len(rs), torch.tensor(rs, dtype=torch.int64, device=device)))
    aligned = all(p.o_qw % 4 == 0 and p.s_qw % 4 == 0 and p.ld_n % 32 == 0 for p in parts)
    multi = any(r[FIELDS.index("seg_hi")] - r[FIELDS.index("seg_lo")] > 1 for r, _, _ in tasks)
    return QmmPlan(k, n_total, nblk, bn, kb, max(arrivals) > 1, multi, aligned, tuple(launches),
                   torch.tensor(pieces, dtype=torch.int64, device=device),
                   torch.tensor(bg_all, dtype=torch.int32, device=device), _src_cached(k, perm, device))
