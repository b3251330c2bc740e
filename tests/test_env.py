"""Runtime environment (spec §12), OOM conversion, the free-memory query and P2P-safe moves, on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import exlpy.env as env
from exlpy.errors import DeviceError, InsufficientVRAMError
from exlpy.parallel import memory, p2p
from tests.conftest import child_env


def run_py(code: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    e = child_env(drop=("CUDA_MODULE_LOADING", "EXLPY_NO_CPU_WARNING"), **extra_env)
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, env=e,
                          timeout=120, check=True)


def test_module_loading_lazy_unless_user_set_and_cpu_warning_once() -> None:
    code = ("import os, exlpy.env as e; e.warn_if_cpu_only_torch(); e.warn_if_cpu_only_torch(); "
            "print(os.environ['CUDA_MODULE_LOADING'])")
    r = run_py(code)
    assert r.stdout.strip() == "LAZY"
    if not env.torch_has_gpu_backend():
        assert r.stderr.count("built without CUDA or ROCm") == 1
    assert run_py(code, CUDA_MODULE_LOADING="EAGER").stdout.strip() == "EAGER"
    assert "built without" not in run_py(code, EXLPY_NO_CPU_WARNING="1").stderr


def test_cpu_threads_limited_for_gpu_and_restored() -> None:
    # On a GPU machine an earlier test of this session may have loaded a model on CUDA, which limited the threads
    # already: start from the unlimited count, and leave the state as found.
    was_limited = env._threads_before_gpu is not None
    env.restore_cpu_threads()
    before = torch.get_num_threads()
    try:
        env.limit_cpu_threads_for_gpu()
        assert torch.get_num_threads() == 1
    finally:
        env.restore_cpu_threads()
    assert torch.get_num_threads() == before
    if was_limited:
        env.limit_cpu_threads_for_gpu()


def test_oom_guard_converts_with_advice_and_passes_other_errors() -> None:
    advice = r"during decode.*Tried to allocate.*max_seq_len.*GPUs"
    with pytest.raises(InsufficientVRAMError, match=advice) as e:
        with env.oom_guard("decode"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)
    with pytest.raises(InsufficientVRAMError, match="prefill"):
        with env.oom_guard("prefill"):
            raise RuntimeError("HIP out of memory. Tried to allocate 1 GiB")
    with pytest.raises(ValueError, match="unrelated"):
        with env.oom_guard("decode"):
            raise ValueError("unrelated")
    with env.oom_guard("nothing"):
        pass


def test_no_memory_source_raises_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> list[memory.DeviceMemory]:
        raise RuntimeError("driver not loaded")

    monkeypatch.setattr(memory, "SOURCES", {"nvml": broken, "torch": lambda: [], "rocm-smi": broken})
    with pytest.raises(DeviceError, match="Unable to read available VRAM.*driver not loaded.*torch: no dev"):
        memory.query_devices()


def test_rocm_smi_parsing_and_visible_device_order(monkeypatch: pytest.MonkeyPatch) -> None:
    text = json.dumps({
        "card0": {"VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "10960896"},
        "card1": {"VRAM Total Memory (B)": "34351349760", "VRAM Total Used Memory (B)": "351349760"},
        "system": {"driver": "x"},
    })
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devs = memory.parse_rocm_smi(text)
    assert [(d.ordinal, d.total, d.free) for d in devs] == [
        (0, 68702699520, 68702699520 - 10960896), (1, 34351349760, 34000000000)]
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1,0")
    assert [d.total for d in memory.parse_rocm_smi(text)] == [34351349760, 68702699520]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert memory.visible_entries() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 2, GPU-abc ,")
    assert memory.visible_entries() == ["2", "GPU-abc"]


def test_safe_move_tensor_on_cpu_and_verdict_cache() -> None:
    t = torch.randn(3)
    assert p2p.safe_move_tensor(t, "cpu") is t
    assert p2p.peer_copy_ok("cpu", "cpu")
    p2p.set_peer_verdict("cuda:1", "cuda:0", False)
    try:
        assert p2p._verdicts[("cuda:0", "cuda:1")] is False  # unordered pair, one entry
        assert not p2p.peer_copy_ok("cuda:0", "cuda:1")
    finally:
        p2p.clear_peer_verdicts()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_safe_move_between_gpus_round_trips() -> None:
    x = torch.randn(1000, device="cuda:0")
    y = p2p.safe_move_tensor(x, "cuda:1")
    assert y.device == torch.device("cuda:1") and torch.equal(y.cpu(), x.cpu())
