"""Work split of the decode GEMV (exl2_gemv.py): which program computes which columns and groups of which matrix.

A plan is made once per set of matrices (cached) and lives on the device as an int64 task table, one row per
program, so a launch needs no host work beyond its arguments. Programs are spread so that the grid fills the
device about WAVES times over, in proportion to the packed bytes of each (matrix, segment).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from exlpy.quant.layout import QuantLayout, QuantMatrix

WS_COLS = 1 << 20  # fp32 workspace columns per device (more output columns take the generic path)
WS_BLOCKS = 1 << 14  # arrival counters per device
ROW_PAD = 16 * 32  # act-order x is zero-padded this far past K: a step covers at most 16 blocks of 32 rows

# Columns of a task row. o_*: element offsets of the matrix's tensors from the plan's first matrix (q_weight's
# already at the segment's first word row); s_*: row strides; ga/gb: the groups; cnt: the column block's arrival
# counter and `arrivals` how many programs add into it.
FIELDS = ("cb", "n", "ld_n", "s_qw", "o_qw", "o_sc", "s_sc", "o_aux", "s_aux", "o_gr", "ga", "gb", "row0", "o_y",
          "cnt", "arrivals", "bits")

# Launch parameters; benchmarks/quant_matmul.py sweeps them. BLOCK_N shrinks (down to MIN_BLOCK_N) until the
# grid has WAVES programs per SM; num_warps = BLOCK_N / (32 * COLS) gives each thread COLS columns (4: one
# 16-byte load per word row). WORDS: packed words in flight per thread and step. MAXNREG: register cap per
# thread (0: compiler's choice), trading hoisted loads for occupancy. Defaults: best of the H100 sweep in
# benchmarks/results/quant_matmul.md (MIN_BLOCK_N: benchmarks/results/decode.md, session 3 sweep).
# ONE_LAUNCH: every bit width of a plan in one launch (task rows name their width) rather than one per width.
CONFIG: dict[str, int] = {"BLOCK_N": 512, "MIN_BLOCK_N": 256, "WAVES": 4, "WORDS": 16, "COLS": 4, "MAXNREG": 96,
                          "ONE_LAUNCH": 1}


@dataclass(frozen=True)
class Launch:
    bits: int  # 0: several widths (`widths`), each task row names its own
    nb: int  # 32-row blocks per step
    programs: int
    tasks: torch.Tensor  # int64 [programs, len(FIELDS)]
    widths: int = 0  # mask of the widths of a mixed launch
    nbs: int = 0  # their blocks per step, 5 bits each at 5 * (index of the width in 2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class GemvPlan:
    block_n: int
    num_warps: int
    mode: int  # 0: one program per column block writes y directly; 1: split-K through the workspace
    aligned: bool  # every offset and stride keeps 16-byte loads
    launches: tuple[Launch, ...]


def supports(qm: QuantMatrix) -> bool:
    """Whether the decode kernel takes this matrix: every group but the last spans whole 32-row blocks (so
    every group starts on a block of its segment; 2-bit groups of 16 rows do not qualify)."""
    return qm.n <= WS_COLS and _blocked(qm.layout)


@functools.lru_cache(maxsize=4096)
def _blocked(lay: QuantLayout) -> bool:
    return all((b - a) % 32 == 0 for a, b in zip(lay.group_rows[:-2], lay.group_rows[1:-1]))


def cuda_device(dev: torch.device) -> torch.device:
    """`dev` with its index ("cuda" alone means the current device): plans and workspaces are per device."""
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the CPU interpreter: a few programs exercise split-K and the counters
    return torch.cuda.get_device_properties(device).multi_processor_count


def element_offset(t: torch.Tensor, base: torch.Tensor) -> int:
    """Elements from `base` to `t` (tensors of one group are addressed from the first matrix's pointers)."""
    d = t.data_ptr() - base.data_ptr()
    if d % t.element_size():
        raise ValueError("quantized tensors of one group must be element-aligned with each other")
    return d // t.element_size()


@dataclass(frozen=True)
class _Part:
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
    o_gr: int


def _describe(parts: list[QuantMatrix]) -> tuple[_Part, ...]:
    q0 = parts[0]
    aux0 = q0.scale_max if q0.kind == "exl2" else q0.zeros
    out = []
    for p in parts:
        if p.kind != q0.kind or p.device != q0.device or p.k != q0.k:
            raise ValueError("a GEMV group needs matrices of one kind, device and K")
        aux = p.scale_max if p.kind == "exl2" else p.zeros
        assert aux is not None and aux0 is not None and p.group_rows is not None and q0.group_rows is not None
        out.append(_Part(p.layout, p.n, p.q_weight.shape[1], p.q_weight.stride(0), p.scales.stride(0),
                         aux.stride(0) if aux.dim() > 1 else 0, element_offset(p.q_weight, q0.q_weight),
                         element_offset(p.scales, q0.scales), element_offset(aux, aux0),
                         element_offset(p.group_rows, q0.group_rows)))
    return tuple(out)


def plan_for(parts: list[QuantMatrix], device: torch.device) -> GemvPlan:
    """The plan for x @ [parts side by side], cached by the matrices' layouts and relative placement."""
    return _plan_cached(_describe(parts), device, num_sms(device), tuple(sorted(CONFIG.items())))


def _nb(bits: int, must_divide: list[int], biggest: int, words: int) -> int:
    """32-row blocks per step for one bit width: about `words` packed words in flight per column, and a step
    never crosses into the next group (nb divides every group's block count but each matrix's last group,
    whose overhang reads zero x)."""
    nb = max(1, min(words // bits, 16, biggest))
    while any(c % nb for c in must_divide):
        nb -= 1
    return nb


@functools.lru_cache(maxsize=512)
def _plan_cached(parts: tuple[_Part, ...], device: torch.device, sms: int, cfg: tuple[tuple[str, int], ...]
                 ) -> GemvPlan:
    c = dict(cfg)
    want = c["WAVES"] * sms
    bn = c["BLOCK_N"]
    while (bn > max(c["MIN_BLOCK_N"], 32 * c["COLS"])
           and sum(triton.cdiv(p.n, bn) * p.layout.num_groups for p in parts) < want):
        bn //= 2
    if sum(p.n for p in parts) > WS_COLS or sum(triton.cdiv(p.n, bn) for p in parts) > WS_BLOCKS:
        raise ValueError(f"{sum(p.n for p in parts)} output columns exceed the decode workspace")
    segs = [(m, s) for m, p in enumerate(parts) for s in p.layout.segments]
    cost = {(m, s): (parts[m].layout.group_rows[s.g_hi] - s.row0) * s.bits * parts[m].n for m, s in segs}
    total = sum(cost.values())
    rows: dict[int, list[list[int]]] = {}  # bits -> task rows
    must_divide: dict[int, list[int]] = {}  # bits -> block counts of the groups a step must not run past
    biggest: dict[int, int] = {}  # bits -> blocks of the largest group
    o_y = cnt0 = 0
    for m, p in enumerate(parts):
        lay, pn = p.layout, triton.cdiv(p.n, bn)
        for s in lay.segments:
            groups = s.g_hi - s.g_lo
            nk = max(1, min(groups, round(want * cost[(m, s)] / total / pn)))
            gpp = -(-groups // nk)
            blocks = [-(-(lay.group_rows[g + 1] - lay.group_rows[g]) // 32) for g in range(s.g_lo, s.g_hi)]
            must_divide.setdefault(s.bits, []).extend(blocks[:-1] if s.g_hi == lay.num_groups else blocks)
            biggest[s.bits] = max(biggest.get(s.bits, 1), max(blocks))
            o_qw = p.o_qw + s.word0 * p.s_qw
            for cb in range(pn):
                for ga in range(s.g_lo, s.g_hi, gpp):
                    rows.setdefault(s.bits, []).append(
                        [cb, p.n, p.ld_n, p.s_qw, o_qw, p.o_sc, p.s_sc, p.o_aux, p.s_aux, p.o_gr, ga,
                         min(ga + gpp, s.g_hi), s.row0, o_y, cnt0 + cb, 0, s.bits])
        o_y += p.n
        cnt0 += pn
    arrivals = [0] * cnt0
    for r in (r for rs in rows.values() for r in rs):
        arrivals[r[FIELDS.index("cnt")]] += 1
    for r in (r for rs in rows.values() for r in rs):
        r[FIELDS.index("arrivals")] = arrivals[r[FIELDS.index("cnt")]]
    launches = []
    nbs = {bits: _nb(bits, must_divide[bits], biggest[bits], c["WORDS"]) for bits in rows}
    if c.get("ONE_LAUNCH", 1) and len(rows) > 1:
        index = {2: 0, 3: 1, 4: 2, 5: 3, 6: 4, 8: 5}
        ga, gb, gr = FIELDS.index("ga"), FIELDS.index("gb"), FIELDS.index("o_gr")
        lay_of = {p.o_gr: p.layout for p in parts}

        def cost(r: list[int]) -> int:  # packed words the task reads per column: largest first, short ones last
            g = lay_of[r[gr]].group_rows
            return (g[r[gb]] - g[r[ga]]) * r[FIELDS.index("bits")]

        rs = sorted((r for bits in sorted(rows) for r in rows[bits]), key=cost, reverse=True)
        launches.append(Launch(0, 1, len(rs), torch.tensor(rs, dtype=torch.int64, device=device),
                               sum(1 << b for b in rows), sum(nb << (5 * index[b]) for b, nb in nbs.items())))
    else:
        for bits, rs in sorted(rows.items()):
            launches.append(Launch(bits, nbs[bits], len(rs), torch.tensor(rs, dtype=torch.int64, device=device)))
    aligned = all(p.o_qw % 4 == 0 and p.s_qw % 4 == 0 and p.ld_n % 32 == 0 for p in parts)
    return GemvPlan(bn, max(1, bn // (32 * c["COLS"])), 0 if max(arrivals) == 1 else 1, aligned, tuple(launches))
