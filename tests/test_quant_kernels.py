"""Triton packed-matrix kernels vs the torch reference: CPU interpreter at small shapes, CUDA at real shapes.

Tests marked `interpreter` run Triton's interpreter on CPU tensors: tests/conftest.py runs them in a child pytest
with TRITON_INTERPRET=1, so this session keeps compiled kernels for the CUDA tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from exlpy.kernels import exl2_gemv  # noqa: E402
from exlpy.kernels.act_order import act_order  # noqa: E402
from exlpy.kernels.exl2_gemv_plan import plan_for  # noqa: E402
from exlpy.kernels.exl2_matmul import exl2_matmul, exl2_matmul_ref  # noqa: E402
from exlpy.kernels.gptq_matmul import gptq_matmul, gptq_matmul_ref  # noqa: E402
from exlpy.quant.exl2_ref import build_exl2_matrix  # noqa: E402
from exlpy.quant.gptq_ref import build_gptq_matrix  # noqa: E402
from exlpy.quant.layout import QuantMatrix  # noqa: E402
from exlpy.quant.pack import quantize_gptq, random_exl2  # noqa: E402
from tests.conftest import rel_err, requires_cuda  # noqa: E402

CASES = {  # name: (K, N, groups (bits, rows))
    **{f"{b}bit": (96, 72, [(b, 32)] * 3) for b in (2, 3, 4, 5, 6, 8)},
    "mixed_all": (224, 40, [(8, 32), (6, 32), (5, 32), (4, 64), (3, 32), (2, 16), (2, 16)]),
    "partial_last_group": (116, 100, [(4, 32)] * 3 + [(4, 20)]),
    "odd_n_3bit_partial": (104, 33, [(3, 64), (3, 40)]),
    "unaligned_2bit": (96, 136, [(6, 64), (2, 16), (2, 16)]),
    "mixed_blocked": (288, 70, [(8, 32), (6, 32), (5, 64), (4, 64), (3, 32), (2, 64)]),
}


def _exl2(name: str, gen: torch.Generator, device: str = "cpu") -> QuantMatrix:
    k, n, groups = CASES[name]
    t = random_exl2(k, n, groups, gen)
    qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], k, n, "t")
    return qm.to(device)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("m", [1, 5, 40])
def test_exl2_kernels_interpreter(name: str, m: int) -> None:
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + m)
    qm = _exl2(name, gen)
    x = torch.randn(m, qm.k, generator=gen).half()
    bias = torch.randn(qm.n, generator=gen).half()
    y = exl2_matmul(x, qm, bias)
    assert y.shape == (m, qm.n) and y.dtype == torch.float16
    assert rel_err(y, exl2_matmul_ref(x.float(), qm, bias.float())) < 2e-3


@pytest.mark.interpreter
@pytest.mark.parametrize("name,rows", [("2bit", 1), ("3bit", 1), ("4bit", 1), ("5bit", 1), ("6bit", 1),
                                       ("8bit", 1), ("mixed_blocked", 1), ("partial_last_group", 1),
                                       ("odd_n_3bit_partial", 1), ("3bit", 2), ("5bit", 3), ("mixed_blocked", 8),
                                       ("odd_n_3bit_partial", 7)])
def test_gemv_interpreter(name: str, rows: int) -> None:
    """The decode kernel itself (split-K, the self-resetting workspace) for 1-8 rows, twice in a row."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + rows)
    qm = _exl2(name, gen)
    assert exl2_gemv.supports(qm)
    plan = plan_for([qm], torch.device("cpu"))
    assert plan.mode == 1 and sum(ln.programs for ln in plan.launches) > 1  # split-K + arrival counters run
    bias = torch.randn(qm.n, generator=gen).half()
    for _ in range(2):  # a second call finds the workspace and counters zero again
        x = torch.randn(rows, qm.k, generator=gen).half()
        y = exl2_gemv.exl2_gemv(x, qm, bias)
        assert y.shape == (rows, qm.n) and y.dtype == torch.float16
        assert rel_err(y, exl2_matmul_ref(x.float(), qm, bias.float())) < 2e-3
    ws, cnt = exl2_gemv._workspace(torch.device("cpu"))
    assert not ws.any() and not cnt.any()


@pytest.mark.interpreter
def test_gemv_single_program_per_column_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide and short: one K split, so the kernel writes y directly (no workspace)."""
    monkeypatch.setitem(exl2_gemv.CONFIG, "WAVES", 1)
    gen = torch.Generator().manual_seed(3)
    t = random_exl2(64, 1100, [(4, 32), (4, 32)], gen)
    qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], 64, 1100,
                           "t")
    plan = plan_for([qm], torch.device("cpu"))
    assert plan.mode == 0 and plan.launches[0].programs == 3  # one program covers both groups of a column block
    x = torch.randn(1, 64, generator=gen).half()
    assert rel_err(exl2_gemv.exl2_gemv(x, qm), exl2_matmul_ref(x.float(), qm)) < 2e-3


def _same_perm_parts(gen: torch.Generator, k: int, shapes: list[tuple[int, list[tuple[int, int]]]]
                     ) -> list[QuantMatrix]:
    parts = []
    for n, groups in shapes:
        t = random_exl2(k, n, groups, gen)
        parts.append(build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"],
                                       t["q_groups"], k, n, "t"))
    return [dataclasses.replace(p, perm=parts[0].perm) for p in parts]  # as q/k/v of one EXL2 layer


@pytest.mark.interpreter
def test_gemv_group_interpreter() -> None:
    """q|k|v-like group with different layouts per matrix (widths 3-6, partial last groups): one launch per
    width, every part's outputs side by side, bias, twice in a row."""
    gen = torch.Generator().manual_seed(21)
    parts = _same_perm_parts(gen, 160, [(70, [(4, 64), (4, 64), (4, 32)]), (40, [(6, 32), (4, 96), (3, 32)]),
                                        (33, [(5, 64), (5, 96)])])
    bias = torch.randn(143, generator=gen).half()
    group = exl2_gemv.GemvGroup(parts, bias)
    assert sorted(ln.bits for ln in group.plan.launches) == [3, 4, 5, 6]
    for rows in (1, 4):
        x = torch.randn(rows, 160, generator=gen).half()
        y = group.run(act_order(x, parts[0].perm, exl2_gemv.ROW_PAD), torch.float16)
        ref = torch.cat([exl2_matmul_ref(x.float(), p) for p in parts], -1) + bias.float()
        assert y.shape == (rows, 143) and rel_err(y, ref) < 2e-3
    ws, cnt = exl2_gemv._workspace(torch.device("cpu"))
    assert not ws.any() and not cnt.any()


@pytest.mark.interpreter
def test_gemv_residual_in_place() -> None:
    gen = torch.Generator().manual_seed(23)
    qm = _exl2("mixed_blocked", gen)
    for rows in (1, 3):
        res = torch.randn(rows, qm.n, generator=gen).half()
        before = res.clone()
        x = torch.randn(rows, qm.k, generator=gen).half()
        out = exl2_gemv.exl2_gemv(x, qm, None, residual=res)
        assert out is res
        assert rel_err(res, before.float() + exl2_matmul_ref(x.float(), qm)) < 2e-3


@pytest.mark.interpreter
def test_gemv_column_slice() -> None:
    """Strided column views (tensor-parallel slices taken inside a forward pass) decode like the slice's oracle."""
    gen = torch.Generator().manual_seed(9)
    qm = _exl2("partial_last_group", gen).split_columns(32, 96, copy=False)
    x = torch.randn(1, qm.k, generator=gen).half()
    assert rel_err(exl2_gemv.exl2_gemv(x, qm), exl2_matmul_ref(x.float(), qm)) < 2e-3


def test_gemv_routing() -> None:
    """One row goes to exl2_gemv when every group spans whole 32-row blocks; 16-row 2-bit groups do not."""
    gen = torch.Generator().manual_seed(5)
    assert exl2_gemv.supports(_exl2("partial_last_group", gen))
    assert not exl2_gemv.supports(_exl2("unaligned_2bit", gen))
    assert not exl2_gemv.supports(_exl2("mixed_all", gen))


@pytest.mark.interpreter
@pytest.mark.parametrize("act_order,v2", [(False, False), (True, False), (False, True), (True, True)])
def test_gptq_kernels_interpreter(act_order: bool, v2: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(200, 48, generator=gen)
    t, dq = quantize_gptq(w, 64, gen, act_order, v2)
    qm = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 200, 48, "g", v2)
    for m in (1, 6, 40):
        x = torch.randn(m, 200, generator=gen).half()
        ref = x.float() @ dq
        assert rel_err(gptq_matmul(x, qm), ref) < 2e-3
        assert rel_err(gptq_matmul_ref(x.float(), qm), ref) < 1e-5


@requires_cuda
def test_gemv_cuda_graph() -> None:
    """Captured once, replayed with new x: same as the oracle (no host sync, no data-dependent shapes)."""
    gen = torch.Generator().manual_seed(11)
    t = random_exl2(4064, 1000, [(4, 128)] * 31 + [(4, 96)], gen)
    qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], 4064,
                           1000, "t")
    qg = qm.to("cuda")
    x = torch.randn(1, 4064, generator=gen).half().cuda()
    exl2_matmul(x, qg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = exl2_matmul(x, qg)
    for _ in range(2):
        x.copy_(torch.randn(1, 4064, generator=gen).half())
        g.replay()
        assert rel_err(y.cpu(), exl2_matmul_ref(x.cpu().float(), qm)) < 2e-3


@requires_cuda
@pytest.mark.parametrize("groups", [[(4, 128)] * 32, [(8, 128), (6, 128)] + [(5, 128)] * 2 + [(3, 128)] * 12
                                    + [(2, 128)] * 16])
@pytest.mark.parametrize("m", [1, 7, 32, 300])
def test_exl2_kernels_cuda(groups: list[tuple[int, int]], m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    t = random_exl2(4096, 1000, groups, gen)
    qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], 4096,
                           1000, "t")
    x = torch.randn(m, 4096, generator=gen).half()
    ref = exl2_matmul_ref(x.float(), qm)
    y = exl2_matmul(x.cuda(), qm.to("cuda"))
    assert rel_err(y.cpu(), ref) < 2e-3


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [96, 1500])
@pytest.mark.parametrize("with_perm", [True, False])
def test_act_order_kernels_interpreter(k: int, with_perm: bool) -> None:
    """The decode GEMV's input row (act order, fp32, zero pad), with and without the fused RMSNorm."""
    from exlpy.kernels import act_order as ak
    from exlpy.kernels import reference

    gen = torch.Generator().manual_seed(k)
    w = (1 + 0.1 * torch.randn(k, generator=gen)).half()
    perm = torch.randperm(k, generator=gen).to(torch.int32) if with_perm else None
    x3 = torch.randn(3, k, generator=gen).half() * torch.tensor([[1.0], [3.0], [10.0]]).half()  # rows of own norms
    for got, ref in ((ak.act_order(x3, perm, 512), reference.act_order(x3, perm, 512)),
                     (ak.rms_norm_act_order(x3, w, 1e-5, perm, 512),
                      reference.rms_norm_act_order(x3, w, 1e-5, perm, 512))):
        assert got.shape == (3, k + 512) and not got[:, k:].any() and rel_err(got, ref) < 1e-6
    x = torch.randn(1, 1, k, generator=gen).half() * 3
    for got, ref in ((ak.act_order(x, perm, 512), reference.act_order(x, perm, 512)),
                     (ak.rms_norm_act_order(x, w, 1e-5, perm, 512), reference.rms_norm_act_order(x, w, 1e-5, perm,
                                                                                                  512))):
        assert got.shape == (k + 512,) and got.dtype == torch.float32
        assert not got[k:].any()
        assert rel_err(got, ref) < 1e-6
    normed = reference.rms_norm(x, w, 1e-5).float().reshape(-1)
    ref = reference.rms_norm_act_order(x, w, 1e-5, perm, 0)
    assert rel_err(ref, normed[perm.long()] if perm is not None else normed) < 2e-3  # = rms_norm, unrounded


@pytest.mark.interpreter
def test_fused_quant_matches_parts_interpreter() -> None:
    """FusedQuant (q|k|v-like, shared act order) computes the parts side by side: its decode path (grouped GEMV
    after the fused RMSNorm gather) equals the parts run one by one after rms_norm."""
    from exlpy.kernels import reference
    from exlpy.quant.group import FusedQuant
    from exlpy.quant.linear import QuantLinear

    gen = torch.Generator().manual_seed(31)
    qms = _same_perm_parts(gen, 128, [(64, [(4, 128)]), (32, [(5, 64), (4, 64)]), (32, [(6, 128)])])
    parts = [QuantLinear(q, torch.randn(q.n, generator=gen).half() if i == 1 else None, torch.float16)
             for i, q in enumerate(qms)]
    fused = FusedQuant(parts)  # type: ignore[arg-type]
    x = torch.randn(1, 1, 128, generator=gen).half()
    w = (1 + 0.1 * torch.randn(128, generator=gen)).half()
    xp = reference.rms_norm_act_order(x, w, 1e-5, fused.perm, exl2_gemv.ROW_PAD)
    got = fused.group.run(xp, torch.float16)
    h = reference.rms_norm(x, w, 1e-5).float().reshape(1, -1)
    ref = torch.cat([exl2_matmul_ref(h, q, p.bias.float() if p.bias is not None else None)
                     for q, p in zip(qms, parts)], -1)
    assert rel_err(got, ref) < 3e-3
    assert rel_err(fused.forward_normed(x.float(), w.float(), 1e-5).reshape(1, -1), ref) < 3e-3  # CPU path


@requires_cuda
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_gemv_group_cuda(rows: int) -> None:
    """The grouped decode GEMV at q|k|v shapes of an 8B model with mixed widths, 1-8 rows, eager and
    graph-replayed."""
    gen = torch.Generator().manual_seed(41 + rows)
    mixed = [(5, 128)] * 4 + [(4, 128)] * 24 + [(3, 128)] * 4
    parts = _same_perm_parts(gen, 4096, [(4096, mixed), (1024, [(4, 128)] * 32), (1024, [(6, 128)] * 32)])
    group = exl2_gemv.GemvGroup([p.to("cuda") for p in parts], None)
    x = torch.randn(rows, 4096, generator=gen).half().cuda()
    ref = torch.cat([exl2_matmul_ref(x.cpu().float(), p) for p in parts], -1)
    xp = act_order(x, group.perm, exl2_gemv.ROW_PAD)
    for _ in range(5):  # repeated: a race in the split-K epilogue showed only now and then
        assert rel_err(group.run(xp, torch.float16).cpu(), ref) < 2e-3
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = group.run(act_order(x, group.perm, exl2_gemv.ROW_PAD), torch.float16)
    for _ in range(2):
        x.copy_(torch.randn(rows, 4096, generator=gen).half())
        g.replay()
        ref = torch.cat([exl2_matmul_ref(x.cpu().float(), p) for p in parts], -1)
        assert rel_err(y.cpu(), ref) < 2e-3
