"""KV cache sizing of `exlpy serve` (exlpy/server/sizing.py): the arithmetic on plain numbers, and the CPU
default through load_state on the demo model."""

from __future__ import annotations

import pytest
import torch

from exlpy.errors import ConfigError
from exlpy.server.sizing import CachePlan, DeviceBudget, cpu_default_tokens, graph_output_bytes, plan_tokens

GiB = 2**30


def test_one_gpu_takes_what_utilization_leaves() -> None:
    # 80 GiB card, 20 GiB in use of which 2 GiB is the placeholder cache, 3 GiB kept for steps, 128 KiB/token.
    d = DeviceBudget("cuda:0", 80 * GiB, 60 * GiB, 2 * GiB, 3 * GiB, 128 * 1024)
    room = 0.9 * 80 * GiB - 20 * GiB + 2 * GiB - 3 * GiB
    assert plan_tokens([d], 0.9, 256) == int(room / (128 * 1024)) // 256 * 256
    assert plan_tokens([d], 0.5, 256) == int((40 * GiB - 20 * GiB + 2 * GiB - 3 * GiB) / (128 * 1024)) // 256 * 256


def test_the_fullest_device_decides_and_devices_without_layers_do_not() -> None:
    a = DeviceBudget("cuda:0", 80 * GiB, 40 * GiB, 0, 0, 64 * 1024)  # 32 GiB room
    b = DeviceBudget("cuda:1", 80 * GiB, 70 * GiB, 0, 0, 64 * 1024)  # 62 GiB room
    c = DeviceBudget("cuda:2", 80 * GiB, 1 * GiB, 0, 0, 0)  # no cache layers here
    assert plan_tokens([a, b, c], 0.9, 256) == int(32 * GiB / (64 * 1024)) // 256 * 256


def test_no_room_gives_zero_and_bad_utilization_is_refused() -> None:
    d = DeviceBudget("cuda:0", 80 * GiB, 5 * GiB, 0, 0, 1024)
    assert plan_tokens([d], 0.9, 256) == 0
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="gpu-memory-utilization"):
            plan_tokens([d], bad, 256)


def test_cpu_default_is_eight_requests_capped_by_memory() -> None:
    assert cpu_default_tokens(8192, 1024, 64 * GiB, 256) == 8 * 8192
    assert cpu_default_tokens(128, 1024, 64 * GiB, 256, floor=2048) == 2048
    capped = cpu_default_tokens(2048, 1024 * 1024, 16 * GiB, 256)  # 1 MiB per token: a quarter of 16 GiB
    assert capped == 4096
    assert cpu_default_tokens(8192, 1024 * 1024, 1 * GiB, 256) == 8192  # never below one request


def test_plan_describes_tokens_and_full_requests() -> None:
    plan = CachePlan(163840, "free GPU memory, utilization 0.9", 20 * GiB, 20480)
    assert plan.full_requests == 8
    assert CachePlan(2048, "CPU default", 1, 128).full_requests == 8  # a 128-token request still takes a page
    assert CachePlan(2560, "x", 1, 300).full_requests == 5  # 300 tokens: two pages each
    text = plan.describe()
    assert "163,840 tokens" in text and "640 pages" in text and "8 request(s) of the full 20480-token" in text
    assert plan.as_dict()["cache_full_length_requests"] == 8
    assert graph_output_bytes([(1, 1), (4, 2)], 100, 10) == 5 * (400 + 40)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU default applies where no GPU is visible; "
                    "tests/test_serving_gpu.py covers sizing from free GPU memory")
def test_load_state_cpu_default_and_health(monkeypatch: pytest.MonkeyPatch) -> None:
    from exlpy.server import load_state
    from exlpy.server.loading import cache_plan_of

    state = load_state(warmup=False)  # the demo model: context 128 -> the 2048-token floor
    g = state.bridge.generator
    plan = cache_plan_of(g)
    assert plan.source == "CPU default" and plan.tokens == 2048
    assert g.num_pages == 8 and g.max_batch_size <= 8
    assert plan.full_requests == 8
    explicit = load_state(cache_size=600, warmup=False)
    assert cache_plan_of(explicit.bridge.generator).source == "--cache-size"
    assert explicit.bridge.generator.num_pages == 3
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):
        load_state(gpu_memory_utilization=0.0, warmup=False)
