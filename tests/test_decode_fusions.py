"""Decode fusions: RoPE + KV-cache write in one kernel, SwiGLU in the gate|up GEMV epilogue.

The Triton kernels run on CPU tensors under TRITON_INTERPRET (tests marked `interpreter`, which tests/conftest.py
runs in a child pytest); the model-level checks run the CPU reference path through the rewired Attention/MLP and
the Triton paths through `ops` on CPU tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

from exlpy.errors import ConfigError
from exlpy.kernels import ops, reference
from exlpy.model.fusion import fuse_dense
from exlpy.model.linear import DenseLinear
from tests.conftest import requires_cuda

triton = pytest.importorskip("triton")

from exlpy.kernels.gemv import norm_linear_swiglu  # noqa: E402
from exlpy.kernels.rope import rope_store_kv  # noqa: E402


def _interp() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def _qkv_case(dtype: torch.dtype, B: int, T: int, hq: int, hk: int, D: int, seed: int):
    """q/k/v as strided views into one fused qkv projection output, caches, tables and slots."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (hq + 2 * hk) * D, generator=g).to(dtype)
    q = qkv[..., :hq * D].view(B, T, hq, D)
    k = qkv[..., hq * D:(hq + hk) * D].view(B, T, hk, D)
    v = qkv[..., (hq + hk) * D:].view(B, T, hk, D)
    S = 24
    cos, sin = torch.randn(S, D, generator=g).to(dtype), torch.randn(S, D, generator=g).to(dtype)
    pos = torch.randint(0, S, (B, T), generator=g)
    kc = torch.randn(3, 8, hk, D, generator=g).to(dtype)
    vc = torch.randn(3, 8, hk, D, generator=g).to(dtype)
    slots = torch.randperm(24, generator=g)[:B * T].view(B, T)
    if B * T > 1:
        slots.view(-1)[1] = -1  # a padding row of a batch bucket: writes nowhere
    return qkv, q, k, v, cos, sin, pos, kc, vc, slots


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,T,hq,hk,D", [(2, 3, 4, 2, 16), (1, 1, 6, 2, 32), (3, 2, 4, 4, 8)])
def test_rope_store_kv_matches_reference(dtype: torch.dtype, B: int, T: int, hq: int, hk: int, D: int) -> None:
    _interp()
    qkv, q, k, v, cos, sin, pos, kc, vc, slots = _qkv_case(dtype, B, T, hq, hk, D, seed=B * 100 + hq)
    rkc, rvc = kc.clone(), vc.clone()
    rq, rk = reference.rope_store_kv(q.clone(), k.clone(), v.clone(), cos, sin, pos, rkc, rvc, slots)
    # The reference is the composition of the two existing references, by construction of the contract.
    eq, ek = reference.apply_rope(q.clone(), k.clone(), cos, sin, pos)
    assert torch.equal(rq, eq) and torch.equal(rk, ek)
    before_kc = kc.clone()
    oq, ok = rope_store_kv(q, k, v, cos, sin, pos, kc, vc, slots)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert _rel(oq, rq) < tol and _rel(ok, rk) < tol
    assert _rel(kc, rkc) < tol
    assert torch.equal(vc, rvc)  # v is copied, not computed
    # Rotated in place inside the fused qkv buffer, as apply_rope does.
    assert _rel(qkv[..., :hq * D].view(B, T, hq, D), rq) < tol
    assert _rel(qkv[..., hq * D:(hq + hk) * D].view(B, T, hk, D), rk) < tol
    # Exactly the slots given were written: every other cache row is untouched.
    written = torch.zeros(kc.numel() // (hk * D), dtype=torch.bool)
    written[slots.reshape(-1)[slots.reshape(-1) >= 0]] = True
    flat_before, flat_after = before_kc.view(-1, hk, D), kc.view(-1, hk, D)
    assert torch.equal(flat_after[~written], flat_before[~written])
    assert not torch.equal(flat_after[written], flat_before[written])


@pytest.mark.interpreter
def test_rope_store_kv_bad_shapes() -> None:
    _interp()
    _, q, k, v, cos, sin, pos, kc, vc, slots = _qkv_case(torch.float32, 2, 2, 4, 2, 16, seed=7)
    with pytest.raises(ConfigError, match="k_cache"):
        rope_store_kv(q, k, v, cos, sin, pos, kc[..., :8], vc, slots)
    with pytest.raises(ConfigError, match="slots"):
        rope_store_kv(q, k, v, cos, sin, pos, kc, vc, slots[:1])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter,K", [(40, 1024), (13, 300), (7, 520)])
def test_norm_linear_swiglu_single_row(dtype: torch.dtype, inter: int, K: int) -> None:
    _interp()
    g = torch.Generator().manual_seed(inter + K)
    x = torch.randn(1, 1, K, generator=g).to(dtype)
    w = (torch.randn(2 * inter, K, generator=g) / K ** 0.5).to(dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    ref = reference.norm_linear_swiglu(x.float(), nw.float(), 1e-5, w.float())
    out = norm_linear_swiglu(x, nw, 1e-5, w)
    assert out.shape == (1, 1, inter) and out.dtype == dtype
    assert _rel(out, ref) < (5e-3 if dtype == torch.float16 else 1e-5)


@pytest.mark.interpreter
def test_norm_linear_swiglu_several_rows_and_views() -> None:
    _interp()
    g = torch.Generator().manual_seed(11)
    K, inter = 96, 24
    w = torch.randn(2 * inter, K, generator=g)
    nw = torch.rand(K, generator=g) + 0.5
    x3 = torch.randn(2, 3, K, generator=g)  # several rows: the GEMM + activation kernel path
    assert _rel(norm_linear_swiglu(x3, nw, 1e-5, w), reference.norm_linear_swiglu(x3, nw, 1e-5, w)) < 1e-5
    xs = torch.randn(1, 1, 2 * K, generator=g)[..., ::2]  # a strided row is copied, not misread
    assert _rel(norm_linear_swiglu(xs, nw, 1e-5, w), reference.norm_linear_swiglu(xs, nw, 1e-5, w)) < 1e-5
    with pytest.raises(ConfigError, match="gate and up"):
        norm_linear_swiglu(xs, nw, 1e-5, w[:-1])


def test_fused_gate_up_keeps_parts_and_layout() -> None:
    """The fused weight stays plain [gate; up], so the parts' views (and TP's split_columns of them) are
    unchanged, while forward_normed_swiglu equals silu(gate(h)) * up(h)."""
    g = torch.Generator().manual_seed(12)
    K, inter = 64, 40
    wg, wu = torch.randn(inter, K, generator=g), torch.randn(inter, K, generator=g)
    gate, up = DenseLinear(wg.clone(), None), DenseLinear(wu.clone(), None)
    fused = fuse_dense([gate, up])
    assert fused is not None
    assert torch.equal(fused.weight, torch.cat([wg, wu])) and torch.equal(gate.weight, wg)
    assert torch.equal(up.split_columns(3, 17, torch.device("cpu")).weight, wu[3:17])
    x, nw = torch.randn(1, 2, K, generator=g), torch.rand(K, generator=g) + 0.5
    h = reference.rms_norm(x, nw, 1e-6)
    expect = torch.nn.functional.silu(gate.forward(h)) * up.forward(h)
    assert torch.equal(fused.forward_normed_swiglu(x, nw, 1e-6), expect)
    # With biases the activation runs after the biased projection.
    bg, bu = DenseLinear(wg.clone(), torch.randn(inter, generator=g)), DenseLinear(wu.clone(),
                                                                                    torch.randn(inter, generator=g))
    fb = fuse_dense([bg, bu])
    assert fb is not None
    expect_b = torch.nn.functional.silu(bg.forward(h)) * bu.forward(h)
    assert _rel(fb.forward_normed_swiglu(x, nw, 1e-6), expect_b) < 1e-6


@pytest.mark.interpreter
def test_ops_dispatch_triton_paths_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route `ops` to the registered Triton implementations for CPU tensors, as CUDA tensors are routed."""
    _interp()
    import exlpy.kernels.triton_ops  # noqa: F401 - registers the kernels

    assert ops._TRITON["rope_store_kv"] is rope_store_kv
    assert ops._TRITON["norm_linear_swiglu"] is norm_linear_swiglu
    monkeypatch.setattr(ops, "_impl", lambda name, t: ops._TRITON[name])
    _, q, k, v, cos, sin, pos, kc, vc, slots = _qkv_case(torch.float32, 1, 1, 4, 2, 16, seed=13)
    slots.fill_(5)
    rkc, rvc = kc.clone(), vc.clone()
    rq, rk = reference.rope_store_kv(q.clone(), k.clone(), v.clone(), cos, sin, pos, rkc, rvc, slots)
    oq, ok = ops.rope_store_kv(q, k, v, cos, sin, pos, kc, vc, slots)
    assert _rel(oq, rq) < 1e-5 and _rel(kc, rkc) < 1e-5 and torch.equal(vc, rvc)
    x, w, nw = torch.randn(1, 1, 32), torch.randn(48, 32), torch.rand(32) + 0.5
    assert _rel(ops.norm_linear_swiglu(x, nw, 1e-5, w), reference.norm_linear_swiglu(x, nw, 1e-5, w)) < 1e-5


@requires_cuda
def test_fused_decode_kernels_real_shapes_cuda() -> None:
    """Compiled kernels at 8B shapes (run with TRITON_INTERPRET=0 on a GPU)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("run without TRITON_INTERPRET for compiled kernels")
    dev, dt = "cuda", torch.float16
    for B, T in ((1, 1), (4, 3)):
        qkv = torch.randn(B, T, (32 + 16) * 128, device=dev, dtype=dt)
        q, k = qkv[..., :4096].view(B, T, 32, 128), qkv[..., 4096:5120].view(B, T, 8, 128)
        v = qkv[..., 5120:].view(B, T, 8, 128)
        cos, sin = torch.randn(512, 128, device=dev, dtype=dt), torch.randn(512, 128, device=dev, dtype=dt)
        pos = torch.randint(0, 512, (B, T), device=dev)
        kc, vc = torch.randn(8, 256, 8, 128, device=dev, dtype=dt), torch.randn(8, 256, 8, 128, device=dev, dtype=dt)
        slots = torch.randperm(8 * 256, device=dev)[:B * T].view(B, T)
        slots.view(-1)[0] = -1
        rkc, rvc = kc.clone(), vc.clone()
        rq, rk = reference.rope_store_kv(q.clone(), k.clone(), v.clone(), cos, sin, pos, rkc, rvc, slots)
        oq, ok = rope_store_kv(q, k, v, cos, sin, pos, kc, vc, slots)
        # The reference rounds every fp16 op; the kernel rounds once from fp32.
        assert _rel(oq, rq) < 5e-3 and _rel(ok, rk) < 5e-3 and _rel(kc, rkc) < 5e-3 and torch.equal(vc, rvc)
    x = torch.randn(1, 1, 4096, device=dev, dtype=dt)
    w = torch.randn(2 * 14336, 4096, device=dev, dtype=dt) * 0.02
    nw = torch.rand(4096, device=dev, dtype=dt) + 0.5
    ref = reference.norm_linear_swiglu(x.float(), nw.float(), 1e-5, w.float())
    assert _rel(norm_linear_swiglu(x, nw, 1e-5, w), ref) < 5e-3
