"""The LoRA kernels compile for an H100 (sm_90a) without a GPU, at the decode and prefill settings their
wrappers pick (PDL launch included): no register spills, within the shared-memory limit. Numerics are tested
under the interpreter and on GPUs (test_lora_kernels_triton.py); this catches what only the compiler sees."""

from __future__ import annotations

import pytest

from tests.conftest import run_compile_check

H100_SHARED = 227 * 1024


@pytest.mark.slow
def test_lora_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    res = run_compile_check("lora_compile_check.py")
    assert {"shrink qkv norm fp16 M1 R16 pdl", "expand qkv fp16 M2048 R64", "expand_swiglu fp16 M32 R16",
            "expand_swiglu bf16 M1 R16", "shrink qkv norm fp32 M1 R16"} <= set(res)
    for name, v in res.items():
        assert 0 < v["regs"] <= 255 and v["spill_bytes"] == 0 and v["shared"] <= H100_SHARED, (name, v)
