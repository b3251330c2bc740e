"""Triton kernels against their torch references: small shapes on CPU (interpreter), real shapes on CUDA.

Tests marked `interpreter` run Triton's interpreter on CPU tensors: tests/conftest.py runs them in a child pytest
with TRITON_INTERPRET=1, so this session keeps compiled kernels for the CUDA tests.
"""

from __future__ import annotations

import os

import pytest
import torch

from exlpy.kernels import reference
from tests.conftest import requires_cuda

triton = pytest.importorskip("triton")

from exlpy.kernels.activation import silu_mul  # noqa: E402
from exlpy.kernels.gemv import linear_add, norm_linear  # noqa: E402
from exlpy.kernels.kv_store import store_kv  # noqa: E402
from exlpy.kernels.paged_attention import paged_decode_attention  # noqa: E402
from exlpy.kernels.rmsnorm import rms_norm  # noqa: E402
from exlpy.kernels.rope import apply_rope  # noqa: E402


def _dev_ok(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


@pytest.mark.interpreter
def test_rms_norm_strided_rows() -> None:
    _dev_ok("cpu")
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3, 5, 80, generator=g)
    x = big[..., :48]  # strided rows, as a view into a fused projection output
    w = torch.rand(48, generator=g) + 0.5
    _close(rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), 1e-5)


@pytest.mark.interpreter
def test_silu_mul_halves_of_fused_output() -> None:
    _dev_ok("cpu")
    gu = torch.randn(2, 3, 2 * 40, generator=torch.Generator().manual_seed(1))
    gate, up = gu[..., :40], gu[..., 40:]
    _close(silu_mul(gate, up), reference.silu_mul(gate, up), 1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("N,K", [(40, 1024), (700, 300)])
def test_gemv_single_row_with_and_without_residual(N: int, K: int) -> None:
    _dev_ok("cpu")
    g = torch.Generator().manual_seed(5)
    x, w, r = torch.randn(1, 1, K, generator=g), torch.randn(N, K, generator=g), torch.randn(1, 1, N, generator=g)
    _close(linear_add(x, w), reference.linear_add(x, w), 1e-5)
    expect = reference.linear_add(x, w, r.clone())
    out = linear_add(x, w, r)
    assert out.data_ptr() == r.data_ptr()  # accumulated in place
    _close(out, expect, 1e-5)
    x3 = torch.randn(3, K, generator=g)  # several rows: the cuBLAS path
    _close(linear_add(x3, w), reference.linear_add(x3, w), 1e-5)
    nw = torch.rand(K, generator=g) + 0.5
    _close(norm_linear(x, nw, 1e-5, w), reference.norm_linear(x, nw, 1e-5, w), 1e-5)
    _close(norm_linear(x3, nw, 1e-5, w), reference.norm_linear(x3, nw, 1e-5, w), 1e-5)


@pytest.mark.interpreter
def test_rope_in_place_on_qkv_views() -> None:
    _dev_ok("cpu")
    g = torch.Generator().manual_seed(2)
    B, T, hq, hk, D = 2, 3, 4, 2, 16
    qkv = torch.randn(B, T, (hq + 2 * hk) * D, generator=g)
    q = qkv[..., :hq * D].view(B, T, hq, D)
    k = qkv[..., hq * D:(hq + hk) * D].view(B, T, hk, D)
    cos, sin = torch.randn(20, D, generator=g), torch.randn(20, D, generator=g)
    pos = torch.randint(0, 20, (B, T), generator=g)
    rq, rk = reference.apply_rope(q.clone(), k.clone(), cos, sin, pos)
    oq, ok = apply_rope(q, k, cos, sin, pos)
    _close(oq, rq, 1e-5)
    _close(ok, rk, 1e-5)
    _close(qkv[..., :hq * D].view(B, T, hq, D), rq, 1e-5)  # really in place


@pytest.mark.interpreter
def test_store_kv_skips_negative_slots() -> None:
    _dev_ok("cpu")
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(3, 8, 2, 4, generator=g), torch.randn(3, 8, 2, 4, generator=g)
    k, v = torch.randn(3, 2, 2, 4, generator=g), torch.randn(3, 2, 2, 4, generator=g)
    slots = torch.tensor([[0, 9], [17, -1], [-1, 23]])
    rk, rv = kc.clone(), vc.clone()
    reference.store_kv(rk, rv, slots, k, v)
    store_kv(kc, vc, slots, k, v)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)


def _paged_case(B: int, T: int, hq: int, hk: int, D: int, page: int, pages: int, lens: list[int],
                device: str, dtype: torch.dtype, masked: bool = False) -> None:
    g = torch.Generator().manual_seed(4)
    n_pages = B * pages + 2
    kc = torch.randn(n_pages, page, hk, D, generator=g).to(device, dtype)
    vc = torch.randn(n_pages, page, hk, D, generator=g).to(device, dtype)
    bt = torch.randperm(n_pages, generator=g)[:B * pages].view(B, pages).int().to(device)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    pos = (seqlens.long().view(-1, 1) - T + torch.arange(T, device=device)).clamp(min=0)
    q = torch.randn(B, T, hq, D, generator=g).to(device, dtype)
    mask = None
    if masked:
        mask = torch.rand(B, pages * page, generator=g).to(device) > 0.3
        mask[:, 0] = True
    max_len = max(lens)
    ref = reference.paged_attention(q.float(), kc.float(), vc.float(), bt, page, seqlens, max_len, pos, 0.3,
                                    mask)
    out = paged_decode_attention(q, kc, vc, bt, page, seqlens, max_len, pos, 0.3, mask)
    live = seqlens > 0
    _close(out[live], ref[live], 2e-2 if dtype == torch.float16 else 1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("T,lens,masked", [(1, [5, 200, 0], False), (2, [70, 3, 129], True)])
def test_paged_decode_attention_cpu(T: int, lens: list[int], masked: bool) -> None:
    _dev_ok("cpu")
    _paged_case(3, T, 4, 2, 16, 32, 8, lens, "cpu", torch.float32, masked)


@requires_cuda
def test_kernels_real_shapes_cuda() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("run without TRITON_INTERPRET for compiled kernels")
    dev, dt = "cuda", torch.float16
    x = torch.randn(7, 4096, device=dev, dtype=dt)
    w = torch.rand(4096, device=dev, dtype=dt) + 0.5
    _close(rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), 2e-3)
    gu = torch.randn(5, 2 * 14336, device=dev, dtype=dt)
    _close(silu_mul(gu[:, :14336], gu[:, 14336:]), reference.silu_mul(gu[:, :14336], gu[:, 14336:]), 2e-3)
    for n, k in ((6144, 4096), (4096, 14336), (2048, 2048)):
        xs, ws, rs = (torch.randn(1, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt) * 0.02,
                      torch.randn(1, n, device=dev, dtype=dt))
        _close(linear_add(xs, ws, rs.clone()), reference.linear_add(xs, ws, rs), 2e-3)
        nw = torch.rand(k, device=dev, dtype=dt) + 0.5
        _close(norm_linear(xs, nw, 1e-5, ws), reference.norm_linear(xs, nw, 1e-5, ws), 2e-3)
    for lens in ([511], [4000], [1, 300, 1024, 77]):
        _paged_case(len(lens), 1, 32, 8, 128, 256, 16, lens, dev, dt)
    _paged_case(2, 1, 32, 8, 64, 2048, 1, [600, 2048], dev, dt)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_token_bitmask_kernel(device: str) -> None:
    _dev_ok(device)
    from exlpy.kernels.token_bitmask import apply_token_bitmask

    g = torch.Generator().manual_seed(5)
    vocab = 49152 if device == "cuda" else 1000
    logits = torch.randn(3, vocab, generator=g).to(device, torch.float16)
    words = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32 - 1), generator=g, dtype=torch.int64)
    words = words.to(torch.int32).to(device)  # one word short: the tail must be excluded too
    out = apply_token_bitmask(logits, words)
    ref = reference.apply_token_bitmask(logits, words)
    assert torch.equal(torch.isinf(out), torch.isinf(ref)) and torch.equal(out, ref)


def _window_softcap_case(device: str, dtype: torch.dtype, D: int, T: int, window: int, softcap: float) -> None:
    g = torch.Generator().manual_seed(5)
    B, hq, hk, page, pages = 3, 4, 2, 32, 8
    n_pages = B * pages + 2
    kc, vc = torch.randn(n_pages, page, hk, D, generator=g), torch.randn(n_pages, page, hk, D, generator=g)
    bt = torch.randperm(n_pages, generator=g)[:B * pages].view(B, pages).int()
    seqlens = torch.tensor([5, 200, 129], dtype=torch.int32)
    pos = (seqlens.long().view(-1, 1) - T + torch.arange(T)).clamp(min=0)
    q = torch.randn(B, T, hq, D, generator=g) * 3  # scores large enough for the cap to matter
    scale = D ** -0.5
    ref = reference.paged_attention(q, kc, vc, bt, page, seqlens, 200, pos, scale, None, window, softcap)
    dev = [t.to(device) for t in (q, kc, vc, bt, seqlens, pos)]
    out = paged_decode_attention(dev[0].to(dtype), dev[1].to(dtype), dev[2].to(dtype), dev[3], page, dev[4], 200,
                                 dev[5], scale, None, window, softcap)
    _close(out.cpu(), ref, 1e-5 if dtype == torch.float32 else 2e-2)
    plain = reference.paged_attention(q, kc, vc, bt, page, seqlens, 200, pos, scale)
    assert (ref - plain).abs().max() > 1e-2  # the feature changes the result


CASES_WS = [(1, 37, 0.0), (1, 0, 1.5), (2, 20, 0.8), (1, 150, 2.0)]


@pytest.mark.interpreter
@pytest.mark.parametrize("T,window,softcap", CASES_WS)
def test_paged_decode_attention_window_softcap_cpu(T: int, window: int, softcap: float) -> None:
    """Sliding windows (Gemma 2, Cohere 2, Phi-3, StarCoder2) and soft-capped scores in the decode kernel."""
    _dev_ok("cpu")
    _window_softcap_case("cpu", torch.float32, 16, T, window, softcap)


@requires_cuda
@pytest.mark.parametrize("D", [96, 128, 256])  # Phi-3, Llama-like, Gemma 2 head sizes
@pytest.mark.parametrize("T,window,softcap", CASES_WS)
def test_paged_decode_attention_window_softcap_cuda(D: int, T: int, window: int, softcap: float) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("run without TRITON_INTERPRET for compiled kernels")
    _window_softcap_case("cuda", torch.float16, D, T, window, softcap)


@pytest.mark.interpreter
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
def test_post_norm_residual_add_and_geglu_cpu(x_dtype: torch.dtype) -> None:
    """Gemma 2 / GLM-4 post-norm residual add (an fp32 residual, Gemma 2) and GeGLU (tanh) kernels."""
    _dev_ok("cpu")
    from exlpy.kernels.activation import act_mul
    from exlpy.kernels.rmsnorm import rms_norm_add

    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 96, generator=g).to(x_dtype)
    y = torch.randn(5, 96, generator=g).half()
    w = (torch.rand(96, generator=g) + 0.5).half()
    want = reference.rms_norm_add(x.clone(), y, w, 1e-6)
    got = rms_norm_add(x.clone(), y, w, 1e-6)
    assert got.dtype == x_dtype
    _close(got, want, 1e-3)
    gu = torch.randn(3, 2 * 200, generator=g) * 3
    _close(act_mul(gu[:, :200], gu[:, 200:], "gelu_tanh"), reference.act_mul(gu[:, :200], gu[:, 200:], "gelu_tanh"),
           1e-5)


@pytest.mark.interpreter
def test_norms_read_an_fp32_residual_into_half_precision_cpu() -> None:
    """Gemma 2's fp32 residual stream: RMSNorm and the fused norm + GEMV read it and write the weights' dtype."""
    _dev_ok("cpu")
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, 128, generator=g) * 30  # beyond what an fp16 residual would hold exactly
    nw = (torch.rand(128, generator=g) + 0.5).half()
    w = (torch.randn(48, 128, generator=g) * 0.05).half()
    y = rms_norm(x, nw, 1e-6)
    assert y.dtype == torch.float16
    _close(y, reference.rms_norm(x, nw, 1e-6), 1e-3)
    z = norm_linear(x, nw, 1e-6, w)
    assert z.dtype == torch.float16
    _close(z, reference.norm_linear(x, nw, 1e-6, w), 2e-3)
