"""The planner on simulated devices: synthetic Llama-3-70B/8B shapes, uneven budgets, reserves, cache
types."""

from __future__ import annotations

import pytest

from exlpy.errors import InsufficientVRAMError
from exlpy.parallel.costs import (
    CACHE_TYPES,
    GiB,
    MiB,
    ModelShape,
    RunShape,
    cache_bytes_per_layer,
    kv_bytes_per_token,
    scratch_by_kind,
    synthetic_costs,
)
from exlpy.parallel.plan import DeviceBudget, Plan, fit_batch, fit_context, fits, make_plan

LLAMA3_70B = ModelShape(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                        intermediate_size=28672, vocab_size=128256)
LLAMA3_8B = ModelShape(4096, 32, 32, 8, 128, 14336, 128256)
FP16, Q4 = CACHE_TYPES["fp16"], CACHE_TYPES["q4"]


def gpus(*free_gib: float, reserve: int = 256 * MiB, overhead: int = 500 * MiB) -> list[DeviceBudget]:
    return [DeviceBudget(int(f * GiB), reserve, overhead) for f in free_gib]


def check_consistent(plan: Plan) -> None:
    """Order semantics, no overflow, bytes add up."""
    assert list(plan.devices) == sorted(plan.devices), "modules must move forward through the devices only"
    assert plan.devices[0] == 0, "the embedding goes on the first GPU"
    for u in plan.usage:
        assert u.headroom >= 0, f"device {u.index} overflows: {u}"
    assert sum(u.weights for u in plan.usage) == sum(m.weight_bytes for m in plan.modules)
    layer_cache = cache_bytes_per_layer(plan.shape, plan.run, plan.cache)
    assert sum(u.cache for u in plan.usage) == layer_cache * plan.shape.num_layers


def test_synthetic_70b_sizes_match_the_parameter_count() -> None:
    costs = synthetic_costs(LLAMA3_70B, dtype_bytes=2)
    params = sum(c.weight_bytes for c in costs) / 2
    assert abs(params - 70.55e9) / 70.55e9 < 0.01  # Llama-3-70B has 70.55B parameters
    assert [c.kind for c in costs[:3]] == ["embedding", "attention", "mlp"]
    assert len(costs) == 2 + 2 * 80 + 1


def test_kv_bytes_per_token_matches_spec_examples() -> None:
    assert kv_bytes_per_token(LLAMA3_8B, FP16) == 128 * 1024
    assert kv_bytes_per_token(LLAMA3_8B, Q4) == 36 * 1024


def test_70b_fp16_needs_more_than_two_64gib_gpus() -> None:
    costs, run = synthetic_costs(LLAMA3_70B), RunShape(max_seq_len=8192)
    with pytest.raises(InsufficientVRAMError, match="Insufficient VRAM for model and cache") as e:
        make_plan(costs, LLAMA3_70B, run, FP16, gpus(64, 64))  # 131.4 GiB of weights
    msg = str(e.value)
    assert "MiB" in msg and "max_seq_len 8192" in msg and "2 device(s)" in msg
    plan = make_plan(costs, LLAMA3_70B, run, FP16, gpus(64, 64, 64))
    check_consistent(plan)
    assert plan.used_devices() == [0, 1, 2]


def test_70b_4bpw_on_two_24gb_gpus_and_quantized_cache_gives_longer_context() -> None:
    costs = synthetic_costs(LLAMA3_70B, dtype_bytes=2, bits_per_weight=4.0, head_bits=6.0)
    devs = gpus(23.5, 23.5)
    run = RunShape(max_seq_len=4096, max_input_len=512)
    plan = make_plan(costs, LLAMA3_70B, run, FP16, devs)
    check_consistent(plan)
    assert plan.layers_on(0) and plan.layers_on(1)
    ctx16 = fit_context(costs, LLAMA3_70B, run, FP16, devs)
    ctx4 = fit_context(costs, LLAMA3_70B, run, Q4, devs)
    assert ctx16 is not None and ctx4 is not None
    assert ctx16 % 256 == 0
    assert fits(costs, LLAMA3_70B, run.with_(max_seq_len=ctx16), FP16, devs)
    assert not fits(costs, LLAMA3_70B, run.with_(max_seq_len=ctx16 + 256), FP16, devs)
    assert ctx4 > 3 * ctx16  # 4.5 vs 16 bits per element, minus scratch that grows with the context


def test_balanced_fills_in_proportion_to_usable_memory() -> None:
    costs, run = synthetic_costs(LLAMA3_8B), RunShape(max_seq_len=8192, max_input_len=512)
    devs = gpus(40, 80, reserve=0, overhead=0)
    plan = make_plan(costs, LLAMA3_8B, run, FP16, devs, policy="balanced")
    check_consistent(plan)
    w0 = plan.usage[0].weights + plan.usage[0].cache
    w1 = plan.usage[1].weights + plan.usage[1].cache
    assert abs(w1 / (w0 + w1) - 80 / 120) < 0.05  # one layer is ~3% of the model
    frac = [u.headroom / (u.free - u.reserve) for u in plan.usage]
    assert abs(frac[0] - frac[1]) < 0.05, "balanced leaves the same fraction of headroom on each device"


def test_greedy_fills_gpu0_first_and_balanced_spreads() -> None:
    costs, run = synthetic_costs(LLAMA3_8B), RunShape(max_seq_len=2048, max_input_len=512)
    devs = gpus(80, 80)
    greedy = make_plan(costs, LLAMA3_8B, run, FP16, devs, policy="greedy")
    assert greedy.used_devices() == [0]
    balanced = make_plan(costs, LLAMA3_8B, run, FP16, devs)
    check_consistent(balanced)
    assert abs(len(balanced.layers_on(0)) - len(balanced.layers_on(1))) <= 1
    assert balanced.device_of("model.embed_tokens") == 0 and balanced.device_of("lm_head") == 1


def test_reserve_moves_layers_off_a_device() -> None:
    costs, run = synthetic_costs(LLAMA3_8B), RunShape(max_seq_len=2048, max_input_len=512)
    base = make_plan(costs, LLAMA3_8B, run, FP16, gpus(12, 12), policy="greedy")
    devs = [DeviceBudget(12 * GiB, 6 * GiB, 500 * MiB), DeviceBudget(12 * GiB, 256 * MiB, 500 * MiB)]
    reserved = make_plan(costs, LLAMA3_8B, run, FP16, devs, policy="greedy")
    check_consistent(reserved)
    assert len(reserved.layers_on(0)) < len(base.layers_on(0))
    assert reserved.usage[0].headroom >= 0 and reserved.usage[0].total <= 6 * GiB


def test_uneven_budgets_and_a_device_with_nothing_usable() -> None:
    costs, run = synthetic_costs(LLAMA3_8B), RunShape(max_seq_len=4096, max_input_len=512)
    devs = [DeviceBudget(300 * MiB, 256 * MiB, 500 * MiB), DeviceBudget(int(6.5 * GiB)),
            DeviceBudget(40 * GiB)]
    for policy in ("balanced", "greedy"):
        plan = make_plan(costs, LLAMA3_8B, run, FP16, devs, policy=policy)
        assert 0 not in plan.devices, "a device smaller than its reserve + context takes nothing"
        assert plan.usage[0].total == 0
        assert plan.usage[1].weights > 0
        assert min(u.headroom for u in plan.usage[1:]) >= 0


def test_tiny_model_on_one_device_and_fit_batch() -> None:
    tiny = ModelShape(256, 2, 4, 2, 64, 688, 512)
    costs, run = synthetic_costs(tiny), RunShape(max_seq_len=1024, max_input_len=256)
    plan = make_plan(costs, tiny, run, FP16, [DeviceBudget(2 * GiB)])
    assert set(plan.devices) == {0}
    assert plan.predicted_allocated(0) == sum(c.weight_bytes for c in costs) + cache_bytes_per_layer(
        tiny, run, FP16) * 2
    b = fit_batch(costs, tiny, run, FP16, [DeviceBudget(64 * MiB)])
    assert b is not None and b >= 1
    assert fits(costs, tiny, run.with_(batch_size=b), FP16, [DeviceBudget(64 * MiB)])
    assert not fits(costs, tiny, run.with_(batch_size=b + 1), FP16, [DeviceBudget(64 * MiB)])


def test_scratch_grows_with_chunk_and_last_id_only_shrinks_the_head() -> None:
    run = RunShape(max_seq_len=8192, max_input_len=2048)
    full, last = scratch_by_kind(LLAMA3_8B, run), scratch_by_kind(LLAMA3_8B, run.with_(last_id_only=True))
    assert last["head"] < full["head"] and last["mlp"] == full["mlp"]
    assert full["head"] > 2048 * 128256 * 4  # fp32 logits of a whole chunk
    small = scratch_by_kind(LLAMA3_8B, run.with_(max_input_len=256))
    assert small["attention"] < full["attention"] and small["mlp"] < full["mlp"]


def test_nothing_fits_returns_none_and_names_numbers() -> None:
    costs, run = synthetic_costs(LLAMA3_8B), RunShape(max_seq_len=2048)
    assert fit_context(costs, LLAMA3_8B, run, FP16, gpus(8)) is None
    with pytest.raises(InsufficientVRAMError, match=r"weights [\d,]+ MiB"):
        make_plan(costs, LLAMA3_8B, run, FP16, gpus(8))
    with pytest.raises(InsufficientVRAMError, match="no devices"):
        make_plan(costs, LLAMA3_8B, run, FP16, [])
