"""Compile the attention kernels for an H100 (sm_90a) without a GPU and report what ptxas makes of them.

python benchmarks/flash_compile_check.py [--json] [--config BM,BN,warps,stages --head-dim 128]
For each variant the launch tables select (prefill per head_dim, decode over fp16 and quantized caches, the
quantized K/V store): registers per thread, spill bytes, shared memory, and whether the main loops became
Hopper wgmma with cp.async pipelining. Runs on any machine with Triton's bundled CUDA toolchain (no driver
needed), so launch parameters can be screened for spills before a GPU run; tests/test_attention_compile.py
asserts on its --json output. Must run without TRITON_INTERPRET (kernels are compiled, not interpreted).
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
from exlpy.kernels import flash_attention as fa  # noqa: E402
from exlpy.kernels import flash_kernel as fk  # noqa: E402
from exlpy.kernels import quant_kv_store as qs  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
ALIGNED_ARGS = ("q_bstride", "q_tstride", "k_row_stride", "v_row_stride", "page_size", "new_tstride",
                "new_bstride", "k_tok_stride", "v_tok_stride", "kc_row_stride", "vc_row_stride")


def _signature(fn, ptrs: dict[str, str], consts: dict) -> tuple[dict, dict]:
    sig = {}
    for name in fn.arg_names:
        if name in ptrs:
            sig[name] = ptrs[name]
        elif name in consts:
            sig[name] = "constexpr"
        elif name in ("qk_scale", "cap_in", "cap_out"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    # Pointers and the strides of dense tensors are 16-aligned at launch: Triton specializes on that.
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if (n in ptrs and ptrs[n].startswith("*")) or n in ALIGNED_ARGS}
    return sig, attrs


def compile_flash(dt: str, D: int, G: int, cfg: tuple[int, int, int, int], k_fmt: int = fa.PLAIN,
                  k_bits: int = 16, v_fmt: int = fa.PLAIN, v_bits: int = 16, split: bool = False,
                  has_new: bool = False, paging: int = 1, tma: bool = False, limits: bool = False) -> dict:
    bm, bn, warps, stages = cfg
    vals = {fa.PLAIN: "*" + dt, fa.INT: "*u8", fa.FP8: "*u8"}
    scales = {fa.PLAIN: "*" + dt, fa.INT: "*fp16", fa.FP8: "*u8"}
    ptrs = {"q_ptr": "*" + dt, "kc_ptr": vals[k_fmt], "vc_ptr": vals[v_fmt], "ks_ptr": scales[k_fmt],
            "vs_ptr": scales[v_fmt], "bt_ptr": "*i32", "seqlen_ptr": "*i32", "pos_ptr": "*i64", "lim_ptr": "*i64",
            "mask_ptr": "*u8",
            "out_ptr": "*" + dt, "part_ptr": "*fp32", "lse_ptr": "*fp32", "kn_ptr": "*" + dt, "vn_ptr": "*" + dt,
            "k_desc": f"tensordesc<{dt}[{bn}, {D}]>" if tma else "*" + dt,
            "v_desc": f"tensordesc<{dt}[{bn}, {D}]>" if tma else "*" + dt}
    consts = dict(G=G, D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=D, SPLIT=split, K_FMT=k_fmt, K_BITS=k_bits,
                  V_FMT=v_fmt, V_BITS=v_bits, PAGING=paging, GROUP_PAGES=fa.GROUP_PAGES, USE_TMA=tma,
                  HAS_MASK=False, HAS_NEW=has_new, PREC="tf32", WINDOW=False, SOFTCAP=False,
                  HAS_LIMITS=limits)
    sig, attrs = _signature(fk._flash_kernel, ptrs, consts)
    k = triton.compile(ASTSource(fk._flash_kernel, sig, consts, attrs), target=TARGET,
                       options=dict(num_warps=warps, num_stages=stages))
    ptx = k.asm["ptx"]
    # Tiles in flight while one is consumed: the largest `num` of the loops' cp.async waits (0 = no overlap), or
    # for TMA copies the ring of K/V buffers less the one being read.
    ir = k.asm["ttgir"]
    waits = [int(x) for x in re.findall(r"async_wait[^{\n]*\{num = (\d+)", ir)]
    if "async_tma_copy" in ir:
        waits += [int(x) - 1 for x in re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x{bn}x{D}x", ir)]
    return {"shared": k.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), "in_flight": max(waits, default=0),
            **ptxas_report(ptx)}


def compile_store(k_fmt: int, k_bits: int, v_fmt: int, v_bits: int, E: int = 1024) -> dict:
    ptrs = {"k_ptr": "*fp16", "v_ptr": "*fp16", "slot_ptr": "*i64", "kc_ptr": "*u8", "vc_ptr": "*u8",
            "ks_ptr": "*fp16" if k_fmt == fa.INT else "*u8", "vs_ptr": "*fp16" if v_fmt == fa.INT else "*u8"}
    consts = dict(NG=E // 32, BLOCK_G=max(16, E // 32), K_FMT=k_fmt, K_BITS=k_bits, V_FMT=v_fmt, V_BITS=v_bits)
    sig, attrs = _signature(qs._quant_store_kernel, ptrs, consts)
    k = triton.compile(ASTSource(qs._quant_store_kernel, sig, consts, attrs), target=TARGET,
                       options=dict(num_warps=4))
    return {"shared": k.metadata.shared, **ptxas_report(k.asm["ptx"])}


def variants() -> dict[str, dict]:
    """The variants the launch tables select for the 8B shape (and head_dim 64)."""
    out = {}
    for d, cfg in fa.PREFILL_CONFIGS.items():
        if d <= 128:
            out[f"prefill fp16 D{d} contiguous {cfg}"] = compile_flash("fp16", d, 4, cfg, paging=0)
            out[f"prefill fp16 D{d} paged {cfg}"] = compile_flash("fp16", d, 4, cfg, paging=1)
            out[f"prefill fp16 D{d} paged TMA {cfg}"] = compile_flash("fp16", d, 4, cfg, paging=1, tma=True)
    cfg = fa.PREFILL_CONFIGS[128]  # Gemma 3's chunks with images: per-query key limits (exlpy/vision/attention.py)
    out[f"prefill fp16 D128 paged limits {cfg}"] = compile_flash("fp16", 128, 4, cfg, paging=1, limits=True)
    bn, w, st = fa.DECODE_CONFIGS["plain"]
    out[f"verify fp16 D128 split {(16, bn, w, st)}"] = compile_flash("fp16", 128, 4, (16, bn, w, st), split=True)
    bn, w, st = fa.DECODE_CONFIGS["quant"]
    cfg = (16, bn, w, st)
    out[f"decode Q4 D128 split+fresh {cfg}"] = compile_flash("fp16", 128, 4, cfg, fa.INT, 4, fa.INT, 4, True, True)
    out[f"decode Q6 D128 split+fresh {cfg}"] = compile_flash("fp16", 128, 4, cfg, fa.INT, 8, fa.INT, 4, True, True)
    out[f"decode FP8 D128 split+fresh {cfg}"] = compile_flash("fp16", 128, 4, cfg, fa.FP8, 8, fa.FP8, 8, True,
                                                              True)
    cfg = fa.QUANT_PREFILL_CONFIGS[128]
    out[f"prefill Q4 D128 paged+fresh {cfg}"] = compile_flash("fp16", 128, 4, cfg, fa.INT, 4, fa.INT, 4, False,
                                                             True)
    out["store Q4"] = compile_store(fa.INT, 4, fa.INT, 4)
    out["store Q6"] = compile_store(fa.INT, 8, fa.INT, 4)
    out["store FP8"] = compile_store(fa.FP8, 8, fa.FP8, 8)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--config", default="", help="BM,BN,warps,stages: compile this prefill setting only")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    if args.config:
        cfg = tuple(int(x) for x in args.config.split(","))
        res = {f"prefill fp16 D{args.head_dim} {p}{' TMA' if t else ''} {cfg}":
               compile_flash("fp16", args.head_dim, 4, cfg, paging=i, tma=t)
               for i, p in enumerate(("contiguous", "paged")) for t in (False, True)}
    else:
        res = variants()
    if args.json:
        print("JSON " + json.dumps(res))
    else:
        for name, r in res.items():
            print(f"{name:48s} " + "  ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
