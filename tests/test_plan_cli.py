"""`exlpy plan` on the tiny fp16 model: simulated devices, explicit splits, fit-context, errors."""

from __future__ import annotations

import argparse
import re

import pytest

from exlpy.cli import plan as plan_cli
from exlpy.errors import DeviceError, GpuSplitError, InsufficientVRAMError
from tests.conftest import shared_path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    model = str(shared_path("models", "tiny-llama-fp16"))
    args = parser.parse_args(["plan", "--model", model, *argv])
    assert args._run(args) == 0
    return capsys.readouterr().out


def rows(out: str) -> dict[str, list[str]]:
    """Device rows of the rich table: device -> cells."""
    table = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if cells and cells[0].isdigit():
            table[cells[0]] = cells
    return table


def test_simulated_devices_table_and_fit(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "--devices", "1000,1000", "--max-seq-len", "2048")
    t = rows(out)
    assert set(t) == {"0", "1"}
    assert t["0"][1] == "0" and "embedding" in t["0"][2]  # layer 0 with the embedding on device 0
    assert t["1"][1] == "1" and "head" in t["1"][2]
    assert "Largest context that fits at batch 1: 8,192 tokens" in out
    assert re.search(r"Largest batch at max_seq_len 2,048: \d+", out)


def test_fit_context_with_tight_devices_and_cache_types(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = {}
    for ct in ("fp16", "q4"):
        out = run(capsys, "--devices", "700", "--fit-context", "--cache-type", ct, "--max-input-len", "16")
        m = re.search(r"Largest context that fits at batch 1: ([\d,]+) tokens", out)
        assert m, out
        ctx[ct] = int(m.group(1).replace(",", ""))
        assert f"Placement at max_seq_len {ctx[ct]:,}" in out
    assert 0 < ctx["fp16"] < ctx["q4"] < 8192  # smaller cache elements, longer context


def test_gpu_split_budgets(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "--gpu-split", "0.002,1", "--max-seq-len", "512")
    t = rows(out)
    assert t["0"][1] == "-" and t["0"][2] == "embedding"
    assert t["1"][1] == "0-1"
    assert "policy greedy" in out


def test_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(GpuSplitError, match="Too many entries in gpu_split: 2 entries for 1"):
        run(capsys, "--devices", "1000", "--gpu-split", "1,1")
    with pytest.raises(GpuSplitError, match="comma-separated numbers"):
        run(capsys, "--devices", "lots")
    with pytest.raises(GpuSplitError, match="--reserve 2000 MiB is larger than device 0"):
        run(capsys, "--devices", "1000", "--reserve", "2000")
    with pytest.raises(InsufficientVRAMError, match="Insufficient VRAM for model and cache"):
        run(capsys, "--devices", "600", "--max-seq-len", "8192")


def test_without_devices_on_a_machine_without_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("NVML works here")
    except Exception:  # noqa: BLE001
        pass
    with pytest.raises(DeviceError, match="Unable to read available VRAM"):
        run(capsys)
