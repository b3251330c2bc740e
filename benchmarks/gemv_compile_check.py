"""Compile the decode GEMV (exlpy/kernels/exl2_gemv.py) for an H100 (sm_90a) without a GPU, for 1-8 activation
rows: registers, spills and the SASS mix per variant (a row count that spills or needs far more instructions per
code than the FMAs it adds shows here before any GPU time is spent).

python benchmarks/gemv_compile_check.py [--bits 4] [--rows 1,2,4,8] [--json]
Runs with Triton's bundled CUDA toolchain (no driver needed); must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the kernels are compiled here")

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.qmm_compile_check import TARGET, _sass_mix  # noqa: E402
from benchmarks.sm90_ptxas import ptxas_report  # noqa: E402
from exlpy.kernels import exl2_gemv  # noqa: E402
from exlpy.kernels.exl2_gemv_plan import CONFIG, FIELDS  # noqa: E402

PTRS = {"x_ptr": "*fp32", "qw_ptr": "*i32", "sc_ptr": "*i32", "aux_ptr": "*fp32", "gr_ptr": "*i32",
        "bias_ptr": "*fp16", "res_ptr": "*fp16", "y_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
        "task_ptr": "*i64"}


def compile_variant(bits: int, rows: int, mode: int = 1, gptq: bool = False) -> dict:
    fn = exl2_gemv._gemv
    nb = exl2_gemv._rows_nb(max(1, min(CONFIG["WORDS"] // bits, 16)), bits, rows)
    consts = dict(BITS=bits, GPTQ=gptq, HAS_BIAS=False, HAS_RES=True, MODE=mode, ALIGNED=True,
                  BLOCK_N=CONFIG["BLOCK_N"], NB=nb, NF=len(FIELDS), MR=rows, PDL=True)
    ptrs = {**PTRS, "sc_ptr": "*fp16", "aux_ptr": "*fp16"} if gptq else PTRS
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, "xs", "ys", "wss")}
    maxnreg = CONFIG["MAXNREG"] if rows == 1 else exl2_gemv.ROWS_CONFIG[rows][0]
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                       options={"num_warps": CONFIG["BLOCK_N"] // (32 * CONFIG["COLS"]), "maxnreg": maxnreg})
    mix = _sass_mix(k.asm["cubin"])
    keep = ("LDG", "LDS", "STS", "LOP3", "FFMA", "FMUL", "FADD", "BAR", "IMAD", "ATOMG", "RED")
    return {"shared": k.metadata.shared, "maxnreg": maxnreg, **ptxas_report(k.asm["ptx"]),
            "sass": {o: sum(v for op, v in mix.items() if op.split(".")[0] == o) for o in keep},
            "sass_total": sum(mix.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", default="4")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = {f"{b}-bit MR{r}": compile_variant(b, r) for b in map(int, args.bits.split(","))
           for r in map(int, args.rows.split(","))}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for name, v in out.items():
            print(f"{name:12s} regs {v['regs']:4d} (cap {v['maxnreg']}) spill {v['spill_bytes']:5d} B "
                  f"shared {v['shared']:6d}  SASS {v['sass_total']:6d}  {v['sass']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
