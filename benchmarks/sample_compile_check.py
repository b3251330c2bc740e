"""Compile the sampling kernels (exlpy/kernels/sample_top.py, sample_whole.py) for an H100 (sm_90a) without a
GPU; report registers, spills and shared memory at the launch settings the wrapper picks for a Llama-3 vocabulary.

python benchmarks/sample_compile_check.py [--json]
Runs on any machine with Triton's bundled CUDA toolchain (no driver needed); tests/test_graph_sampler.py asserts
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
from exlpy.generator.sampling.graphed import K_MAX  # noqa: E402
from exlpy.kernels import sample_top as st  # noqa: E402
from exlpy.kernels import sample_whole as sw  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, ptrs: dict[str, str], consts: dict, warps: int) -> dict:
    sig = {name: ptrs.get(name) or ("constexpr" if name in consts else "i32") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET, options={"num_warps": warps})
    return {"shared": k.metadata.shared, **ptxas_report(k.asm["ptx"])}


def variants() -> dict[str, dict]:
    out = {}
    for vocab in (128256, 32000, 256):
        ch, nch, kc, k = st.plan(vocab, K_MAX)
        out[f"chunk V{vocab}"] = compile_kernel(st._chunk_kernel, {
            "x_ptr": "*fp32", "params_ptr": "*fp32", "keys_ptr": "*i64", "stats_ptr": "*fp32"},
            dict(CH=ch, KC=kc, NP=st.NPARAM), 8 if ch >= 2048 else 4)
        for cand in (False, True):
            out[f"select V{vocab}{' cand' if cand else ''}"] = compile_kernel(st._select_kernel, {
                "keys_ptr": "*i64", "stats_ptr": "*fp32", "params_ptr": "*fp32", "rng_ptr": "*i64",
                "tok_ptr": "*i64", "prob_ptr": "*fp32", "info_ptr": "*fp32", "cq_ptr": "*fp32", "cid_ptr": "*i64"},
                dict(NCH=nch, KC=kc, K=k, NP=st.NPARAM, CAND=cand), 4)
    out["full"] = compile_kernel(st._full_kernel, {
        "x_ptr": "*fp32", "params_ptr": "*fp32", "info_ptr": "*fp32", "idx_ptr": "*i32", "tok_ptr": "*i64",
        "prob_ptr": "*fp32"}, dict(NP=st.NPARAM, BLOCK=st.FULL_BLOCK), 8)
    out.update(whole_variants(128256))
    return out


def whole_variants(vocab: int) -> dict[str, dict]:
    """sample_whole.py's kernels at the launch settings `finish` picks."""
    ch, nch = sw.plan(vocab)
    state = {"params_ptr": "*fp32", "info_ptr": "*fp32", "st_ptr": "*fp32", "edges_ptr": "*fp32", "pm_ptr": "*fp32",
             "pc_ptr": "*i32"}
    out = {}
    for p in range(sw.PASSES):
        out[f"whole pass {p}"] = compile_kernel(sw._pass_kernel, {"x_ptr": "*fp32", **state}, dict(
            P=p, LAST=sw.PASSES - 1, NC=nch, CH=ch, SB=min(sw.SUB, ch), T=sw.EDGES, NP=st.NPARAM), 4)
    capn = triton.next_power_of_2(max(sw.CAP, 1))
    out["whole resolve"] = compile_kernel(sw._resolve_kernel, {
        "x_ptr": "*fp32", **state, "keys_ptr": "*i64", "cut_ptr": "*i64", "thr_ptr": "*fp32"},
        dict(P=sw.PASSES, NC=nch, CH=ch, T=sw.EDGES, CAPN=capn, NP=st.NPARAM), 8)
    draw = {"x_ptr": "*fp32", "params_ptr": "*fp32", "info_ptr": "*fp32", "cut_ptr": "*i64", "thr_ptr": "*fp32",
            "cm_ptr": "*fp32"}
    sb = min(sw.DRAW_BLOCK, ch)
    out["whole mass"] = compile_kernel(sw._mass_kernel, draw, dict(NC=nch, CH=ch, SB=sb, NP=st.NPARAM), 4)
    out["whole draw"] = compile_kernel(sw._draw_kernel, {**draw, "tok_ptr": "*i64", "prob_ptr": "*fp32"},
                                       dict(NC=nch, CH=ch, SB=sb, NP=st.NPARAM), 8)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    res = variants()
    if ap.parse_args().json:
        print("JSON " + json.dumps(res))
    else:
        for name, v in res.items():
            print(f"{name:20s} regs {v['regs']:4d}  spill {v['spill_bytes']:6d} B  shared {v['shared']:7d} B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
