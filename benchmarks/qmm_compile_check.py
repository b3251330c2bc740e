"""Compile the multi-row quantized matmul (exlpy/kernels/exl2_qmm.py) for an H100 (sm_90a) without a GPU;
report registers, spills, shared memory and the SASS instruction mix per variant (bit width, BLOCK_M).

python benchmarks/qmm_compile_check.py [--json] [--sass DIR]
Runs on any machine with Triton's bundled CUDA toolchain (no driver needed); tests/test_exl2_qmm.py asserts on
its --json output. Must run without TRITON_INTERPRET (the kernels are compiled here, not interpreted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the kernels are compiled here")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sm90_ptxas import ptxas_report  # noqa: E402
from exlpy.kernels import exl2_qmm  # noqa: E402
from exlpy.kernels.exl2_qmm_plan import CONFIG, FIELDS, SEG_FIELDS  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTRS = {"xb_ptr": "*fp16", "qw_ptr": "*i32", "sc_ptr": "*i32", "aux_ptr": "*fp32", "bg_ptr": "*i32",
        "bias_ptr": "*fp16", "res_ptr": "*fp16", "y_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
        "task_ptr": "*i64", "seg_ptr": "*i64"}
GPTQ_PTRS = {**PTRS, "sc_ptr": "*fp16", "aux_ptr": "*fp16"}
# integer arguments that are multiples of 16 at run time (Triton specializes those): row strides of x and y
DIV16 = ("stride_xm", "stride_ym", "stride_rm")


def _sass_mix(cubin: bytes) -> dict[str, int]:
    """Opcode counts of the kernel's SASS (static, whole kernel) from Triton's bundled cuobjdump."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True)
    ops: dict[str, int] = {}
    for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", r.stdout):
        op = m.group(1)
        ops[op] = ops.get(op, 0) + 1
    return ops


def compile_variant(bits: int | tuple[int, ...], bm: int, gptq: bool = False, split: bool = True,
                    sass: str | None = None, multi: bool = False) -> dict:
    """One compiled variant: `bits` one width, or a tuple of widths sharing one launch."""
    fn = exl2_qmm._qmm
    widths = sum(1 << b for b in bits) if isinstance(bits, tuple) else 1 << bits
    stages = CONFIG[f"STAGES_{bm}"] if widths & (widths - 1) == 0 else CONFIG["STAGES_MIXED"]
    consts = dict(WIDTHS=widths, GPTQ=gptq, HAS_BIAS=False, HAS_RES=True, SPLIT=split, ALIGNED=True,
                  BLOCK_M=bm, BLOCK_N=CONFIG[f"BLOCK_N_{bm}"], KB=CONFIG["KB"], NF=len(FIELDS), NS=len(SEG_FIELDS),
                  MULTI=multi, PDL=True, ASM=True)
    ptrs = GPTQ_PTRS if gptq else PTRS
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, *DIV16)}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                       options={"num_warps": CONFIG[f"WARPS_{bm}"], "num_stages": stages})
    if sass:
        os.makedirs(sass, exist_ok=True)
        tag = f"{'gptq' if gptq else 'exl2'}_b{widths}_m{bm}"
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(sass, f"{tag}.{ext}"), "w") as f:
                f.write(k.asm[ext])
    mix = _sass_mix(k.asm["cubin"])
    keep = ("HMMA", "LDG", "LDS", "LDSM", "STS", "LOP3", "SHF", "FFMA", "FMUL", "F2FP", "BAR", "IMAD", "IADD3")
    return {"shared": k.metadata.shared, **ptxas_report(k.asm["ptx"]),
            "sass": {o: sum(v for op, v in mix.items() if op.split(".")[0] == o) for o in keep},
            "sass_total": sum(mix.values()), "split_k": split_k_ops(k.asm["ptx"])}


def split_k_ops(ptx: str) -> dict[str, int]:
    """The split-K epilogue's workspace accesses in PTX: fp32 atomic adds of the partial sums and the atomic
    exchanges that take and zero them. A plain load then store of the sums instead ran on differently laid-out
    threads with no barrier under Triton 3.6 (sums zeroed before they were read); tests/test_exl2_qmm.py asserts
    that every add is matched by an exchange."""
    return {"add": len(re.findall(r"(?:atom|red)\.global\.gpu\.relaxed\.add\.f32", ptx)),
            "exch": len(re.findall(r"atom\.global\.gpu\.relaxed\.exch\.b32", ptx))}


def compile_gather(norm: bool) -> dict:
    """The x gather (act order, bit-reversed blocks, optional RMSNorm) that feeds the kernel."""
    fn = exl2_qmm._gather
    ptrs = {"x_ptr": "*fp16", "w_ptr": "*fp16", "src_ptr": "*i32", "out_ptr": "*fp16"}
    consts = dict(NORM=norm, BLOCK=exl2_qmm._GATHER_BLOCK, PDL=True)
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "fp32" if n == "eps" else "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET, options={"num_warps": 4})
    return {"shared": k.metadata.shared, **ptxas_report(k.asm["ptx"]), "sass": {"HMMA": 0}, "sass_total": 0}


def variants(sass: str | None = None) -> dict[str, dict]:
    out = {"gather": compile_gather(False), "gather norm": compile_gather(True)}
    for bits in (2, 3, 4, 5, 6, 8):
        out[f"exl2 {bits}-bit M16"] = compile_variant(bits, 16, sass=sass)
    out["exl2 8+4+3-bit M16"] = compile_variant((8, 4, 3), 16, sass=sass)
    out["exl2 8+6-bit M16 whole"] = compile_variant((8, 6), 16, split=False, multi=True, sass=sass)
    out["exl2 4-bit M32"] = compile_variant(4, 32, sass=sass)
    out["exl2 4-bit M64"] = compile_variant(4, 64, sass=sass)
    out["gptq 4-bit M16"] = compile_variant(4, 16, gptq=True, sass=sass)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sass", help="write each variant's TTGIR and PTX into this folder")
    args = ap.parse_args()
    res = variants(args.sass)
    if args.json:
        print("JSON " + json.dumps(res))
    else:
        for name, r in res.items():
            print(f"{name:20s} regs {r['regs']:4d}  spills {r['spill_bytes']:5d}  shared {r['shared']:6d}  "
                  f"sass {r['sass_total']:6d} {r['sass']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
