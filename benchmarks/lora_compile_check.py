"""Compile the LoRA kernels (exlpy/kernels/lora.py) for an H100 (sm_90a) without a GPU; report registers,
spills and shared memory for the launch settings the wrappers pick at decode and prefill sizes.

python benchmarks/lora_compile_check.py [--json]
Runs on any machine with Triton's bundled CUDA toolchain (no driver needed); tests/test_lora_compile.py asserts
on its --json output. Must run without TRITON_INTERPRET (the kernels are compiled here, not interpreted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the kernels are compiled here")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sm90_ptxas import ptxas_report  # noqa: E402
from exlpy.kernels import lora  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
FLOATS = ("eps",)


def compile_kernel(fn, ptrs: dict[str, str], consts: dict, warps: int) -> dict:
    sig = {}
    for name in fn.arg_names:
        sig[name] = ptrs.get(name) or ("constexpr" if name in consts else "fp32" if name in FLOATS else "i32")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET, options={"num_warps": warps})
    return {"shared": k.metadata.shared, **ptxas_report(k.asm["ptx"])}


def variants(with_pdl: bool = True) -> dict[str, dict]:
    """fp16 at decode (1 and 32 tokens, PDL on and off) and prefill sizes; bf16 and fp32 (exact dots) at decode."""
    cases = [("fp16", 1, 16, False), ("fp16", 32, 16, False), ("fp16", 2048, 64, False), ("bf16", 1, 16, False),
             ("fp32", 1, 16, False)]
    if with_pdl:
        cases.append(("fp16", 1, 16, True))
    out = {}
    for dt, m, R, pdl in cases:
        p = "*" + dt
        shrink_ptrs = {"x_ptr": p, "nw_ptr": p, "a_ptr": p, "ranks_ptr": "*i32", "adapters_ptr": "*i64",
                       "out_ptr": "*fp32"}
        expand_ptrs = {"y_ptr": p, "u_ptr": "*fp32", "b_ptr": p, "ranks_ptr": "*i32", "adapters_ptr": "*i64"}
        swiglu_ptrs = {"gu_ptr": p, "act_ptr": p, "u_ptr": "*fp32", "b_ptr": p, "ranks_ptr": "*i32",
                       "adapters_ptr": "*i64", "da_ptr": p, "dranks_ptr": "*i32", "dout_ptr": "*fp32"}
        bm, br, bk, _, _ = lora.shrink_config(m, 4096, 3, R)
        tag = f"{dt} M{m} R{R}{' pdl' if pdl else ''}"
        warps = lora._warps(bm)
        _, by_row, rows_p2 = lora.slot_groups(m, 8)  # rows = tokens here (decode: one token per row)
        common = dict(R=R, IEEE=dt == "fp32", BLOCK_M=bm, BLOCK_R=br, PDL=pdl, BY_ROW=by_row, ROWS_P2=rows_p2)
        out[f"shrink qkv norm {tag}"] = compile_kernel(lora._shrink_kernel, shrink_ptrs, dict(
            P=3, HAS_NORM=True, BLOCK_K=bk, **common), warps)
        out[f"expand qkv {tag}"] = compile_kernel(lora._expand_kernel, expand_ptrs, dict(
            P=3, BLOCK_N=lora.expand_block_n(m), SB=lora._sb(bm, br), **common), warps)
        fused = m <= lora._DOWN_FUSED_MAX_TOKENS
        nbytes = 4 if dt == "fp32" else 2
        bn = lora.expand_block_n(m, fused, nbytes)
        out[f"expand_swiglu {tag}"] = compile_kernel(lora._expand_swiglu_kernel, swiglu_ptrs, dict(
            R2=R, DOWN=fused, BLOCK_N=bn, BLOCK_R2=br, SB=lora._sb(bm, br), **common), lora._warps(bm, bn, nbytes))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-pdl", action="store_true", help="skip the programmatic-dependent-launch variants")
    args = ap.parse_args()
    res = variants(with_pdl=not args.no_pdl)
    if args.json:
        print("JSON " + json.dumps(res))
    else:
        for name, r in res.items():
            print(f"{name:40s} regs {r['regs']:4d}  spills {r['spill_bytes']:5d}  shared {r['shared']:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
