"""The LoRA kernels (exlpy/kernels/lora.py) against their torch references: small shapes on CPU under the
Triton interpreter, real 8B shapes on CUDA. Batches mix rows of several slots, rows with no adapter and slots
whose rank is below the buffer's.

Tests marked `interpreter` run Triton's interpreter on CPU tensors: tests/conftest.py runs them in a child pytest
with TRITON_INTERPRET=1, so this session keeps compiled kernels for the CUDA test.
"""

from __future__ import annotations

import os

import pytest
import torch

from exlpy.kernels import reference
from tests.conftest import requires_cuda

triton = pytest.importorskip("triton")

from exlpy.kernels.lora import lora_expand, lora_expand_swiglu, lora_shrink  # noqa: E402


def _cpu_ok() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def _u(partials: torch.Tensor) -> torch.Tensor:
    """The u = h @ A^T that shrink partials stand for (see reference.py): summed, scaled by the scale column."""
    total = partials.sum(0)
    return total[:, :-1] * total[:, -1:].rsqrt()


def _slots(S: int, P: int, R: int, K: int, N: int, ranks: list[int], g: torch.Generator, device: str,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slot buffers whose rows past each slot's rank hold garbage (the kernels must mask them)."""
    a = torch.randn(S, P, R, K, generator=g).to(device, dtype)
    b = (torch.randn(S, N, R, generator=g) * 0.1).to(device, dtype)
    return a, b, torch.tensor(ranks, dtype=torch.int32, device=device)


def _case(rows: list[int], q_len: int, K: int, parts: list[int], R: int, ranks: list[int], norm: bool,
          device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-5, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    N, P = sum(parts), len(parts)
    a, b, rk = _slots(len(ranks), P, R, K, N, ranks, g, device, dtype)
    adapters = torch.tensor(rows, dtype=torch.int64, device=device)
    M = len(rows) * q_len
    x = torch.randn(len(rows), q_len, K, generator=g).to(device, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(device, dtype) if norm else None
    u = lora_shrink(x, a, rk, adapters, q_len, nw, 1e-5)
    ref_u = reference.lora_shrink(x, a, rk, adapters, q_len, nw, 1e-5)
    live = reference._token_slots(adapters, q_len, M) >= 0
    assert u.shape[1:] == ref_u.shape[1:] == (M, P * R + 1)
    if live.any():
        _close(_u(u)[live], _u(ref_u)[live], tol)
    bounds = tuple(torch.tensor(parts).cumsum(0)[:-1].tolist())
    y0 = torch.randn(len(rows), q_len, N, generator=g).to(device, dtype)
    y = lora_expand(y0.clone(), u, b, rk, adapters, q_len, bounds)
    ref = reference.lora_expand(y0.clone(), ref_u, b, rk, adapters, q_len, bounds)
    _close(y, ref, tol)
    assert torch.equal(y.view(M, N)[~live], y0.view(M, N)[~live])  # rows without an adapter untouched


@pytest.mark.interpreter
@pytest.mark.parametrize("rows,q_len,ranks,norm", [
    ([0], 1, [8, 0, 16], True),  # batch-1 decode; slot 0 uses 8 of the buffer's 16 rank rows
    ([1, -1, 0, 1, 2, -1, 0], 1, [16, 4, 8], False),  # mixed slots and rows with no adapter
    ([2, 0], 5, [3, 16, 16], True),  # several tokens per row (speculative / prefill)
    ([-1, -1], 2, [16, 16, 16], False),  # no adapter in the batch: nothing changes
    ([1, -1, 1], 1, [0, 12, 16, 16], True),  # fewer rows than slots, a slot on two rows
])
def test_shrink_expand_qkv_parts(rows: list[int], q_len: int, ranks: list[int], norm: bool) -> None:
    _cpu_ok()
    _case(rows, q_len, K=96, parts=[64, 32, 32], R=16, ranks=ranks, norm=norm)


@pytest.mark.interpreter
def test_shrink_splits_and_odd_sizes() -> None:
    _cpu_ok()
    # K longer than one split and not a multiple of the K block; N not a multiple of the column block;
    # 40 tokens (two row tiles of 32); rank buffer 24 (padded to a 32-wide rank block).
    _case([0, 1, -1, 1] * 5, 2, K=700, parts=[90, 90], R=24, ranks=[24, 5], norm=True, seed=1)
    _case([0] * 3, 1, K=1500, parts=[130], R=16, ranks=[16], norm=False, seed=2)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows,q_len,fused", [
    ([0, -1, 1, 0], 1, True),  # as many rows as slots: one program group per slot
    ([1, 0, -1] * 7, 1, False),  # 21 tokens: the down partials come from a separate shrink
    ([2, 2], 3, True),  # fewer rows than slots: program groups per row, a repeated slot served once
    ([3], 1, True),  # batch-1 decode
])
def test_expand_swiglu_with_down_partials(rows: list[int], q_len: int, fused: bool) -> None:
    _cpu_ok()
    g = torch.Generator().manual_seed(3)
    K, inter, R, R2 = 48, 160, 16, 8
    a, b, rk = _slots(4, 2, R, K, 2 * inter, [16, 6, 16, 9], g, "cpu", torch.float32)
    da = torch.randn(4, 1, R2, inter, generator=g)
    drk = torch.tensor([8, 0 if fused else 3, 8, 5], dtype=torch.int32)
    adapters = torch.tensor(rows)
    M = len(rows) * q_len
    x = torch.randn(len(rows), q_len, K, generator=g)
    gu = torch.randn(len(rows), q_len, 2 * inter, generator=g)
    u = reference.lora_shrink(x, a, rk, adapters, q_len)
    act, down = lora_expand_swiglu(gu, u, b, rk, adapters, q_len, da, drk)
    ref_act, ref_down = reference.lora_expand_swiglu(gu, u, b, rk, adapters, q_len, da, drk)
    _close(act, ref_act, 1e-5)
    assert down is not None and ref_down is not None
    slot = reference._token_slots(adapters, q_len, M)
    live = (slot >= 0) & (drk[slot.clamp(min=0)] > 0)  # rows of a rank-0 slot are never read: anything goes
    _close(_u(down)[live], _u(ref_down)[live], 1e-5)
    plain, none = lora_expand_swiglu(gu, u, b, rk, adapters, q_len)
    assert none is None
    _close(plain, act, 1e-6)


@requires_cuda
def test_lora_kernels_real_shapes_cuda() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("run without TRITON_INTERPRET for compiled kernels")
    dt = torch.float16
    for rows in ([0], [0, 1, 2, 3] * 8, [3, -1]):
        _case(rows, 1, K=4096, parts=[4096, 1024, 1024], R=16, ranks=[16, 16, 8, 16], norm=True, device="cuda",
              dtype=dt, tol=2e-2)
        _case(rows, 1, K=14336, parts=[4096], R=64, ranks=[16, 64, 16, 32], norm=False, device="cuda", dtype=dt,
              tol=2e-2)
    _case([1], 300, K=4096, parts=[14336, 14336], R=16, ranks=[16, 16], norm=True, device="cuda", dtype=dt,
          tol=2e-2)
    g = torch.Generator().manual_seed(4)
    a, b, rk = _slots(4, 2, 16, 4096, 2 * 14336, [16] * 4, g, "cuda", dt)
    da = (torch.randn(4, 1, 16, 14336, generator=g) * 0.05).to("cuda", dt)
    for n in (1, 32):
        # Row 0 uses slot 0 (so batch-1 decode has a live adapter too); at 32 rows slots 0-3 and rows without one.
        adapters = (torch.arange(n, device="cuda") + 1) % 5 - 1
        x = torch.randn(n, 1, 4096, generator=g).to("cuda", dt)
        gu = torch.randn(n, 1, 2 * 14336, generator=g).to("cuda", dt)
        u = lora_shrink(x, a, rk, adapters, 1)
        act, down = lora_expand_swiglu(gu, u, b, rk, adapters, 1, da, rk)
        ref_act, ref_down = reference.lora_expand_swiglu(gu, u, b, rk, adapters, 1, da, rk)
        _close(act, ref_act, 2e-2)
        live = adapters >= 0
        if live.any():  # rows without an adapter have no down partials to compare
            _close(_u(down)[live], _u(ref_down)[live], 2e-2)
