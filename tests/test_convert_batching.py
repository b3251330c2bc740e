"""The converter's batching does not change what it computes: every candidate configuration of a matrix
quantized in one batched GPTQ pass (one scale search per group height over all widths, one launch per block of
rows) gives exactly what quantizing each configuration alone gives, and the batched scale search of several
widths equals the search of each width alone. On a GPU, the Triton block kernel equals the torch loop."""

from __future__ import annotations

import pytest
import torch

from exlpy.convert import gptq
from exlpy.convert.qparams import ATTN_OPTIONS, MLP_OPTIONS, distinct
from tests.conftest import requires_cuda

FIELDS = ("codes", "qscale", "scale_max", "dq_sorted")


def _problem(k: int, device: str = "cpu") -> tuple[gptq.PreparedHessian, torch.Generator]:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(4 * k, k, generator=g) * torch.linspace(0.2, 3.0, k)
    return gptq.prepare_hessian((x.t() @ x / (4 * k)).to(device), 0.01, "test"), g


def _same(a: gptq.QuantResult, b: gptq.QuantResult, what: str) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.shape == y.shape and torch.equal(x, y), (what, f)


@pytest.mark.parametrize("rtn", [False, True])
def test_all_options_at_once_equal_each_alone(rtn: bool) -> None:
    k = 192
    ph, g = _problem(k)
    opts = distinct(MLP_OPTIONS, "gate_proj") + distinct(MLP_OPTIONS, "up_proj")[:4]
    ws = [torch.randn(k, 40 + 24 * (i % 3), generator=g) * 0.02 for i in range(len(opts))]
    together = gptq.gptq_quantize(ws, opts, ph, rtn=rtn)
    for i, (w, o) in enumerate(zip(ws, opts)):
        _same(together[i], gptq.gptq_quantize([w], [o], ph, rtn=rtn)[0], f"item {i} ({o})")


def test_fixed_head_scales_batched() -> None:
    """Head slices (fixed group maxima, one width per group) through the batched schedule."""
    from exlpy.convert.qparams import HEAD_OPTIONS

    k = 128
    ph, g = _problem(k)
    o = HEAD_OPTIONS[6]
    w = torch.randn(k, 96, generator=g) * 0.02
    smax = [0.004 * (1 + i) for i in range(len(o.groups(k)))]
    res = gptq.gptq_quantize([w, w[:, :50]], [o, o], ph, smax_fixed=[smax, smax])
    alone = gptq.gptq_quantize([w], [o], ph, smax_fixed=[smax])[0]
    _same(res[0], alone, "head slice")
    assert torch.equal(res[1].codes, alone.codes[:, :50])
    assert torch.equal(res[0].scale_max, torch.tensor(smax).half())


def test_search_of_several_widths_equals_each_width() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(5, 64, 48, generator=g) * 0.02
    weight = torch.rand(64, generator=g) + 0.5
    bits = torch.tensor([2, 3, 4, 6, 8])
    for plain in (False, True):
        qs, sm = gptq.search_scales(w, bits, 2.0, weight, plain=plain)
        for i, b in enumerate(bits.tolist()):
            q1, s1 = gptq.search_scales(w[i:i + 1], b, 2.0, weight, plain=plain)
            assert torch.equal(qs[i:i + 1], q1) and torch.equal(sm[i:i + 1], s1), (b, plain)


@pytest.mark.gpu
@requires_cuda
def test_block_kernel_in_gptq_equals_torch_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A measurement-sized batch on the GPU: the Triton block kernel against the torch loop, everything else
    the same (bit-identical)."""
    from exlpy.kernels import ops

    k = 1024
    ph, g = _problem(k, "cuda")
    opts = distinct(ATTN_OPTIONS, "q_proj") + distinct(ATTN_OPTIONS, "v_proj")
    ws = [(torch.randn(k, 512, generator=g) * 0.02).cuda() for _ in opts]
    fast = gptq.gptq_quantize(ws, opts, ph)
    assert ops._impl("gptq_block", ws[0]) is not ops.reference.gptq_block  # the kernel ran
    monkeypatch.setitem(ops._TRITON, "gptq_block", ops.reference.gptq_block)
    slow = gptq.gptq_quantize(ws, opts, ph)
    for i, (a, b) in enumerate(zip(fast, slow)):
        _same(a, b, f"item {i}")


@pytest.mark.slow
def test_block_kernel_compiles_exact_for_sm90() -> None:
    """What the kernel's bit-identity rests on, from its sm_90a PTX: no FMA, IEEE division, no spills."""
    pytest.importorskip("triton")
    from tests.conftest import run_compile_check

    res = run_compile_check("gptq_block_compile_check.py")
    assert set(res) == {"gptq_block", "gptq_block rtn"}
    for name, v in res.items():
        assert v["fma"] == 0 and v["div_approx"] == 0 and v["div_rn"] >= 1, (name, v)
        assert 0 < v["regs"] <= 255 and v["spill_bytes"] == 0, (name, v)
