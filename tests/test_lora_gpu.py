"""Adapters on GPUs (skipped without CUDA): a captured decode step over rows with different adapters (and none)
equals the eager step and the fp32 CPU model, in fp16 and bf16; swapping adapters keeps the captured steps;
with two GPUs, tensor parallelism and a layer split do the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Lora
from exlpy.cache.tp import ExLlamaV2Cache_TP
from exlpy.lora import registry_of
from exlpy.model.batch import cache_rows_batch
from tests.conftest import rel_err, requires_cuda
from tests.lora_util import write_adapter
from tests.tp_util import make_model_dir

ROWS = [["a"], ["b"], None, ["a", "b"]]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora_gpu")
    d = make_model_dir(root / "m", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024, vocab=3000,
                       layers=3, dtype=torch.float16, seed=5)
    return {"dir": d, "a": write_adapter(root / "a", d, r=16, seed=1, std=0.04),
            "b": write_adapter(root / "b", d, r=8, seed=2, std=0.04, targets=["q_proj", "v_proj", "down_proj"]),
            "c": write_adapter(root / "c", d, r=16, seed=3, std=0.04),
            "ids": torch.randint(3, 3000, (4, 9), generator=torch.Generator().manual_seed(0))}


def _adapters(model: ExLlamaV2, case: dict[str, Any]) -> dict[str, ExLlamaV2Lora]:
    return {k: ExLlamaV2Lora.from_directory(model, str(case[k])) for k in "abc"}


def _mixed_decode(model: ExLlamaV2, cache: Any, ad: dict[str, ExLlamaV2Lora], ids: torch.Tensor,
                  rows: list[list[str] | None], steps: int = 3) -> torch.Tensor:
    """Prefill each row with its adapters, then `steps` decode steps over all rows at once (teacher-forced)."""
    reg = registry_of(model)
    slots = [reg.acquire([ad[k] for k in r]) if r else -1 for r in rows]
    dev = model.strategy_for_forward().first_device
    n, B = ids.shape[1] - steps, len(rows)
    try:
        for r, s in enumerate(slots):
            model.forward_batch(ids[r:r + 1, :n], cache_rows_batch(cache, [r], [0], n, dev, [s]), preprocess_only=True)
        out = [model.forward_batch(ids[:, t:t + 1], cache_rows_batch(cache, list(range(B)), [t] * B, 1, dev, slots))
               .float().cpu() for t in range(n, n + steps)]
    finally:
        for s in slots:
            reg.release(s)
    return torch.cat(out, 1)


def _reference(case: dict[str, Any]) -> torch.Tensor:
    m = ExLlamaV2(ExLlamaV2Config(str(case["dir"])))
    m.load(device="cpu")
    return _mixed_decode(m, ExLlamaV2Cache(m, batch_size=4, max_seq_len=32), _adapters(m, case), case["ids"], ROWS)


def _runner(model: ExLlamaV2) -> Any:
    return model.strategy.graph_cache.get("runner") if model.strategy is not None else None


@requires_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
def test_captured_adapter_steps_cuda(case: dict[str, Any], dtype: torch.dtype, tol: float) -> None:
    ref = _reference(case)
    cfg = ExLlamaV2Config(str(case["dir"]))
    cfg.dtype = dtype
    m = ExLlamaV2(cfg)
    m.load(device="cuda:0")
    if not m.strategy_for_forward().graph_safe:
        pytest.skip("Triton kernels unavailable: graphs are off")
    ad = _adapters(m, case)
    cache = ExLlamaV2Cache(m, batch_size=4, max_seq_len=32)
    graphed = _mixed_decode(m, cache, ad, case["ids"], ROWS)
    runner = _runner(m)
    assert runner is not None and any(k[-1] for k in runner.steps)  # a captured step that runs adapters
    assert all(ls.graph is not None for st in runner.steps.values() for _, lanes in st.stages for ls in lanes)
    m.config.no_graphs = True
    cache.current_seq_len = 0
    eager = _mixed_decode(m, cache, ad, case["ids"], ROWS)
    m.config.no_graphs = False
    assert rel_err(graphed, eager) <= 2e-3 and rel_err(graphed, ref) <= tol
    # Another adapter of the same size in a freed slot: the same captured steps, its own results.
    keys = set(runner.steps)
    ad["a"].unload()
    ad["a"] = ad["c"]
    graphed = _mixed_decode(m, cache, ad, case["ids"], ROWS)
    assert set(runner.steps) == keys
    m.config.no_graphs = True
    assert rel_err(graphed, _mixed_decode(m, cache, ad, case["ids"], ROWS)) <= 2e-3
    m.config.no_graphs = False


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("layout", ["tp", "split"])
def test_two_gpus_cuda(case: dict[str, Any], layout: str) -> None:
    ref = _reference(case)
    m = ExLlamaV2(ExLlamaV2Config(str(case["dir"])))
    if layout == "tp":
        m.load_tp([1, 1])
        cache: Any = ExLlamaV2Cache_TP(m, batch_size=4, max_seq_len=32)
    else:
        m.load(gpu_split=[0.01, 10])
        assert {str(x.device) for x in m.modules} == {"cuda:0", "cuda:1"}
        cache = ExLlamaV2Cache(m, batch_size=4, max_seq_len=32)
    ad = _adapters(m, case)
    graphed = _mixed_decode(m, cache, ad, case["ids"], ROWS)
    m.config.no_graphs = True
    if layout == "tp":
        cache.reset()
    else:
        cache.current_seq_len = 0
    eager = _mixed_decode(m, cache, ad, case["ids"], ROWS)
    assert rel_err(graphed, eager) <= 2e-3 and rel_err(graphed, ref) <= 2e-2
    m.unload()


def test_cpu_reference_equals_rows_alone(case: dict[str, Any]) -> None:
    """The CPU reference of the GPU tests (a mixed batch, decoded together) equals each row run alone."""
    ref = _reference(case)
    m = ExLlamaV2(ExLlamaV2Config(str(case["dir"])))
    m.load(device="cpu")
    ad = _adapters(m, case)
    ids = case["ids"]
    for r, keys in enumerate(ROWS):
        alone = m.forward(ids[r:r + 1], loras=[ad[k] for k in keys] if keys else None)[:, -3:]
        assert rel_err(ref[r:r + 1], alone) <= 1e-5


@requires_cuda
def test_exl2_base_adapter_decode_cuda(tmp_path: Path) -> None:
    """EXL2 on a GPU (the grouped q|k|v and gate|up GEMVs with their act-order gather at batch 1): adapted
    decode steps, captured and eager, equal the fp32 CPU model's logits."""
    from safetensors import safe_open

    from tests.conftest import shared_path

    d = shared_path("models", "tiny-llama-exl2-4.0")
    ad = write_adapter(tmp_path / "a", d, r=16, seed=5, std=0.03)
    ids = safe_open(str(d / "reference.safetensors"), "pt").get_tensor("input_ids")[:, :24]
    cpu = ExLlamaV2(ExLlamaV2Config(str(d)))
    cpu.load(device="cpu")
    ref = cpu.forward(ids, loras=[ExLlamaV2Lora.from_directory(cpu, str(ad))])[:, 20:]
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load(device="cuda:0")
    lora = ExLlamaV2Lora.from_directory(m, str(ad))
    for graphs in (True, False):
        m.config.no_graphs = not graphs
        cache = ExLlamaV2Cache(m, max_seq_len=32)
        m.forward(ids[:, :20], cache, preprocess_only=True, loras=[lora])
        out = torch.cat([m.forward(ids[:, t:t + 1], cache, loras=[lora]).float().cpu() for t in range(20, 24)], 1)
        assert rel_err(out, ref) <= 2e-2, graphs
    m.config.no_graphs = False
