"""Compile the multi-row EXL2 expert kernels (exlpy/kernels/moe_exl2_rows.py: 3-16 sorted rows per expert) for an
H100 (sm_90a) without a GPU; report registers, spills and shared memory at the configurations the wrappers pick
(every width, K whole steps or not, mixed widths; gate|up and down) and at the --sweep's row counts.

python benchmarks/moe_rows_compile_check.py [--json] [--rows 8] [--cols 512] [--warps 4]
Runs on any machine with Triton's bundled CUDA toolchain (no driver needed); tests/test_moe_exl2_rows.py asserts
on its --json output. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the kernels are compiled here")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks.moe_compile_check import TARGET, compile_kernel  # noqa: E402
from benchmarks.sm90_ptxas import compile_parallel, ptxas_report  # noqa: E402
from exlpy.kernels import moe_exl2_rows as mr  # noqa: E402

TABLES = {f"{w}_{t}": typ for w in ("g", "u") for t, typ in (("qw", "*i32"), ("sc", "*i32"), ("sm", "*fp32"),
                                                            ("word", "*i32"), ("info", "*i32"))}


def one(gate_up: bool, width: int, even: bool, rows: int, cols: int, warps: int, step: int = 0) -> dict:
    """The main kernel as the wrappers launch it (register cap mr.ROWS_MAXNREG[even], where set)."""
    fn = mr._rows_kernel
    nb = mr.ROWS_NB[even][width] if width else 1
    ptrs = {"xp_ptr": "*fp32", "order_ptr": "*i64", "counts_ptr": "*i32", "ws_ptr": "*fp32", **TABLES}
    consts = dict(E_P2=8, R=rows, BLOCK_N=cols, B=width, NB=nb, EVEN=even, GATE_UP=gate_up, TWO_X=False,
                  RSTEP=step or min(rows, mr.ROWS_STEP if width else mr.ROWS_STEP_MIXED))
    sig = {name: ptrs.get(name) or ("constexpr" if name in consts else "i32") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    opts = {"num_warps": warps, "num_stages": 1}
    if mr.ROWS_MAXNREG[even]:
        opts["maxnreg"] = mr.ROWS_MAXNREG[even]
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET, options=opts)
    return {"shared": k.metadata.shared, "maxnreg": mr.ROWS_MAXNREG[even], **ptxas_report(k.asm["ptx"])}


def variants(rows: int, cols: int, warps: int, sweep: bool, widths: tuple[int, ...] = (2, 3, 4, 5, 6, 8, 0)
             ) -> dict[str, dict]:
    jobs: dict[str, tuple] = {}
    for width in widths:
        for even in (True, False):
            for gate_up in (True, False):
                tag = f"{'gate_up' if gate_up else 'down'} {f'{width}-bit' if width else 'mixed'}" + (
                    "" if even else " masked")
                jobs[f"rows{rows} {tag}"] = (one, gate_up, width, even, rows, cols, warps)
    for dt in ("fp16", "bf16", "fp32"):  # the x gather (the main kernel reads only its fp32 copy)
        for gate_up in (True, False):
            jobs[f"rows{rows} gather {dt}{' gate_up' if gate_up else ''}"] = (
                compile_kernel, mr._gather_kernel, {"x_ptr": "*" + dt, "order_ptr": "*i64", "counts_ptr": "*i32",
                                                    "g_perm": "*i32", "u_perm": "*i32", "xp_ptr": "*fp32"},
                dict(E_P2=8, R=rows, R_P2=triton.next_power_of_2(rows), BLOCK=128, GATE_UP=gate_up), 4, 1)
    if sweep:  # the --sweep's other shapes, 4-bit (benchmarks/moe.py SWEEP_EXL2_ROWS)
        for r, c, w in sorted({(r, c, w) for c, w, _, r in _sweep()} - {(rows, cols, warps)}):
            for gate_up in (True, False):
                jobs[f"rows{r} {c} columns w{w} {'gate_up' if gate_up else 'down'} 4-bit"] = (
                    one, gate_up, 4, True, r, c, w)
    return compile_parallel(jobs)


def _sweep() -> list:
    from benchmarks.moe import SWEEP_EXL2_ROWS

    return SWEEP_EXL2_ROWS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", type=int, default=mr.ROWS)
    ap.add_argument("--cols", type=int, default=mr.ROWS_COLS)
    ap.add_argument("--warps", type=int, default=mr.ROWS_WARPS)
    ap.add_argument("--sweep", action="store_true", help="also the sweep's row counts and column blocks (4-bit)")
    ap.add_argument("--widths", default="2,3,4,5,6,8,0", help="comma list of widths (0: mixed)")
    a = ap.parse_args()
    res = variants(a.rows, a.cols, a.warps, a.sweep, tuple(int(w) for w in a.widths.split(",")))
    if a.json:
        print("JSON " + json.dumps(res))
    else:
        for name, r in res.items():
            print(f"{name:48s} regs {r['regs']:4d}  spills {r['spill_bytes']:5d}  shared {r['shared']:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
