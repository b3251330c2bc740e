"""Fingerprints of the MoE and all-reduce kernels' sm_90a PTX, debug information dropped (line markers, debug
sections, inlining labels): a refactor that moves code into shared @triton.jit helpers, or only reformats, must
leave every fingerprint as it was. No GPU needed (Triton's bundled toolchain); run without TRITON_INTERPRET.

    python benchmarks/ptx_fingerprint.py > before.json   # on the old commit
    python benchmarks/ptx_fingerprint.py > after.json    # on the new one; then: diff before.json after.json

The MoE cases are benchmarks/moe_compile_check.py's (the tiles the wrappers pick at decode and prefill sizes);
the all-reduce cases cover every dtype, the PTX and atomic flag paths and whole or masked tiles.
"""

from __future__ import annotations

import hashlib
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

import benchmarks.moe_compile_check as moe_check  # noqa: E402
from exlpy.kernels import host_allreduce, peer_allreduce  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def code_only(ptx: str) -> str:
    """The PTX without what only debugging reads: .loc / .file lines, comments, inlined-scope labels
    ($L__tmpN) and the debug sections at the end (they hold source line numbers)."""
    keep = [re.sub(r"\s*//.*$", "", line) for line in ptx.splitlines()
            if not re.match(r"\s*\.(loc|file)\b|\$L__tmp\d+:$", line)]
    return "\n".join(keep).split(".section")[0]


def fingerprint(fn, ptrs: dict[str, str], consts: dict, warps: int, stages: int) -> str:  # noqa: ANN001
    sig = {name: ptrs.get(name) or ("constexpr" if name in consts else "i32") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                       options={"num_warps": warps, "num_stages": stages})
    return hashlib.sha1(code_only(k.asm["ptx"]).encode()).hexdigest()[:12]


def allreduce_cases() -> dict[str, str]:
    out = {}
    for dt in ("fp16", "bf16", "fp32"):
        p = "*" + dt
        flags = {"flags": "*i32", "epochs": "*i32", "errors": "*i32"}
        for asm in (True, False):
            for even in (True, False):
                out[f"host {dt} asm{asm} even{even}"] = fingerprint(
                    host_allreduce._host_allreduce_kernel, {"x": p, "buf": p, **flags},
                    dict(N=2, BLOCK=host_allreduce.BLOCK, MAXN=host_allreduce.MAX_NUMEL, EVEN=even, ASM=asm), 4, 3)
            out[f"hostnorm {dt} asm{asm}"] = fingerprint(
                host_allreduce._host_allreduce_norm_kernel, {"x": p, "h": p, "w": p, "buf": p, **flags},
                dict(N=2, BLOCK_H=4096, MAXN=host_allreduce.NORM_MAXN, ASM=asm), 8, 3)
        ptrs = {n: p for n in ["x", "recv_mine"] + [f"r{i}" for i in range(8)]}
        ptrs |= {n: "*i32" for n in [f"f{i}" for i in range(8)] + ["flags_mine", "epochs", "errors"]}
        for n in (2, 4):
            out[f"peer {dt} N{n}"] = fingerprint(peer_allreduce._allreduce_kernel, ptrs,
                                                 dict(N=n, BLOCK=peer_allreduce.BLOCK,
                                                      MAXN=peer_allreduce.MAX_NUMEL), 4, 3)
            out[f"peernorm {dt} N{n}"] = fingerprint(peer_allreduce._allreduce_norm_kernel, {**ptrs, "h": p, "w": p},
                                                     dict(N=n, BLOCK_H=4096, MAXN=peer_allreduce.NORM_MAXN), 8, 3)
    return out


def main() -> int:
    moe_check.compile_kernel = lambda fn, ptrs, consts, warps, stages: {  # its cases, our fingerprint
        "h": fingerprint(fn, ptrs, consts, warps, stages)}
    res = {name: r["h"] for name, r in moe_check.variants().items()}
    res.update(allreduce_cases())
    print(json.dumps(res, indent=0, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
