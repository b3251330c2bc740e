"""The grouped MoE kernels (dense and EXL2 experts) compile for an H100 (sm_90a) without a GPU, at the tiles their
wrappers pick for decode and prefill (Mixtral and Qwen3-MoE shapes, fp16 / bf16 / fp32): no register spills,
within the shared-memory limit. Numerics are tested under the interpreter and on GPUs (test_moe_kernels_triton.py,
test_moe_exl2.py); this catches what only the compiler sees."""

from __future__ import annotations

import pytest

from tests.conftest import run_compile_check

H100_SHARED = 227 * 1024


@pytest.mark.slow
def test_moe_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    res = run_compile_check("moe_compile_check.py")
    assert {"gate_up fp16 N2 E8", "down fp16 N4096 E8", "gate_up fp16 N8 E128", "down bf16 N2 E8",
            "gate_up fp32 N2 E8", "sort E128", "route E128 k8", "combine k8", "exl2 gate_up fp16 N2 E8",
            "exl2 down fp16 N8 E128", "exl2 gate_up fp16 N256 E128 per-row", "exl2 down fp32 N2 E8",
            "exl2 gate_up fp16 N2 E8 4-bit", "exl2 down fp16 N8 E128 8-bit", "exl2 gemv gate_up fp16 4-bit",
            "exl2 gemv down fp16 4-bit", "exl2 gemv gate_up fp16 3-bit masked", "exl2 gemv act",
            "exl2 gemv gate_up fp16 mixed masked"} <= set(res)
    for name, v in res.items():
        assert 0 < v["regs"] <= 255 and v["spill_bytes"] == 0 and v["shared"] <= H100_SHARED, (name, v)
