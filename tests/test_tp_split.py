"""Tensor-parallel split arithmetic (spec §7.2): integer_split and plan_split properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exlpy.errors import GpuSplitError, TensorParallelError
from exlpy.parallel.costs import ModelShape
from exlpy.parallel.tp_split import integer_split, plan_split
from exlpy.tensor_p import BROADCAST_ID, BROADCAST_KV, BROADCAST_Q, BROADCAST_RS, BROADCAST_VC


def tp_shape(heads: int, kv: int, head_dim: int, layers: int, hidden: int, inter: int, vocab: int) -> ModelShape:
    return ModelShape(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                      intermediate_size=inter, vocab_size=vocab)

weights_st = st.lists(st.floats(min_value=0.5, max_value=200.0), min_size=1, max_size=8)


def test_constants() -> None:
    assert (BROADCAST_KV, BROADCAST_ID, BROADCAST_VC, BROADCAST_RS, BROADCAST_Q) == (0, 1, 2, 3, 4)


@settings(max_examples=200, deadline=None)
@given(x=st.integers(0, 400), weights=weights_st)
def test_integer_split_proportional(x: int, weights: list[float]) -> None:
    parts = integer_split(x, weights)
    assert sum(parts) == x and all(p >= 0 for p in parts)
    total = sum(weights)
    for p, w in zip(parts, weights):
        assert abs(p - x * w / total) < 1.0 + 1e-9  # largest-remainder rounding: within one unit


@settings(max_examples=200, deadline=None)
@given(x=st.integers(1, 400), weights=weights_st, minimum=st.integers(1, 20))
def test_integer_split_minimum(x: int, weights: list[float], minimum: int) -> None:
    parts = integer_split(x, weights, minimum)
    assert sum(parts) == x
    if x >= minimum:
        assert all(p == 0 or p >= minimum for p in parts)
    assert any(parts)


def test_integer_split_examples() -> None:
    assert integer_split(8, [1, 1]) == [4, 4]
    assert integer_split(8, [3, 1]) == [6, 2]
    assert integer_split(7, [1, 1, 1]) == [3, 2, 2]
    # 224 units over [40, 20, 20, 10] GB: exact 99.56, 49.78, 49.78, 24.89 -> the remainders decide.
    assert integer_split(224, [40, 20, 20, 10]) == [99, 50, 50, 25]
    # Shares under the minimum are folded into the smallest non-zero share.
    assert integer_split(10, [8, 1, 1], minimum=2) == [10, 0, 0]
    assert integer_split(6, [1, 1, 1], minimum=2) == [2, 2, 2]
    with pytest.raises(GpuSplitError):
        integer_split(4, [0, 0])


def _check_split(split: list[tuple[int, int, int]], total: int, unit: int) -> None:
    pos = 0
    slots = [s for s, _, _ in split]
    assert slots == sorted(set(slots))
    for _, a, b in split:
        assert a == pos and b > a
        assert a % unit == 0 and (b % unit == 0 or b == total)
        pos = b
    assert pos == total


@settings(max_examples=150, deadline=None)
@given(budgets=st.lists(st.floats(min_value=1.0, max_value=100.0), min_size=1, max_size=4),
       kv=st.sampled_from([4, 8, 16]), groups=st.sampled_from([1, 2, 8]),
       inter=st.sampled_from([1024, 14336, 28672]), hidden=st.sampled_from([2048, 4096, 8192, 8200]),
       vocab=st.sampled_from([32000, 128256, 151936, 50]), tokens=st.integers(0, 100000))
def test_plan_split_covers(budgets: list[float], kv: int, groups: int, inter: int, hidden: int, vocab: int,
                           tokens: int) -> None:
    shape = tp_shape(kv * groups, kv, 128, 8, hidden, inter, vocab)
    mib = [b * 1024 for b in budgets]
    try:
        plan = plan_split(mib, shape, 2.0, tokens, [10 * 2**20] * 8)
    except TensorParallelError as e:
        assert "no KV head" in str(e)
        assert 0 in integer_split(kv, mib)
        return
    _check_split(plan.kv, kv, 1)
    _check_split(plan.q, kv * groups, groups)
    _check_split(plan.id, inter, 128)
    _check_split(plan.rs, hidden, 32)
    _check_split(plan.vc, vocab, 32)
    assert [s for s, _, _ in plan.kv] == list(range(len(budgets)))  # every device gets KV heads
    for (s1, a1, b1), (s2, a2, b2) in zip(plan.kv, plan.q):
        assert s1 == s2 and (a2, b2) == (a1 * groups, b1 * groups)  # whole GQA groups follow the KV heads
    # Minimums: 2 units of 128 (intermediate), 8 of 32 (hidden), 16 of 32 (vocab) when the size allows.
    for split, unit, minimum, total in ((plan.id, 128, 2, inter), (plan.rs, 32, 8, hidden),
                                        (plan.vc, 32, 16, vocab)):
        if math.ceil(total / unit) >= minimum:
            assert all(math.ceil((b - a) / unit) >= minimum for _, a, b in split)
    # KV heads are proportional to the budgets within one head.
    for s, a, b in plan.kv:
        assert abs((b - a) - kv * mib[s] / sum(mib)) < 1.0 + 1e-9


def test_plan_split_subtracts_cache_and_attention() -> None:
    shape = tp_shape(64, 8, 128, 80, 8192, 28672, 128256)
    # Device 0 holds 6 of 8 KV heads: the cache and attention weights come mostly out of its budget, so the
    # MLP split leans towards device 1 even though device 0 has three times the memory.
    plan = plan_split([30 * 1024, 10 * 1024], shape, 2.0, 16384, [200 * 2**20] * 20)
    assert [b - a for _, a, b in plan.kv] == [6, 2]
    left0, left1 = plan.budgets_left
    cache = 2 * 2 * 8 * 128 * 80 * 16384 / 2**20  # 5120 MiB
    assert left0 == 30 * 1024 - int(0.75 * cache) - 20 * 150
    assert left1 == 10 * 1024 - int(0.25 * cache) - 20 * 50
    ids = [b - a for _, a, b in plan.id]
    assert ids[0] / sum(ids) == pytest.approx(left0 / (left0 + left1), abs=0.01)


def test_plan_split_errors() -> None:
    shape = tp_shape(32, 8, 128, 4, 4096, 14336, 32000)
    with pytest.raises(TensorParallelError, match="device 2 with no KV head"):
        plan_split([100, 100, 1], shape, 2.0, 0, [])
    with pytest.raises(TensorParallelError, match="positive budget"):
        plan_split([100, 0], shape, 2.0, 0, [])
    with pytest.raises(TensorParallelError, match="divisible by 128"):
        plan_split([100], tp_shape(32, 8, 128, 4, 4096, 14300, 32000), 2.0, 0, [])
