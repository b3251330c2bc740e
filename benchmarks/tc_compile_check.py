"""Compile the tensor-core dequant GEMM (exlpy/kernels/exl2_tc.py) for an H100 (sm_90a) without a GPU: registers,
spills, shared memory, and the SASS of its K loop per variant (bit width, BLOCK_M class 16-256, orientation,
prefetch, the row tile past 64 rows):
instructions per packed weight and per thread, and the opcode mix inside the loop.

python benchmarks/tc_compile_check.py [--json] [--sass DIR] [--all]
Runs on any machine with Triton's bundled CUDA toolchain (no driver needed); tests/test_exl2_tc.py asserts on its
--json output. Must run without TRITON_INTERPRET (the kernels are compiled here, not interpreted). --all adds
the launch-table alternatives (SWAP 0/1, PREFETCH 0/1, BLOCK_N 64/128, KB 2/4) of 4-bit M16.
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
from exlpy.kernels import exl2_tc  # noqa: E402
from exlpy.kernels.exl2_tc_plan import CONFIG, FIELDS, NARROW_ROWS, tile_m  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTRS = {"x_ptr": "*fp16", "qw_ptr": "*i32", "sc_ptr": "*i32", "aux_ptr": "*fp32", "bias_ptr": "*fp16",
        "res_ptr": "*fp16", "y_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "task_ptr": "*i64",
        "range_ptr": "*i32"}
GPTQ_PTRS = {**PTRS, "sc_ptr": "*fp16", "aux_ptr": "*fp16"}
DIV16 = ("xs", "ys", "rs", "n_total")  # row strides (multiples of 16 at run time: Triton specializes those)


def _sass(cubin: bytes) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)([^;]*);")


def loop_mix(sass: str) -> tuple[int, dict[str, int]]:
    """(instructions, opcode counts) of the largest loop: the span from a backward branch's target to it."""
    ins = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _INSTR.finditer(sass)]
    best: tuple[int, int] = (0, -1)
    for i, (addr, op, rest) in enumerate(ins):
        if op != "BRA":
            continue
        t = re.search(r"0x([0-9a-f]+)", rest)
        if t and int(t.group(1), 16) < addr:
            lo = next(j for j, x in enumerate(ins) if x[0] >= int(t.group(1), 16))
            if i - lo > best[1] - best[0]:
                best = (lo, i)
    mix: dict[str, int] = {}
    for _, op, _ in ins[best[0]:best[1] + 1]:
        mix[op] = mix.get(op, 0) + 1
    return best[1] - best[0] + 1, mix


def compile_variant(bits: int | tuple[int, ...], bm: int, gptq: bool = False, split: bool = True,
                    sass: str | None = None, **over: int) -> dict:
    """One compiled variant: `bits` one width, or a tuple of widths sharing one launch; `over`: launch-table
    overrides (BLOCK_N, WARPS, KB, SWAP, PREFETCH, STAGES, MAXNREG)."""
    c = {**CONFIG[bm], **over}
    tile = tile_m(c, bm)  # past 64 rows the program's rows (the rest are row tiles on the grid)
    fn = exl2_tc._tc
    ws = bits if isinstance(bits, tuple) else (bits,)
    consts = dict(WIDTHS=sum(1 << b for b in ws), KBS=sum(c["KB"] << (5 * (b - 2)) for b in ws), GPTQ=gptq,
                  HAS_BIAS=False, HAS_RES=True, SPLIT=split, ALIGNED=True, BLOCK_M=tile, BLOCK_N=c["BLOCK_N"],
                  NF=len(FIELDS), SWAP=bool(c["SWAP"]), PREFETCH=bool(c["PREFETCH"]), FOLD=bool(c["FOLD"]),
                  HALF=bool(c["HALF"]), PERSIST=bool(c["GRID"]), PDL=True, ASM=True, TILED=bm > NARROW_ROWS)
    ptrs = GPTQ_PTRS if gptq else PTRS
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, *DIV16)}
    opts = {"num_warps": c["WARPS"], "num_stages": c["STAGES"]}
    if c["MAXNREG"]:
        opts["maxnreg"] = c["MAXNREG"]
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET, options=opts)
    text = _sass(k.asm["cubin"])
    if sass:
        os.makedirs(sass, exist_ok=True)
        tag = f"{'gptq' if gptq else 'exl2'}_{'+'.join(map(str, ws))}_m{bm}_" + "_".join(
            f"{a}{b}" for a, b in sorted(over.items()))
        for ext, body in (("ttgir", k.asm["ttgir"]), ("ptx", k.asm["ptx"]), ("sass", text)):
            with open(os.path.join(sass, f"{tag}.{ext}"), "w") as f:
                f.write(body)
    n_loop, mix = loop_mix(text)
    weights = c["KB"] * 32 * c["BLOCK_N"] / (32 * c["WARPS"])  # packed weights per thread and K step
    keep = ("HMMA", "HGMMA", "LDG", "LDS", "LDSM", "STS", "LOP3", "SHF", "FFMA", "FADD", "FMUL", "F2FP", "BAR",
            "IMAD", "PRMT", "SHFL", "LEA", "STL", "LDL")  # STL / LDL: spills inside the K loop
    return {"shared": k.metadata.shared, **ptxas_report(k.asm["ptx"]), "loop_instr": n_loop,
            "instr_per_weight": round(n_loop / weights, 2) if len(ws) == 1 else None,
            "loop": {o: mix.get(o, 0) for o in keep}, "split_k": split_k_ops(k.asm["ptx"])}


def split_k_ops(ptx: str) -> dict[str, int]:
    """The split-K epilogue's workspace atomics: every fp32 add must be matched by an exchange that takes it."""
    return {"add": len(re.findall(r"(?:atom|red)\.global\.gpu\.relaxed\.add\.f32", ptx)),
            "exch": len(re.findall(r"atom\.global\.gpu\.relaxed\.exch\.b32", ptx))}


def _table(every: bool) -> dict[str, tuple[tuple, dict]]:
    """Variant name -> compile_variant's (args, keyword args)."""
    out: dict[str, tuple[tuple, dict]] = {f"exl2 {b}-bit M16": ((b, 16), {}) for b in (2, 3, 4, 5, 6, 8)}
    out["exl2 8+4+3-bit M16"] = (((8, 4, 3), 16), {})
    out["exl2 4-bit M16 whole"] = ((4, 16), {"split": False})
    out["exl2 4-bit M32"] = ((4, 32), {})
    out["exl2 4-bit M64"] = ((4, 64), {})
    out["exl2 4-bit M16 persistent"] = ((4, 16), {"GRID": 2})
    for bm in (16, 32, 64):
        out[f"exl2 4-bit M{bm} half"] = ((4, bm), {"HALF": 1})
    out["exl2 8+4+3-bit M16 half"] = (((8, 4, 3), 16), {"HALF": 1})
    out["exl2 8-bit M16 half"] = ((8, 16), {"HALF": 1})
    out["gptq 4-bit M16 half"] = ((4, 16), {"gptq": True, "HALF": 1})
    out["gptq 4-bit M16"] = ((4, 16), {"gptq": True})
    # 65-256 rows (prompt chunks): the default row tile (one dot over 128 rows), a mixed launch, GPTQ, and 64-row
    # tiles (the register-light alternative)
    for bm in (128, 256):
        out[f"exl2 4-bit M{bm}"] = ((4, bm), {})
    out["exl2 8+4+3-bit M256"] = (((8, 4, 3), 256), {})
    out["gptq 4-bit M256"] = ((4, 256), {"gptq": True})
    out["exl2 4-bit M256 tile64"] = ((4, 256), {"TILE_M": 64})
    if every:  # other row tiles and tile shapes (tc_compile_check --all --only tile)
        for bn, warps, kb in ((128, 8, 2), (64, 4, 2), (64, 8, 2)):
            out[f"exl2 4-bit M128 tile128 BN{bn} W{warps} KB{kb}"] = ((4, 128), {"TILE_M": 128, "BLOCK_N": bn,
                                                                            "WARPS": warps, "KB": kb})
        out["exl2 4-bit M256 tile256 BN128 W8 KB2"] = ((4, 256), {"TILE_M": 256, "BLOCK_N": 128, "WARPS": 8,
                                                                   "KB": 2})
        out["exl2 4-bit M256 tile64 BN64 W4"] = ((4, 256), {"TILE_M": 64, "BLOCK_N": 64, "WARPS": 4})
        out["exl2 4-bit M256 tile64 KB2"] = ((4, 256), {"TILE_M": 64, "KB": 2})
        for bm in (32, 64):
            for bn in (64, 128):
                for kb in (2, 4):
                    for fold in (0, 1):
                        out[f"exl2 4-bit M{bm} BN{bn} KB{kb} FOLD{fold}"] = ((4, bm), {"BLOCK_N": bn, "KB": kb,
                                                                                      "FOLD": fold})
        for swap in (0, 1):
            for pre in (0, 1):
                for bn in (64, 128):
                    for kb in (2, 4):
                        out[f"exl2 4-bit M16 SWAP{swap} PREFETCH{pre} BN{bn} KB{kb}"] = (
                            (4, 16), {"SWAP": swap, "PREFETCH": pre, "BLOCK_N": bn, "KB": kb})
    return out


def variants(sass: str | None = None, every: bool = False, only: str | None = None) -> dict[str, dict]:
    return {name: compile_variant(*a, sass=sass, **kw) for name, (a, kw) in _table(every).items()
            if not only or only in name}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sass", help="write each variant's TTGIR, PTX and SASS into this folder")
    ap.add_argument("--all", action="store_true", help="also the launch-table alternatives of 4-bit M16")
    ap.add_argument("--only", help="only variants whose name contains this")
    args = ap.parse_args()
    res = variants(args.sass, args.all, args.only)
    if args.json:
        print("JSON " + json.dumps(res))
    else:
        print(f"triton {triton.__version__}")
        for name, r in res.items():
            print(f"{name:44s} regs {r['regs']:4d} spills {r['spill_bytes']:4d} shared {r['shared']:6d} "
                  f"loop {r['loop_instr']:5d} per weight {r['instr_per_weight']} {r['loop']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
