"""The converter's GPU path, checked on the CPU: fp16 compute and the CUDA kernels' in-place residual adds.

On CUDA a module forward owns its residual stream: `ops.rms_norm_add` (the post-norm blocks of Gemma 2, Gemma 3
and GLM-4) and `ops.linear_add` (bias-free dense projections) write the sum into their input, where the CPU
references return a new tensor. The converter runs each module many times over the same stored hidden states, so
it hands every forward a copy (`exlpy.convert.forward.module_input`). Before it did, the post-norm models'
reference outputs on an H100 were their inputs overwritten, every option measured an error of exactly zero, and
6-8 bpw targets spent ~3.6 bpw (benchmarks/results/gpu_tests.md, 2026-11-26 13:41). Here the CPU references keep
the CUDA kernels' contract and fp16 is the compute dtype, as on CUDA; an interpreter test checks that these
stand-ins do what the Triton kernels do, and a GPU test converts on the real path.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from exlpy.config.config import ExLlamaV2Config
from exlpy.convert import convert
from exlpy.kernels import reference
from tests.arch_models import VOCAB, make_arch_model
from tests.conftest import requires_cuda
from tests.convert_util import kl, logits

CAL = dict(rows=4, length=64, measurement_rows=2, measurement_length=64, progress=False)
# Post-norm architectures and the bits each converts at (Gemma 2's test weights are large: 8 bits, see
# tests/test_convert_archs.py).
POST_NORM = {"gemma2": 8.0, "glm4": 6.0, "gemma3": 6.0}


def rms_norm_add_in_place(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm_add` as the CUDA kernel does it (kernels/rmsnorm.py): the sum written into x."""
    return x.copy_(x.float() + reference.rms_norm(y, weight, eps).float())


def linear_add_in_place(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """`reference.linear_add` as the CUDA version does it (kernels/gemv.py): the sum written into residual."""
    y = F.linear(x, weight)
    return y if residual is None else residual.copy_(residual + y)


def gpu_like(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make CPU runs compute as on CUDA: fp16, with the kernels' in-place residual adds."""
    monkeypatch.setattr(ExLlamaV2Config, "compute_dtype", lambda self, device: torch.float16)
    monkeypatch.setattr(reference, "rms_norm_add", rms_norm_add_in_place)
    monkeypatch.setattr(reference, "linear_add", linear_add_in_place)


def _cal_file(path: Path) -> str:
    g = torch.Generator().manual_seed(5)
    rows = [json.dumps({"input_ids": torch.randint(2, VOCAB, (64,), generator=g).tolist()}) for _ in range(8)]
    path.write_text("\n".join(rows))
    return str(path)


def _convert(tmp_path: Path, case: str, device: str) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """(convert's result, the measurement) of tiny model `case` converted on `device`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = convert(str(tmp_path / "src"), str(tmp_path / "w"), str(tmp_path / "q"), bits=POST_NORM[case],
                         cal_dataset=_cal_file(tmp_path / "c.jsonl"), device=device, **CAL)
    job = json.loads((tmp_path / "w" / "job.json").read_text())
    return result, job["measurement"]


def _check(case: str, result: dict[str, Any], measurement: dict[str, list[dict[str, Any]]]) -> None:
    """The budget is spent, and each module's measured errors fall from the cheapest option to the dearest by
    orders of magnitude (2 to 8 bits: ~1000x measured); a forward that overwrites its inputs gives all zeros."""
    bits = POST_NORM[case]
    assert bits - 0.5 < result["bpw"]["decoder"] <= bits + 0.01, result["bpw"]
    assert result["mean_layer_error"] < 0.05
    assert len(measurement) == 4
    for key, entries in measurement.items():
        errs = [e["err"] for e in entries]
        assert min(errs) > 0, f"{key}: an option measured no error at all ({errs})"
        cheap = min(entries, key=lambda e: e["total_bits"])["err"]
        dear = max(entries, key=lambda e: e["total_bits"])["err"]
        assert dear * 30 < cheap, f"{key}: flat measured errors, {cheap:.3g} at the fewest bits, {dear:.3g} at most"


@pytest.mark.parametrize("case", sorted(POST_NORM))
def test_post_norm_conversion_on_the_gpu_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """fp16 and in-place residual adds on the CPU: the measurement is sound and the budget spent, and the output,
    loaded in fp32, stays within the CPU conversion tests' bounds of transformers' fp32 logits."""
    ref = make_arch_model(tmp_path / "src", case)
    gpu_like(monkeypatch)
    result, measurement = _convert(tmp_path, case, "cpu")
    _check(case, result, measurement)
    monkeypatch.undo()
    ids = torch.randint(2, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = ref(ids).logits.float()
    q = logits(str(tmp_path / "q"), ids)
    assert kl(hf, q) < 2e-3
    assert float((q - hf).norm() / hf.norm()) < 0.15


@pytest.mark.interpreter
def test_stand_ins_do_what_the_cuda_kernels_do() -> None:
    """The Triton rms_norm_add and the multi-row linear_add write into their residual and return it, with the
    values of the stand-ins above (fp16 residual, and fp32 as Gemma 2's)."""
    pytest.importorskip("triton")
    from exlpy.kernels.gemv import linear_add
    from exlpy.kernels.rmsnorm import rms_norm_add

    g = torch.Generator().manual_seed(0)
    y = torch.randn(6, 64, generator=g).half()
    w = (1 + 0.1 * torch.randn(64, generator=g)).half()
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(6, 64, generator=g).to(dtype)
        want = rms_norm_add_in_place(x.clone(), y, w, 1e-6)
        got = rms_norm_add(x, y, w, 1e-6)
        assert got.data_ptr() == x.data_ptr()
        torch.testing.assert_close(x, want, rtol=1e-3, atol=1e-3)
    h = torch.randn(2, 5, 32, generator=g).half()
    wt = torch.randn(64, 32, generator=g).half() / 8
    r = torch.randn(2, 5, 64, generator=g).half()
    want = linear_add_in_place(h, wt, r.clone())
    got = linear_add(h, wt, r)
    assert got.data_ptr() == r.data_ptr()
    torch.testing.assert_close(r, want, rtol=1e-3, atol=1e-2)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(POST_NORM))
def test_post_norm_conversion_on_a_gpu(tmp_path: Path, case: str) -> None:
    """The same conversion on CUDA (fp16, the Triton kernels, hidden states kept on the device)."""
    make_arch_model(tmp_path / "src", case)
    result, measurement = _convert(tmp_path, case, "cuda:0")
    _check(case, result, measurement)
