"""The peer all-reduce kernel compiles for an sm_90 target without a GPU (Triton's bundled ptxas), with the
system-scope release/acquire operations its cross-GPU barrier relies on. Its numerics are tested on two GPUs
(tests/test_multi_gpu.py): the interpreter runs programs one after another, so the barrier cannot run there."""

from __future__ import annotations

import re

import pytest


def test_peer_allreduce_compiles_with_system_scope_barriers() -> None:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from exlpy.kernels.peer_allreduce import BLOCK, MAX_PROGRAMS, _allreduce_kernel

    sig = {n: "*fp16" for n in ["out"] + [f"p{i}" for i in range(8)]}
    sig |= {n: "*i32" for n in [f"f{i}" for i in range(8)] + ["flags_mine", "epochs", "errors"]}
    sig |= {"numel": "i32", "rank": "i32", "spin": "i32", "N": "constexpr", "BLOCK": "constexpr",
            "PROGRAMS": "constexpr"}
    src = ASTSource(_allreduce_kernel, sig, constexprs={"N": 2, "BLOCK": BLOCK, "PROGRAMS": MAX_PROGRAMS})
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except RuntimeError as e:  # no ptxas in this triton build
        if "ptxas" in str(e).lower():
            pytest.skip(f"triton cannot compile for CUDA here: {e}")
        raise
    ptx = k.asm["ptx"]
    assert re.search(r"atom\.global\.sys\.release\.exch", ptx)  # flag stores to peers
    assert re.search(r"\.sys\.acquire", ptx)  # flag polls
    assert "bar.sync" in ptx  # all loads done before the end barrier
