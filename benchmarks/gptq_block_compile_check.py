"""Compile the GPTQ block kernel (exlpy/kernels/gptq_block.py) for an H100 (sm_90a) without a GPU, as its wrapper
launches it (FMA contraction off), and check from the PTX what its bit-identity with the torch loop rests on:
no fused multiply-add, divisions rounded to nearest (`div.rn.f32`, not the approximate `div.full`), the rounding
pair (t + 1.5*2^23) - 1.5*2^23 kept as two adds; plus registers and spills.

python benchmarks/gptq_block_compile_check.py [--json]
tests/test_convert_batching.py asserts on its --json output. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the kernels are compiled here")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sm90_ptxas import ptxas_report  # noqa: E402
from exlpy.kernels import gptq_block  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_variant(rtn: bool) -> dict:
    fn = gptq_block._gptq_block_kernel
    ptrs = {"w_ptr": "*fp32", "u_ptr": "*fp32", "s_ptr": "*fp32", "z_ptr": "*fp32", "m_ptr": "*fp32",
            "c_ptr": "*u8", "e_ptr": "*fp32"}
    consts = {"RTN": rtn, "R_PAD": gptq_block.R_PAD, "BLOCK_N": gptq_block.BLOCK_N}
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "fp32" if n == "magic" else "i32")
           for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                       options={"num_warps": 4, "num_stages": 1, "enable_fp_fusion": False})
    ptx = k.asm["ptx"]
    return {"fma": len(re.findall(r"\bfma\.", ptx)), "div_rn": len(re.findall(r"div\.rn\.f32", ptx)),
            "div_approx": len(re.findall(r"div\.(full|approx)\.f32", ptx)),
            "add_f32": len(re.findall(r"\badd\.(rn\.)?f32", ptx)), **ptxas_report(ptx)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = {f"gptq_block{' rtn' if rtn else ''}": compile_variant(rtn) for rtn in (False, True)}
    if args.json:
        print("JSON " + json.dumps(res))
    else:
        for name, r in res.items():
            print(f"{name:16s} " + "  ".join(f"{k} {v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
