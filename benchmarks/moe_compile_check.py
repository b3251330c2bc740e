"""Compile the grouped MoE kernels (exlpy/kernels/moe.py, and moe_exl2.py / moe_exl2_gemv.py for EXL2 experts)
for an H100 (sm_90a) without a GPU; report registers, spills and shared memory for the tiles the wrappers pick at
decode and prefill sizes (Mixtral-8x7B, Qwen3-MoE).

python benchmarks/moe_compile_check.py [--json]
Runs on any machine with Triton's bundled CUDA toolchain (no driver needed); tests/test_moe_compile.py asserts on
its --json output. Must run without TRITON_INTERPRET (the kernels are compiled here, not interpreted).
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

from benchmarks.sm90_ptxas import compile_parallel, ptxas_report  # noqa: E402
from exlpy.kernels import moe, moe_exl2, moe_exl2_gemv  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, ptrs: dict[str, str], consts: dict, warps: int, stages: int) -> dict:
    sig = {name: ptrs.get(name) or ("constexpr" if name in consts else "i32") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                       options={"num_warps": warps, "num_stages": stages})
    return {"shared": k.metadata.shared, **ptxas_report(k.asm["ptx"])}


def variants() -> dict[str, dict]:
    """(pairs N, experts E) of decode at batch 1 and 32 and of a prefill chunk; fp16, bf16 and fp32 at decode."""
    cases = [("fp16", 2, 8), ("fp16", 64, 8), ("fp16", 256, 8), ("fp16", 4096, 8), ("fp16", 8, 128),
             ("fp16", 256, 128), ("bf16", 2, 8), ("fp32", 2, 8), ("fp32", 4096, 8)]
    out: dict[str, tuple] = {}
    for dt, n, e in cases:
        p = "*" + dt
        # output widths of Mixtral's / Qwen3-MoE's gate|up on an H100 (132 SMs): the narrowest column tiles
        bm, bn, bk, warps, _ = moe.plan(n, e, 4 if dt == "fp32" else 2, 14336 if e == 8 else 768, 132)
        common = dict(E_P2=triton.next_power_of_2(e), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=dt == "fp32")
        tag = f"{dt} N{n} E{e}"
        out[f"gate_up {tag}"] = (compile_kernel, moe._gate_up_kernel, {
            "x_ptr": p, "order_ptr": "*i64", "counts_ptr": "*i32", "w_ptr": p, "out_ptr": p}, dict(
            ACT=0, **common), warps, moe.STAGES)
        out[f"down {tag}"] = (compile_kernel, moe._down_kernel, {
            "a_ptr": p, "order_ptr": "*i64", "counts_ptr": "*i32", "w_ptr": p, "y_ptr": p}, common, warps,
            moe.STAGES)
    # aligned: the 32-row block path (width 0: mixed, gathered per row; 4 / 8: one width, words loaded once)
    for dt, n, e, aligned, width in [("fp16", 2, 8, True, 0), ("fp16", 64, 8, True, 0), ("fp16", 4096, 8, True, 0),
                                     ("fp16", 8, 128, True, 0), ("fp16", 256, 128, True, 0),
                                     ("bf16", 8, 128, True, 0), ("fp32", 2, 8, True, 0), ("fp16", 2, 8, True, 4),
                                     ("fp16", 4096, 8, True, 4), ("fp16", 8, 128, True, 4), ("fp16", 256, 128, True, 4),
                                     ("fp16", 8, 128, True, 8), ("fp32", 2, 8, True, 4), ("fp16", 2, 8, False, 0),
                                     ("fp16", 256, 128, False, 0), ("fp32", 2, 8, False, 0)]:
        p = "*" + dt
        bm, bn, warps, _ = moe_exl2._tiles(n, e, 14336 if e == 8 else 768, 132, 4 if dt == "fp32" else 2)
        common = dict(E_P2=triton.next_power_of_2(e), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=moe_exl2.BLOCK_K,
                      IEEE=dt == "fp32", ALIGNED=aligned, UNROLL=moe_exl2._unroll(bm, width, 4 if dt == "fp32" else 2))
        kind = f" {width}-bit" if width else "" if aligned else " per-row"
        tables = {f"{w}_{t}": typ for w in ("g", "u") for t, typ in (("qw", "*i32"), ("sc", "*i32"), ("sm", "*fp32"),
                                                                    ("perm", "*i32"), ("word", "*i32"),
                                                                    ("info", "*i32"))}
        tag = f"{dt} N{n} E{e}{kind}"
        out[f"exl2 gate_up {tag}"] = (compile_kernel, moe_exl2._gate_up_exl2_kernel, {
            "x_ptr": p, "order_ptr": "*i64", "counts_ptr": "*i32", "out_ptr": p, **tables}, dict(
            ACT=0, SAME_PERM=True, G_WIDTH=width, U_WIDTH=width, **common), warps, moe_exl2.STAGES)
        out[f"exl2 down {tag}"] = (compile_kernel, moe_exl2._down_exl2_kernel, {
            "a_ptr": p, "order_ptr": "*i64", "counts_ptr": "*i32", "qw": "*i32", "sc": "*i32", "sm": "*fp32",
            "perm_ptr": "*i32", "word_ptr": "*i32", "info_ptr": "*i32", "y_ptr": p}, dict(WIDTH=width, **common),
            warps, moe_exl2.STAGES)
    # few rows per expert: the GEMV kernels, every width they take, K whole steps (even) or not, gate and up with
    # one act order or two; 256-column programs (Qwen3-MoE's 768-wide gate|up: 2 columns a thread)
    gemv_tables = {f"{w}_{t}": typ for w in ("g", "u") for t, typ in (("qw", "*i32"), ("sc", "*i32"),
                                                                      ("sm", "*fp32"), ("perm", "*i32"),
                                                                      ("word", "*i32"), ("info", "*i32"))}
    cols, warps = moe_exl2_gemv.GEMV_COLS, moe_exl2_gemv.GEMV_WARPS
    for width in moe_exl2_gemv.GEMV_WIDTHS:
        for even in (True, False):
            nb_gu, nb_dn = moe_exl2_gemv.GEMV_NB[2, even][width], moe_exl2_gemv.GEMV_NB[1, even][width]
            cases = [("fp16", True, cols, warps)]
            if width == 4:
                cases += [("fp16", False, cols, warps), ("bf16", True, cols, warps), ("fp16", True, cols // 2, warps)]
            for dt, same, bn, w in cases:
                tag = f"{dt} {width}-bit{'' if even else ' masked'}{'' if same else ' two perms'}" + (
                    f" {bn} columns" if bn != cols else "")
                out[f"exl2 gemv gate_up {tag}"] = (compile_kernel,
                    moe_exl2_gemv._gate_up_gemv_kernel, {"x_ptr": "*" + dt, "order_ptr": "*i64", "counts_ptr": "*i32",
                                                    "ws_ptr": "*fp32", **gemv_tables},
                    dict(E_P2=8, BLOCK_N=bn, B=width, NB=nb_gu, SAME_PERM=same, EVEN=even), w, 1)
            out[f"exl2 gemv down fp16 {width}-bit{'' if even else ' masked'}"] = (compile_kernel,
                moe_exl2_gemv._down_gemv_kernel, {"a_ptr": "*fp16", "order_ptr": "*i64", "counts_ptr": "*i32",
                                             "qw": "*i32", "sc": "*i32", "sm": "*fp32", "perm_ptr": "*i32",
                                             "word_ptr": "*i32", "info_ptr": "*i32", "ws_ptr": "*fp32"},
                dict(E_P2=8, BLOCK_N=cols, B=width, NB=nb_dn, EVEN=even), warps, 1)
    # mixed widths: each block's width chosen at run time, one block per step, always masked (moe_exl2_gemv.gemv_nb)
    out["exl2 gemv gate_up fp16 mixed masked"] = (compile_kernel,
        moe_exl2_gemv._gate_up_gemv_kernel, {"x_ptr": "*fp16", "order_ptr": "*i64", "counts_ptr": "*i32",
                                        "ws_ptr": "*fp32", **gemv_tables},
        dict(E_P2=8, BLOCK_N=cols, B=0, NB=1, SAME_PERM=True, EVEN=False), warps, 1)
    out["exl2 gemv down fp16 mixed masked"] = (compile_kernel,
        moe_exl2_gemv._down_gemv_kernel, {"a_ptr": "*fp16", "order_ptr": "*i64", "counts_ptr": "*i32", "qw": "*i32",
                                     "sc": "*i32", "sm": "*fp32", "perm_ptr": "*i32", "word_ptr": "*i32",
                                     "info_ptr": "*i32", "ws_ptr": "*fp32"},
        dict(E_P2=8, BLOCK_N=cols, B=0, NB=1, EVEN=False), warps, 1)
    out["exl2 gemv act"] = (compile_kernel, moe_exl2_gemv._act_kernel, {"ws_ptr": "*fp32", "out_ptr": "*fp16"},
                                          dict(ACT=0, BLOCK=1024), 4, 1)
    out["exl2 gemv convert"] = (compile_kernel, moe_exl2_gemv._convert_kernel, {"ws_ptr": "*fp32", "y_ptr": "*fp16"},
                                              dict(BLOCK=1024), 4, 1)
    for e, k in ((8, 2), (128, 8)):
        e_p2 = triton.next_power_of_2(e)
        out[f"route E{e} k{k}"] = (compile_kernel, moe._route_kernel, {"logits_ptr": "*fp16", "w_ptr": "*fp16",
                                                                     "ids_ptr": "*i64"},
                                                 dict(K=k, K_P2=k, E_P2=e_p2, NORM=1), 1, 3)
        out[f"combine k{k}"] = (compile_kernel, moe._combine_kernel, {"y_ptr": "*fp16", "w_ptr": "*fp16",
                                                                    "res_ptr": "*fp16", "out_ptr": "*fp16"},
                                              dict(K=k, HAS_RES=True, BLOCK=1024), 4, 3)
        out[f"sort E{e}"] = (compile_kernel, moe._sort_kernel, {"ids_ptr": "*i64", "order_ptr": "*i64",
                                                              "counts_ptr": "*i32"},
                                           dict(E_P2=e_p2, CHUNK=max(16, 8192 // e_p2)), 4, 3)
    return compile_parallel(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = variants()
    if args.json:
        print("JSON " + json.dumps(res))
    else:
        for name, r in res.items():
            print(f"{name:28s} regs {r['regs']:4d}  spills {r['spill_bytes']:5d}  shared {r['shared']:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
