"""Loading with placement on CPU: simulated devices (cpu:0, cpu:1), callbacks, OOM fallback, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
from exlpy.engine.placement import autosplit_gen_on, parse_gpu_split, parse_reserve, split_gen_on
from exlpy.errors import GpuSplitError, InsufficientVRAMError, ModelStateError
from exlpy.parallel.memory import DeviceMemory
from tests.conftest import shared_path

DEVS = [torch.device("cpu", 0), torch.device("cpu", 1)]  # distinct device objects, same memory


def make_model(name: str = "tiny-llama-fp16", seq: int = 256) -> ExLlamaV2:
    cfg = ExLlamaV2Config(str(shared_path("models", name)))
    cfg.max_seq_len = seq
    cfg.max_input_len = 64
    cfg.max_attention_size = 64 * 256
    return ExLlamaV2(cfg)


def sim(*mib: int) -> list[DeviceMemory]:
    return [DeviceMemory(i, m * 2**20, m * 2**20, "simulated") for i, m in enumerate(mib)]


def drain(gen: object) -> list[object]:
    return list(gen)  # type: ignore[call-overload]


def reference_logits(ids: torch.Tensor) -> torch.Tensor:
    model = make_model()
    cache = ExLlamaV2Cache(model, max_seq_len=256, lazy=True)
    drain(autosplit_gen_on(model, cache, 0, False, None, None, False, DEVS[:1], sim(1000), [0]))
    return model.forward(ids, cache)


def test_autosplit_over_two_simulated_devices_matches_one_device() -> None:
    model = make_model()
    cache = ExLlamaV2Cache(model, max_seq_len=256, lazy=True)
    calls: list[tuple[int, int]] = []
    drain(autosplit_gen_on(model, cache, 0, False, lambda i, n: calls.append((i, n)), None, False, DEVS,
                           sim(100, 100), [0, 0]))
    n = len(model.modules)
    assert calls == [(i, n) for i in range(n + 1)]
    assert model.loaded
    plan = model.placement_plan
    assert set(plan.devices) == {0, 1} and list(plan.devices) == sorted(plan.devices)
    for m, d in zip(model.modules, plan.devices):
        assert m.device == DEVS[d]
    for layer in range(2):  # each layer's cache lives on that layer's device
        assert model.cache_map[layer] == DEVS[plan.devices[1 + 2 * layer]]
        assert cache.key_states[layer] is not None
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    out = model.forward(ids, cache)
    torch.testing.assert_close(out, reference_logits(ids), rtol=0, atol=0)
    model.unload()
    assert model.placement_plan is None and model.cache_map == {}  # no stale placement after unload


def test_callback_gen_items_are_re_yielded_and_cpu_fallback_warns_once() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU fallback only happens without CUDA devices")
    model = make_model()
    cache = ExLlamaV2Cache(model, max_seq_len=256, lazy=True)

    def gen(i: int, n: int):  # noqa: ANN202
        yield f"{i}/{n}"

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        items = list(model.load_autosplit_gen(cache, callback_gen=gen, progress=True))
    n = len(model.modules)
    assert items == [f"{i}/{n}" for i in range(n + 1)]
    msgs = [str(x.message) for x in w if "no CUDA device" in str(x.message)]
    assert len(msgs) == 1 and "CPU" in msgs[0]
    assert model.loaded and all(m.device == torch.device("cpu") for m in model.modules)
    with pytest.raises(ModelStateError, match="already loaded"):
        model.load_autosplit(cache)
    with pytest.raises(ModelStateError, match="already loaded"):
        model.load()


def test_out_of_memory_while_loading_moves_on_to_the_next_device(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    cache = ExLlamaV2Cache(model, max_seq_len=256, lazy=True)
    real = model.place_module
    seen: list[tuple[int, torch.device]] = []

    def place(i: int, device: torch.device) -> None:
        seen.append((i, device))
        real(i, device)  # allocate first, so the fallback has something to free
        if i == 1 and device == DEVS[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (simulated)")

    monkeypatch.setattr(model, "place_module", place)
    # Huge simulated devices and the greedy policy: the plan puts everything on device 0.
    drain(autosplit_gen_on(model, cache, 0, False, None, None, False, DEVS, sim(10000, 10000), [0, 0],
                           policy="greedy"))
    assert set(model.placement_plan.devices) == {0}
    assert (1, DEVS[0]) in seen and (1, DEVS[1]) in seen
    assert model.modules[0].device == DEVS[0]
    assert all(m.device == DEVS[1] for m in model.modules[1:]), "modules never move back to an earlier device"
    assert model.cache_map[0] == DEVS[1] and cache.key_states[0] is not None


def test_out_of_memory_past_the_last_device_unloads_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    cache = ExLlamaV2Cache(model, max_seq_len=256, lazy=True)
    real = model.place_module

    def place(i: int, device: torch.device) -> None:
        real(i, device)
        if i == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(model, "place_module", place)
    with pytest.raises(InsufficientVRAMError, match="Insufficient VRAM for model and cache.*model.layers.1"):
        drain(autosplit_gen_on(model, cache, 0, False, None, None, False, DEVS, sim(10000, 10000), [0, 0]))
    assert not model.loaded
    assert all(m.device is None for m in model.modules)
    assert all(k is None for k in cache.key_states)


def test_load_gpu_split_budgets_on_simulated_devices() -> None:
    model = make_model()
    cache = ExLlamaV2Cache(model, max_seq_len=256, lazy=True)
    # 2 MiB on the first device takes the embedding (0.5 MiB fp32) and little else; the rest goes to device 1.
    drain(split_gen_on(model, [2 / 1024, 1.0], None, None, False, DEVS))
    plan = model.placement_plan
    assert plan.policy == "greedy" and plan.devices[0] == 0 and plan.devices[-1] == 1
    assert plan.usage[0].total <= 2 * 2**20
    assert cache.key_states[1] is not None and model.cache_map[1] == DEVS[1]
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.forward(ids, cache), reference_logits(ids), rtol=0, atol=0)


def test_empty_gpu_split_means_first_device() -> None:
    # exllamav2 loads with `gpu_split or [99999]`; TabbyAPI passes [] on one GPU (it failed: "no devices").
    model = make_model()
    drain(split_gen_on(model, [], None, None, False, DEVS))
    assert set(model.cache_map.values()) == {DEVS[0]}
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    cache = ExLlamaV2Cache(model, max_seq_len=256)
    torch.testing.assert_close(model.forward(ids, cache), reference_logits(ids), rtol=0, atol=0)


def test_exl2_model_splits_too() -> None:
    model = make_model("tiny-llama-exl2-4.0")
    cache = ExLlamaV2Cache(model, max_seq_len=256, lazy=True)
    drain(autosplit_gen_on(model, cache, 0, True, None, None, False, DEVS, sim(60, 60), [0, 0]))
    assert set(model.placement_plan.devices) == {0, 1}
    out = model.forward(torch.tensor([[1, 2, 3, 4]]), cache, last_id_only=True)
    assert out.shape == (1, 1, 512) and torch.isfinite(out).all()


@pytest.mark.parametrize("split, match", [
    ([1, 1, 1], "Too many entries in gpu_split: 3 entries for 2"),
    ([-1], "must not be negative"),
    (["20"], "finite number"),
    ([float("nan")], "finite number"),
    ([True], "finite number"),
    ("20,24", "list of GB"),
])
def test_bad_gpu_split(split: object, match: str) -> None:
    with pytest.raises(GpuSplitError, match=match):
        parse_gpu_split(split, 2)  # type: ignore[arg-type]


def test_bad_reserve_and_defaults() -> None:
    assert parse_reserve(None, 3) == [192 * 2**20, 64 * 2**20, 64 * 2**20]
    assert parse_reserve(5, 2) == [5, 5]
    assert parse_reserve([7], 2) == [7, 64 * 2**20]
    for bad, match in (([-1], "negative"), ("x", "bytes"), ([1, 2, 3], "Too many entries in reserve_vram"),
                       ([None], "finite number")):
        with pytest.raises(GpuSplitError, match=match):
            parse_reserve(bad, 2)


def test_reserve_larger_than_a_device_and_model_that_cannot_fit() -> None:
    model = make_model()
    cache = ExLlamaV2Cache(model, max_seq_len=256, lazy=True)
    with pytest.raises(GpuSplitError, match=r"reserve_vram\[1\] = 200 MiB is larger than device 1's total"):
        drain(autosplit_gen_on(model, cache, [0, 200 * 2**20], False, None, None, False, DEVS, sim(100, 100),
                               [0, 0]))
    with pytest.raises(InsufficientVRAMError, match=r"Insufficient VRAM for model and cache.*MiB.*2 device"):
        drain(autosplit_gen_on(model, cache, 0, False, None, None, False, DEVS, sim(2, 2), [0, 0]))
    assert not model.loaded and all(m.device is None for m in model.modules)


def test_cache_must_be_lazy_and_split_entries_checked_through_the_model_api() -> None:
    model = make_model()
    eager = ExLlamaV2Cache(model, max_seq_len=256)
    with pytest.raises(ModelStateError, match="lazy=True"):
        model.load_autosplit(eager)
    if not torch.cuda.is_available():
        with pytest.raises(GpuSplitError, match="Too many entries in gpu_split"):
            model.load(gpu_split=[1.0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.load()  # None: everything on the one device there is
        assert model.loaded


def test_quantized_cache_bytes_match_the_plan() -> None:
    from exlpy.cache.quant import ExLlamaV2Cache_Q4

    model = make_model()
    cache = ExLlamaV2Cache_Q4(model, max_seq_len=256, lazy=True)
    drain(autosplit_gen_on(model, cache, 0, False, None, None, False, DEVS, sim(100, 100), [0, 0]))
    plan = model.placement_plan
    assert set(plan.devices) == {0, 1}
    real = sum(t.numel() * t.element_size() for t in cache.all_tensors())
    # Codes + scales per layer, nothing else: attention reads the codes in place (no fp16 working copies).
    assert sum(u.cache for u in plan.usage) == real
    assert all(u.cache > 0 for u in plan.usage)
