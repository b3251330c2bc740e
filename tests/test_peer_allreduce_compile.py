"""The peer all-reduce kernel compiles for an sm_90 target without a GPU (Triton's bundled ptxas), with the
system-scope release/acquire operations its cross-GPU barrier relies on. Its numerics are tested on two GPUs
(tests/test_multi_gpu.py): the interpreter runs programs one after another, so the barrier cannot run there."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import child_env

# In a child process without TRITON_INTERPRET (set when the suite runs under it), where kernels compile.
COMPILE = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from exlpy.kernels.peer_allreduce import BLOCK, MAX_NUMEL, _allreduce_kernel
sig = {n: "*fp16" for n in ["x"] + [f"r{i}" for i in range(8)]}
sig |= {n: "*i32" for n in [f"f{i}" for i in range(8)]}
sig |= {"recv_mine": "*fp16", "flags_mine": "*i32", "epochs": "*i32", "errors": "*i32"}
sig |= {"numel": "i32", "rank": "i32", "spin": "i32", "N": "constexpr", "BLOCK": "constexpr", "MAXN": "constexpr"}
src = ASTSource(_allreduce_kernel, sig, constexprs={"N": 2, "BLOCK": BLOCK, "MAXN": MAX_NUMEL})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
print("PTX " + json.dumps(k.asm["ptx"]))
"""


def child_ptx(code: str) -> str:
    """The PTX that `code` prints as `PTX <json string>` in a child Python without TRITON_INTERPRET; skips the
    test where Triton cannot compile for CUDA. Also tests/test_host_allreduce.py's."""
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=child_env(drop=("TRITON_INTERPRET",)), timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PTX ")]
    if not lines and "ptxas" in r.stderr.lower():
        pytest.skip(f"triton cannot compile for CUDA here: {r.stderr[-300:]}")
    assert lines, r.stderr[-2000:]
    return json.loads(lines[0][4:])


def test_peer_allreduce_compiles_with_system_scope_flags() -> None:
    ptx = child_ptx(COMPILE)
    assert re.search(r"atom\.global\.sys\.release\.exch", ptx)  # flag stores to peers
    assert re.search(r"\.sys\.acquire", ptx)  # flag polls
    assert ptx.count("bar.sync") >= 2  # stores issued before the flags; received tiles read after the wait
    assert re.search(r"ld\.global\.cg", ptx)  # received tiles bypass L1 (peers wrote them)
