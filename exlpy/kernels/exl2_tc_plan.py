"""Work split and launch table of the tensor-core dequant GEMM (exl2_tc.py) for 1-256 activation rows.

A plan is made once per set of matrices that read the same x (one matrix, q|k|v, gate|up) and per BLOCK_M class (16, 32,
64 rows; 128 and 256 for prompt chunks, EXLPY_TC_MAX_ROWS), and lives on the device as an int64 task table, one row per
program: a column block of one matrix over a run of whole groups of one bit width. Unlike exl2_qmm_plan.py there is no
block -> group table: within a task every group has the same number of rows (`gsz`; a converter's width has one group
size, only the matrix's last group is cut at K, and it ends the task), so the kernel finds the group of a K step by one
division, and loads each group's scales once per step of that group. K is split over whole groups so that the grid fills
the device about WAVES times over, in proportion to the packed bytes of each (matrix, run).

The launch table: CONFIG per BLOCK_M class, SHAPE_CONFIG overriding it per (K, N total, BLOCK_M) where a sweep
(benchmarks/exl2_speed.py --parts micro --tc-sweep) found better parameters on a GPU. Whether 2-64 rows of a
product take this kernel or exl2_qmm is `takes` (EXLPY_QMM_KERNEL, then the TC_ROWS table); whether 65-256 rows
take it rather than dequantize + cuBLAS is `takes` too (EXLPY_TC_MAX_ROWS, then exl2_qmm_plan.CROSSOVER).

Past 64 rows (classes 128 and 256) a program covers TILE_M rows of x (default 128): the row count is cut into row
tiles on the grid's second axis, each with its own rows of the split-K workspace and its own arrival counters.
Within a tile the decoded weight tile of a K step meets all of the tile's rows in one tl.dot; each further tile
decodes the packed words again (read from L2 after the first: the tiles of a task are neighbours in the grid).
A 64-row tile keeps the 64-row variant's registers; a 128-row one halves the decoding per row (see CONFIG).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from exlpy.kernels import exl2_qmm_plan as _qmm_plan
from exlpy.kernels.exl2_gemv_plan import cuda_device, num_sms, supports
from exlpy.kernels.exl2_qmm_plan import MatrixPart, PermKey, describe_parts
from exlpy.quant.layout import QuantLayout, QuantMatrix
from exlpy.runtime import options

__all__ = ["CONFIG", "FIELDS", "MAX_ROWS", "NARROW_ROWS", "SHAPE_CONFIG", "TC_ROWS", "TcPlan", "launch_config",
           "plan_for", "supports", "takes", "tile_m", "wanted", "wide_classes"]

MAX_ROWS = 256  # rows a launch takes at most (BLOCK_M classes 16, 32, 64, 128, 256)
NARROW_ROWS = 64  # the classes up to here: decode batches and verification (exl2_qmm's range)
# The split-K workspace of 1-64 rows is exl2_qmm's (fp32 sums and arrival counters per device, kept zero by both
# kernels, which run one at a time on a device's stream): 64 rows of up to 32,768 output columns (gate|up of an 8B
# model); wider products (a vocabulary head) run one program per column block over the whole K.
WS_ELEMS = _qmm_plan.WS_ELEMS
WS_BLOCKS = _qmm_plan.WS_BLOCKS
# 65-256 rows: a workspace of their own (32 MiB of fp32 sums, allocated only where EXLPY_TC_MAX_ROWS > 64), 256 rows
# of 32,768 columns, and counters for every row tile of every column block.
WIDE_WS_ELEMS = 1 << 23
WIDE_WS_BLOCKS = 1 << 16

# Columns of a task row. o_qw: element offset (from the plan's first q_weight) of the segment's first word row;
# w_end: the segment's word rows (loads past it are masked); o_sc / o_aux: offsets of the matrix's scales and
# scale_max (GPTQ: scales and zeros); g0: the group of row r0; gsz: rows per group in this task; r0 / r1: the
# task's sorted rows relative to the segment's first row xr0 (r0 on a K step of its run); o_y: first output column
# of the matrix; cnt / arrivals: the column block's arrival counter and how many tasks add into it; left0: rows
# of group g0 from r0 on.
FIELDS = ("cb", "n", "ld_n", "s_qw", "o_qw", "w_end", "o_sc", "s_sc", "o_aux", "s_aux", "g0", "gsz", "r0", "r1",
          "xr0", "o_y", "cnt", "arrivals", "bits", "left0")

# Launch parameters per BLOCK_M class. BLOCK_N: output columns per program; WARPS: warps per program; KB:
# 32-row blocks per K step (one tl.dot over 32 KB rows; cut per width to divide its group size); WAVES: programs
# per SM the K split aims for; SWAP: 1 computes y^T = W^T x^T (the dequantized tile is the dot's first operand,
# the rows the narrow one, which suits wgmma's 64-row minimum), 0 computes x W; PREFETCH: the next K step's
# packed words are loaded into registers before this step's dequantization (a software pipeline without
# shared memory); STAGES: Triton's own pipelining depth (num_stages) on top; MAXNREG: register cap (0: none);
# GRID: programs per SM of a persistent stream-K launch, each taking an equal share of all K steps (0: one
# program per task of whole groups, WAVES per SM);
# FOLD: scales applied per weight before the dot (one accumulator; pays at 64 rows, where scaling each step's
# product costs an FMA per weight and a second accumulator); HALF: 4- and 8-bit codes decoded two at a time by
# f16x2 arithmetic (inline PTX; x gathered in the pairs' order, half_order).
# Defaults from the H100 sweep (2026-11-26 12:58, commit f8eba49, benchmarks/results/exl2_speed.md: one parameter
# changed at a time on 4-bit gate|up 4096x28672 and converter-mixed down 14336x4096): 16 rows KB 2 (72.6 -> 60.9 us
# and 39.4 -> 32.5 us; BLOCK_N 64 was faster still on gate|up, 56.6, but 44% slower on down), 32 rows WAVES 8
# (84.2 -> 69.9 and 47.5 -> 43.8; BLOCK_N 64 + KB 4: 64.9 on gate|up, 71.7 on down). PREFETCH 0, STAGES 2, the
# round-robin persistent grid, MAXNREG 168 and WARPS 8 were all slower there. 64 rows: FOLD 1 took gate|up from
# 109.5 to 82.5 but down from 74.7 to 91.8; 33-64 rows stay on exl2_qmm (TC_ROWS). sm_90a compile with Triton 3.6
# (benchmarks/tc_compile_check.py, SASS of the K loop per 4-bit weight): 16 rows 4.1, 32 rows 5.5, 64 rows 6.1;
# HALF 2.9 / 4.1 / 5.1 (not yet on a GPU, so off).
#
# 65-256 rows (classes 128 and 256; TILE_M: rows per program, the rest on the grid's second axis; WAVES counts
# programs of all row tiles together). Not yet timed on a GPU; chosen by sm_90a compiles under Triton 3.6
# (benchmarks/tc_compile_check.py, 4-bit, split-K epilogue, BLOCK_N 128, 8 warps, KB 4, FOLD 1): one dot over
# 128 rows (TILE_M 128) takes 255 registers and spills 396 bytes, all outside the K loop (no STL / LDL in it),
# 420 SASS instructions per thread and K step, 6.6 per weight: 0.051 per weight and row; 64-row tiles take 201
# registers, no spills, 396 instructions, 6.2 per weight: 0.097 per weight and row (each tile decodes the words
# again). Both run one program of 8 warps per SM. So 128-row tiles (a 256-row chunk is two), with 64 the
# alternative benchmarks/exl2_speed.py --parts wide --wide-sweep times. One 256-row dot spills 2.6-3.8 KB
# (inside the loop) at every BLOCK_N / warps / KB tried; FOLD 0 (two [BLOCK_N, rows] accumulators) spills from
# 128 rows on; KB 2 costs 9.3 instructions per weight.
_BASE = {"WARPS": 4, "WAVES": 4, "SWAP": 1, "PREFETCH": 1, "FOLD": 0, "HALF": 0, "STAGES": 1, "MAXNREG": 0,
         "GRID": 0}
_WIDE = {**_BASE, "BLOCK_N": 128, "WARPS": 8, "KB": 4, "FOLD": 1, "WAVES": 2, "TILE_M": 128}
CONFIG: dict[int, dict[str, int]] = {
    16: {**_BASE, "BLOCK_N": 128, "KB": 2},
    32: {**_BASE, "BLOCK_N": 128, "KB": 2, "WAVES": 8},
    64: {**_BASE, "BLOCK_N": 64, "KB": 4},
    128: dict(_WIDE),
    256: dict(_WIDE),
}
# (K, N total, BLOCK_M) -> overrides of CONFIG[BLOCK_M] (measured per shape; empty until a GPU sweep fills it)
SHAPE_CONFIG: dict[tuple[int, int, int], dict[str, int]] = {}

# Row counts that take this kernel under EXLPY_QMM_KERNEL=auto (the default): (K, N total) -> (first, last) row
# count, or the key None for every shape not listed. From the H100 run (2026-11-26 12:58, commit f8eba49): at 8,
# 16 and 32 rows it beat exl2_qmm on all four 8B shapes (q|k|v, o, gate|up, down), 4-bit and converter-mixed alike
# (by 5-30% with the launch table then in force; the defaults above are faster still), 5-7 rows run the same
# compiled variant as 8; the decode GEMV stays faster at 1-4 rows (1.6-1.9 TB/s against 0.8 at one row on
# gate|up), and at 64 rows mixed layouts ran slower than on exl2_qmm (100.5 against 92.7 us on gate|up).
TC_ROWS: dict[tuple[int, int] | None, tuple[int, int]] = {None: (5, 32)}


def block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128 if m <= 128 else 256


def launch_config(k: int, n: int, bm: int) -> dict[str, int]:
    """CONFIG[bm] with the shape's measured overrides."""
    return {**CONFIG[bm], **SHAPE_CONFIG.get((k, n, bm), {})}


def tile_m(c: dict[str, int], bm: int) -> int:
    """Rows per program of a class: the class itself up to 64 rows, else its TILE_M (a power of two from 16 to the
    class: a tl.arange bound)."""
    if bm <= NARROW_ROWS:
        return bm
    tile = c.get("TILE_M", bm)
    if tile < 16 or tile > bm or tile & (tile - 1):
        raise ValueError(f"TILE_M {tile} of the {bm}-row class: a power of two from 16 to {bm}")
    return tile


def takes(m: int, k: int, n: int) -> bool:
    """Whether m rows of a [k, n] product (n: all columns of a fused group) run this kernel: 1-64 rows rather than
    exl2_qmm (EXLPY_QMM_KERNEL=tc always, =qmm never, =auto by TC_ROWS); 65-256 rather than dequantize + cuBLAS
    up to EXLPY_TC_MAX_ROWS and below the shape's exl2_qmm_plan.CROSSOVER (the fewest rows cuBLAS wins at)."""
    if m > NARROW_ROWS:
        return m <= options().tc_max_rows and m < _qmm_plan.CROSSOVER.get((k, n), MAX_ROWS + 1)
    kind = options().qmm_kernel
    if m < 1 or kind == "qmm":
        return False
    if kind == "tc":
        return True
    lo, hi = TC_ROWS.get((k, n), TC_ROWS.get(None, (0, -1)))
    return lo <= m <= hi


def wanted() -> bool:
    """Whether this kernel may take any product under the options in force (EXLPY_QMM_KERNEL=tc, or auto with a
    non-empty TC_ROWS table, or EXLPY_TC_MAX_ROWS past 64): groups made now build its plans."""
    kind = options().qmm_kernel
    return kind == "tc" or (kind == "auto" and any(lo <= hi for lo, hi in TC_ROWS.values())) or wide_classes() != ()


def wide_classes() -> tuple[int, ...]:
    """The classes past 64 rows that EXLPY_TC_MAX_ROWS lets run (their plans and workspace are made at load)."""
    top = options().tc_max_rows
    return tuple(bm for bm in (128, 256) if top > bm // 2)


@dataclass(frozen=True)
class Launch:
    widths: int  # bit b set: some task of this launch is b-bit
    kbs: int  # blocks per K step of each width, 5 bits at 5 * (b - 2)
    programs: int  # task rows
    tasks: torch.Tensor  # int64 [programs, len(FIELDS)]
    ranges: torch.Tensor | None = None  # int32 [grid + 1]: a persistent (stream-K) launch's rows per program

    @property
    def grid(self) -> int:
        return self.programs if self.ranges is None else self.ranges.numel() - 1


@dataclass(frozen=True)
class TcPlan:
    k: int
    n: int  # output columns of all matrices together
    bm: int
    cfg: tuple[tuple[str, int], ...]  # the launch parameters the plan was made for
    split: bool  # several programs add into one column block (workspace + arrival counters)
    aligned: bool  # every q_weight offset and stride keeps 16-byte loads
    tile: int  # rows per program (BLOCK_M of the kernel); past 64 rows the row tiles are the grid's second axis
    counters: int  # arrival counters of one row tile (the next tile's start at this offset)
    launches: tuple[Launch, ...]
    src: torch.Tensor  # int32 [K rounded up to 32]: input column of every act-order row, -1 past K (the x gather)

    @property
    def config(self) -> dict[str, int]:
        return dict(self.cfg)


def plan_for(parts: list[QuantMatrix], bm: int) -> TcPlan:
    """The plan for x @ [parts side by side] at BLOCK_M `bm`, cached by the matrices' layouts and relative
    placement, the permutation's identity and the launch parameters. Made outside CUDA-graph capture (its tables
    are copied to the device)."""
    dev = cuda_device(parts[0].device)
    cfg = launch_config(parts[0].k, sum(p.n for p in parts), bm)
    return _plan_cached(describe_parts(parts, "tensor-core"), dev, num_sms(dev), bm, tuple(sorted(cfg.items())),
                        PermKey(parts[0].perm))


@dataclass(frozen=True)
class _Run:
    """Groups [g_lo, g_hi) of one segment with gsz rows each (the last may be shorter: the matrix's end)."""

    bits: int
    g_lo: int
    g_hi: int
    gsz: int
    seg_row0: int
    seg_word0: int
    seg_words: int


def _runs(lay: QuantLayout) -> list[_Run]:
    """The layout's groups cut into runs of one width and one group size."""
    gr = lay.group_rows
    out = []
    for s in lay.segments:
        words = -(-(gr[s.g_hi] - s.row0) * s.bits // 32)
        g = s.g_lo
        while g < s.g_hi:
            size = gr[g + 1] - gr[g]
            h = g + 1
            while h < s.g_hi and gr[h + 1] - gr[h] == size:
                h += 1
            if h == s.g_hi - 1 and s.g_hi == lay.num_groups and gr[h + 1] - gr[h] < size:
                h += 1  # the matrix's last group, cut at K, ends this run
            out.append(_Run(s.bits, g, h, size, s.row0, s.word0, words))
            g = h
    return out


def _kb(target: int, sizes: list[int]) -> int:
    """Blocks per K step: at most `target`, dividing every group's block count (a step never spans groups)."""
    kb = max(1, target)
    while any((sz // 32) % kb for sz in sizes):
        kb -= 1
    return kb


def half_order() -> list[int]:
    """HALF's order of a 32-row block: position 2 q + h holds row 8 (q // 4) + q % 4 + 4 h (a 4-bit word's codes
    16 bits apart side by side)."""
    return [8 * (p // 8) + (p // 2) % 4 + 4 * (p % 2) for p in range(32)]


def _src(k: int, perm: torch.Tensor | None, device: torch.device, half: bool = False) -> torch.Tensor:
    """Input column of every position of the kernel's x: act order (in HALF's order within each block), -1 (zero)
    up to the next multiple of 32."""
    kp = k + (-k % 32)
    rows = torch.arange(kp)
    if half:
        rows = (rows.view(-1, 32)[:, half_order()]).reshape(-1)
    src = perm.to("cpu", torch.int64)[rows.clamp(max=k - 1)] if perm is not None else rows.clone()
    src[rows >= k] = -1
    return src.to(device=device, dtype=torch.int32)


@functools.lru_cache(maxsize=4096)
def _plan_cached(parts: tuple[MatrixPart, ...], device: torch.device, sms: int, bm: int,
                 cfg: tuple[tuple[str, int], ...], perm: PermKey) -> TcPlan:
    c = dict(cfg)
    bn = c["BLOCK_N"]
    k = parts[0].layout.k
    n_total = sum(p.n for p in parts)
    cols = sum(triton.cdiv(p.n, bn) for p in parts)
    # split-K only where the workspace holds the class's rows (64 at most for the narrow classes, which share
    # exl2_qmm's) of every output column, and a counter per column block and row tile
    tile = tile_m(c, bm)
    tiles = -(-bm // tile) if bm > NARROW_ROWS else 1
    elems, blocks = (WIDE_WS_ELEMS, WIDE_WS_BLOCKS) if bm > NARROW_ROWS else (WS_ELEMS, WS_BLOCKS)
    may_split = c["WAVES"] > 0 and n_total * max(bm, NARROW_ROWS) <= elems and cols * tiles <= blocks
    runs = [(m, r) for m, p in enumerate(parts) for r in _runs(p.layout)]
    sizes: dict[int, list[int]] = {}
    for _, r in runs:
        if r.g_hi - r.g_lo > 1:  # a K step must not cross a boundary between two groups of a run
            sizes.setdefault(r.bits, []).append(r.gsz)
    kb = {b: _kb(c["KB"], sizes.get(b, [])) for b in {r.bits for _, r in runs}}
    heads = []  # per matrix: (first column block's counter, first output column)
    o_y = cnt0 = 0
    for p in parts:
        heads.append((cnt0, o_y))
        o_y += p.n
        cnt0 += triton.cdiv(p.n, bn)

    def row(m: int, r: _Run, cb: int, lo: int, hi: int) -> list[int]:
        """The task row of column block cb over sorted rows [lo, hi) of run r (lo on a K step of the run)."""
        p, gr = parts[m], parts[m].layout.group_rows
        g = next(g for g in range(r.g_lo, r.g_hi) if gr[g + 1] > lo)
        return [cb, p.n, p.ld_n, p.s_qw, p.o_qw + r.seg_word0 * p.s_qw, r.seg_words, p.o_sc, p.s_sc, p.o_aux, p.s_aux,
                g, r.gsz, lo - r.seg_row0, hi - r.seg_row0, r.seg_row0, heads[m][1], heads[m][0] + cb, 0, r.bits,
                gr[g + 1] - lo]

    if may_split and c["GRID"] > 0:
        tasks, ranges = _stream(parts, runs, kb, bn, max(1, c["GRID"] * sms // tiles), row)
    else:  # the row tiles multiply the programs: the K split aims at WAVES per SM over all of them
        tasks, ranges = _split(parts, runs, bn, max(1, max(1, c["WAVES"]) * sms // tiles), may_split, row), None
    arrivals = [0] * cnt0
    ci, ai = FIELDS.index("cnt"), FIELDS.index("arrivals")
    for t in tasks:
        arrivals[t[ci]] += 1
    for t in tasks:
        t[ai] = arrivals[t[ci]]
    if max(arrivals) > 1 and not may_split:  # several runs (widths, group sizes) of a column block must add up
        raise ValueError(f"{n_total} output columns of mixed layout exceed the tensor-core kernel's workspace")
    widths = {t[FIELDS.index("bits")] for t in tasks}
    kbs = sum(kb[b] << (5 * (b - 2)) for b in widths)
    launch = Launch(sum(1 << b for b in widths), kbs, len(tasks), torch.tensor(tasks, dtype=torch.int64,
                                                                                device=device),
                    None if ranges is None else torch.tensor(ranges, dtype=torch.int32, device=device))
    aligned = all(p.o_qw % 4 == 0 and p.s_qw % 4 == 0 and p.ld_n % 32 == 0 for p in parts)
    return TcPlan(k, n_total, bm, cfg, max(arrivals) > 1, aligned, tile, cnt0, (launch,),
                  _src(k, perm.perm, device, bool(c.get("HALF"))))


def _split(parts: tuple[MatrixPart, ...], runs: list[tuple[int, _Run]], bn: int, want: int, may_split: bool,
           row: object) -> list[list[int]]:
    """One program per task: every run of every column block cut into pieces of whole groups, about `want` in
    all in proportion to the packed bytes; longest first (the grid's tail is then made of short programs)."""
    cost = {(m, r): (parts[m].layout.group_rows[r.g_hi] - parts[m].layout.group_rows[r.g_lo]) * r.bits * parts[m].n
            for m, r in runs}
    total = sum(cost.values())
    tasks: list[tuple[list[int], int]] = []
    for m, r in runs:
        p, gr = parts[m], parts[m].layout.group_rows
        pn = triton.cdiv(p.n, bn)
        groups = r.g_hi - r.g_lo
        nk = max(1, min(groups, round(want * cost[(m, r)] / total / pn))) if may_split else 1
        gpp = -(-groups // nk)
        for cb in range(pn):
            for ga in range(r.g_lo, r.g_hi, gpp):
                gb = min(ga + gpp, r.g_hi)
                tasks.append((row(m, r, cb, gr[ga], gr[gb]), (gr[gb] - gr[ga]) * r.bits))  # type: ignore[operator]
    tasks.sort(key=lambda t: -t[1])
    return [t for t, _ in tasks]


STEP_COST = 4  # a K step's fixed work (scales, x tile, dot, loop), in packed words per column, for _stream


def _stream(parts: tuple[MatrixPart, ...], runs: list[tuple[int, _Run]], kb: dict[int, int], bn: int, slots: int,
            row: object) -> tuple[list[list[int]], list[int]]:
    """Stream-K: the K steps of every (column block, run), in column-block order, cut into `slots` contiguous
    shares of equal cost (packed words per column plus STEP_COST per step), one per program of a persistent
    launch: no partial last wave, whatever the shape. A share is a list of task rows (a piece of a run of one
    column block each; pieces of one column block meet in the workspace). ranges[p]..ranges[p + 1] are program
    p's rows."""
    units = []  # (matrix, run, column block, steps, rows per step, cost per step)
    for m, p in enumerate(parts):
        for cb in range(triton.cdiv(p.n, bn)):
            for mm, r in runs:
                if mm == m:
                    gr = p.layout.group_rows
                    step = 32 * kb[r.bits]
                    steps = -(-(gr[r.g_hi] - gr[r.g_lo]) // step)
                    units.append((m, r, cb, steps, step, kb[r.bits] * r.bits + STEP_COST))
    total = sum(u[3] * u[5] for u in units)
    tasks: list[list[int]] = []
    ranges = [0]
    done = 0.0  # cost handed out so far
    ui, si = 0, 0  # the next unit and its first step not yet handed out
    for prog in range(slots):
        goal = total * (prog + 1) / slots
        while ui < len(units) and done < goal - 1e-9:
            m, r, cb, steps, step, cost = units[ui]
            take = min(steps - si, max(1, round((goal - done) / cost)))
            lo = parts[m].layout.group_rows[r.g_lo] + si * step
            hi = min(lo + take * step, parts[m].layout.group_rows[r.g_hi])
            tasks.append(row(m, r, cb, lo, hi))  # type: ignore[operator]
            done += take * cost
            si += take
            if si == steps:
                ui, si = ui + 1, 0
        ranges.append(len(tasks))
    return tasks, ranges
