"""The GPTQ block kernel (exlpy/kernels/gptq_block.py) against its torch reference: bit-identical codes,
dequantized rows and errors, on CPU under the Triton interpreter and on a GPU (real 8B shapes there).

Tests marked `interpreter` run in a child pytest with TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

from exlpy.kernels import reference
from tests.conftest import requires_cuda

triton = pytest.importorskip("triton")

from exlpy.kernels.gptq_block import gptq_block  # noqa: E402


def _case(o: int, r: int, n: int, k: int, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Rows r of a k-row problem: w a strided view into [o, k, n] (as the converter passes it), u a block of a
    real Cholesky factor, per-item scales of mixed widths."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * k, k, generator=g)
    h = x.t() @ x / (4 * k) + 0.01 * torch.eye(k)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    full = torch.randn(o, k, n + 5, generator=g) * 0.02
    bits = torch.tensor([2, 3, 4, 5, 6, 8] * o)[:o].float()
    maxq = (2**bits - 1)[:, None]
    zero = 2 ** (bits - 1)[:, None]
    scale = (full.abs().amax(1) / (maxq / 2)).clamp(min=1e-6)
    scale[0, :3] = 2.0**-30  # tiny scales: codes clamp at both ends
    full[1, 8:8 + r, 4] = 0.0  # zero columns, as padding
    args = (full[:, 8:8 + r, :n], u[8:8 + r, 8:8 + r], scale[:, :n], zero, maxq)
    return tuple(t.to(device) for t in args)


def _run(fn, w, u, s, z, m, rtn: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = w.clone()
    codes = torch.zeros(w.shape, dtype=torch.uint8, device=w.device)
    err = torch.zeros_like(w)
    fn(w, u, s, z, m, codes, err, rtn)
    return w, codes, err


def _compare(device: str, o: int, r: int, n: int, k: int, rtn: bool = False) -> None:
    args = _case(o, r, n, k, device)
    ref = _run(reference.gptq_block, *args, rtn=rtn)
    got = _run(gptq_block, *args, rtn=rtn)
    for a, b, what in zip(got, ref, ("dequantized rows", "codes", "errors")):
        assert torch.equal(a, b), (what, (a.float() - b.float()).abs().max().item())
    clamped = ref[1][0, :, :3]  # item 0 (2 bits) has tiny scales there: codes at both clamp ends
    assert bool((clamped == 3).any()) and bool((clamped == 0).any())


@pytest.mark.interpreter
@pytest.mark.parametrize("o,r,n,rtn", [(6, 32, 200, False), (3, 17, 128, False), (6, 32, 70, True)])
def test_block_matches_reference_interpreted(o: int, r: int, n: int, rtn: bool) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    _compare("cpu", o, r, n, 64, rtn)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("o,r,n", [(26, 32, 14336), (14, 32, 4096), (2, 5, 1000)])
def test_block_matches_reference_cuda(o: int, r: int, n: int) -> None:
    _compare("cuda", o, r, n, 256)
    _compare("cuda", o, r, n, 256, rtn=True)
