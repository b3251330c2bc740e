"""The attention kernels compile for an H100 (sm_90a) without a GPU, with the launch tables' settings: the
prefill variants (contiguous and paged caches) on wgmma tensor cores with a software pipeline that keeps K/V
tiles in flight, no register spills, every variant within the H100's shared memory. Numerics are tested under
the interpreter (test_attention_kernels.py) and on GPUs (test_attention_kernels_cuda.py); this catches what
only the compiler sees (loop-carried types, layouts, resources, pipelining) on CPU CI."""

from __future__ import annotations

import pytest

from tests.conftest import run_compile_check

H100_SHARED = 227 * 1024  # bytes of shared memory one block may use


@pytest.mark.slow
def test_attention_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    res = run_compile_check("flash_compile_check.py")
    assert any(k.startswith("prefill fp16 D128 paged") for k in res) and any(k.startswith("decode Q4") for k in res)
    for name, v in res.items():
        assert 0 < v["regs"] <= 255 and v["shared"] <= H100_SHARED, (name, v)
        if name.startswith("prefill"):
            assert v["spill_bytes"] == 0, (name, v)
            assert v["wgmma"] > 0 and v["cp_async"] > 0, (name, v)
            # The interior loop keeps a K/V tile in flight while it computes (a load feeding the tile addresses
            # inside the loop, e.g. an unhoisted block-table read, makes this 0).
            assert v["in_flight"] >= 1, (name, v)


def test_flash_runtime_options_parse_and_reject_bad_values() -> None:
    from exlpy.errors import ConfigError
    from exlpy.runtime import RuntimeOptions

    d = RuntimeOptions.from_env({})
    assert d.flash_attn and not d.flash_tma and d.flash_config is None
    o = RuntimeOptions.from_env({"EXLPY_FLASH_ATTN": "0", "EXLPY_FLASH_TMA": "1", "EXLPY_FLASH_CONFIG": "64,32,4,2"})
    assert not o.flash_attn and o.flash_tma and o.flash_config == (64, 32, 4, 2)
    for bad in ("64,32,4", "a,b,c,d", "64,0,4,2"):
        with pytest.raises(ConfigError, match="EXLPY_FLASH_CONFIG"):
            RuntimeOptions.from_env({"EXLPY_FLASH_CONFIG": bad})
