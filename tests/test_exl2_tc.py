"""The tensor-core dequant GEMM (exlpy/kernels/exl2_tc.py, 1-256 rows) against the torch reference
(`reference.quant_matmul`): every row count 1-64, 65-256 in row tiles (EXLPY_TC_MAX_ROWS), every EXL2 bit width and
mixes, both orientations and the prefetch off, act order, fused groups with bias / residual / RMSNorm, GPTQ, split-K,
its plan and its dispatch (EXLPY_QMM_KERNEL). CPU interpreter at small shapes; CUDA at an 8B model's shapes, under CUDA
graphs, and inside a quantized model's batched decode.

Tests marked `interpreter` run Triton's interpreter on CPU tensors: tests/conftest.py runs them in a child pytest
with TRITON_INTERPRET=1, so this session keeps compiled kernels for the CUDA tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exlpy.errors import ConfigError
from exlpy.kernels import reference
from exlpy.quant.gptq_ref import build_gptq_matrix
from exlpy.quant.layout import QuantMatrix
from exlpy.quant.pack import quantize_gptq
from exlpy.runtime import RuntimeOptions, options, use_options
from tests.conftest import rel_err, requires_cuda
from tests.test_exl2_qmm import (
    MIXED_8B,
    _exl2,
    _exl2_big,
    _groups,
    check_graph_replay,
    check_group,
    check_model_batched_decode,
)

TOL = 2e-3  # exact codes and fp16 x in the dots, fp32 accumulation (rel_err: max |diff| / max |ref|)


def _tc():
    pytest.importorskip("triton")
    from exlpy.kernels import exl2_tc

    return exl2_tc


def _check(x: torch.Tensor, parts: list[QuantMatrix], bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: torch.Tensor | None = None) -> None:
    check_group(_tc().TcGroup, x, parts, bias, residual, norm)


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """BLOCK_N 32 in every class: the small test matrices then have several column blocks (and the interpreter
    works on smaller tiles)."""
    from exlpy.kernels import exl2_tc_plan

    for bm in (16, 32, 64):
        monkeypatch.setitem(exl2_tc_plan.CONFIG, bm, {**exl2_tc_plan.CONFIG[bm], "BLOCK_N": 32})


MIXED = (288, 70, [(8, 32), (6, 32), (5, 64), (4, 64), (3, 32), (2, 64)])


@pytest.mark.interpreter
def test_every_row_count_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row counts across 1-64: each of the three BLOCK_M classes (exl2_tc_plan.block_m) at its first count, one
    inside it and its full height, on a small three-width matrix, split over K (its runs meet in the workspace).
    The kernel is compiled once per class (`do_not_specialize=["M"]`) and the row count only enters through the
    run-time row mask `offs_m < M`: the other counts of a class take these counts' code path (this test ran all
    64 counts, 10 s of the interpreter)."""
    from exlpy.kernels import exl2_tc_plan

    for bm in (16, 32, 64):
        monkeypatch.setitem(exl2_tc_plan.CONFIG, bm, {**exl2_tc_plan.CONFIG[bm], "BLOCK_N": 32, "KB": 1})
    gen = torch.Generator().manual_seed(1)
    qm = _exl2(96, 32, [(6, 32), (4, 32), (3, 32)], gen)
    group = _tc().TcGroup([qm], None)
    x = torch.randn(64, qm.k, generator=gen).half()
    ref = reference.quant_matmul(x, [qm])
    counts = (1, 7, 16, 17, 25, 32, 33, 50, 64)
    assert sorted({exl2_tc_plan.block_m(m) for m in counts}) == [16, 32, 64]
    for m in counts:
        assert rel_err(group.run(x[:m]), ref[:m]) < TOL, m


@pytest.mark.interpreter
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_bit_widths_interpreter(bits: int, small_tiles: None) -> None:
    """Each width alone, at a row count of every BLOCK_M class; groups of 64 rows (two K steps of one group)."""
    gen = torch.Generator().manual_seed(bits)
    qm = _exl2(192, 72, [(bits, 64)] * 3, gen)
    for m in (1, 17, 40):
        _check(torch.randn(m, qm.k, generator=gen).half(), [qm])


@pytest.mark.interpreter
@pytest.mark.parametrize("swap,prefetch,fold,half", [(0, 0, 1, 0), (0, 1, 0, 1), (1, 0, 1, 0), (1, 1, 0, 1)])
def test_launch_variants_interpreter(swap: int, prefetch: int, fold: int, half: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The other orientation (x @ W), the unprefetched loop, scales folded into the weights and HALF's code order
    (here decoded one code at a time: the pairs' PTX runs on GPUs only) give the same products, with KB 1 and 4
    (split-K over a mixed matrix), a stream-K grid, and with no K split (y written directly; a mixed layout then
    cannot be planned)."""
    from exlpy.kernels import exl2_tc_plan

    gen = torch.Generator().manual_seed(10 + swap + 2 * prefetch)
    mixed = _exl2(*MIXED, gen)
    plain = _exl2(256, 64, [(4, 128), (4, 128)], gen)
    for qm, kb, waves, grid in ((mixed, 1, 4, 0), (mixed, 4, 4, 1), (plain, 1, 0, 0)):
        monkeypatch.setitem(exl2_tc_plan.CONFIG, 32, {**exl2_tc_plan.CONFIG[32], "BLOCK_N": 32, "SWAP": swap,
                                                      "PREFETCH": prefetch, "KB": kb, "WAVES": waves, "GRID": grid,
                                                      "FOLD": fold, "HALF": half})
        plan = exl2_tc_plan.plan_for([qm], 32)
        assert plan.split == bool(waves)
        x = torch.randn(20, qm.k, generator=gen).half()
        _check(x, [qm], None, torch.randn(20, qm.n, generator=gen).half())
    with pytest.raises(ValueError, match="workspace"):
        exl2_tc_plan.plan_for([mixed], 32)


@pytest.mark.interpreter
def test_partial_blocks_interpreter(small_tiles: None) -> None:
    """K not a multiple of 32 (the last block has fewer words than bits), odd N, identity row order, a last group
    shorter than the others."""
    gen = torch.Generator().manual_seed(5)
    for k, n, groups in ((116, 100, [(4, 32)] * 3 + [(4, 20)]), (104, 33, [(3, 64), (3, 40)]),
                         (70, 40, [(5, 64), (5, 6)]), (224, 48, [(4, 64), (4, 64), (4, 64), (4, 32)])):
        qm = _exl2(k, n, groups, gen, act_order=False)
        for m in (3, 33):
            _check(torch.randn(m, k, generator=gen).half(), [qm])


@pytest.mark.interpreter
def test_fused_group_interpreter(small_tiles: None) -> None:
    """q|k|v-like group (three layouts, shared act order) in one launch, with RMSNorm, bias and the residual
    added in place, twice (the split-K workspace and counters reset themselves)."""
    tc = _tc()
    gen = torch.Generator().manual_seed(21)
    a = _exl2(160, 70, [(4, 64), (4, 64), (4, 32)], gen)
    parts = [a, _exl2(160, 40, [(6, 32), (4, 96), (3, 32)], gen, perm=a.perm),
             _exl2(160, 33, [(5, 64), (5, 96)], gen, perm=a.perm)]
    bias = torch.randn(143, generator=gen).half()
    norm = (1 + 0.1 * torch.randn(160, generator=gen)).half()
    for m in (4, 40, 4):
        x = torch.randn(m, 160, generator=gen).half() * 3
        _check(x, parts, bias, torch.randn(m, 143, generator=gen).half(), norm)
    ws, cnt = tc._workspace(torch.device("cpu"))
    assert not ws.any() and not cnt.any()


@pytest.mark.interpreter
def test_column_slice_and_fp32_interpreter(small_tiles: None) -> None:
    """Strided column views (tensor-parallel slices taken in a forward pass); fp32 x in, fp32 y out."""
    gen = torch.Generator().manual_seed(9)
    qm = _exl2(116, 100, [(4, 32)] * 3 + [(4, 20)], gen).split_columns(32, 96, copy=False)
    _check(torch.randn(3, qm.k, generator=gen), [qm])


@pytest.mark.interpreter
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_interpreter(act_order: bool, small_tiles: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPTQ 4-bit: per-column zero points folded out as z * sum(x) per step, or (FOLD, with act order here)
    subtracted from every code before its scale."""
    tc = _tc()
    from exlpy.kernels import exl2_tc_plan

    for bm in (16, 32, 64):
        monkeypatch.setitem(exl2_tc_plan.CONFIG, bm, {**exl2_tc_plan.CONFIG[bm], "FOLD": int(act_order)})
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(256, 48, generator=gen)
    t, dq = quantize_gptq(w, 64, gen, act_order)
    qm = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 256, 48, "g")
    for m in (1, 3, 40):
        x = torch.randn(m, 256, generator=gen).half()
        assert rel_err(tc.tc_matmul(x, [qm]), x.float() @ dq) < TOL


@pytest.mark.interpreter
def test_dispatch_interpreter(monkeypatch: pytest.MonkeyPatch, small_tiles: None) -> None:
    """EXLPY_QMM_KERNEL=tc sends the multi-row path (QmmGroup.run, exl2_qmm.qmm, ops.quant_matmul) and single rows
    (instead of the decode GEMV) to this kernel, =qmm keeps exl2_qmm and the GEMV; auto follows TC_ROWS."""
    tc = _tc()
    from exlpy.kernels import exl2_qmm, exl2_tc_plan
    from exlpy.kernels.exl2_gemv import gemv_takes
    from exlpy.kernels.exl2_matmul import exl2_matmul, quant_matmul_cuda

    calls: list[int] = []
    real = tc.run_plan
    monkeypatch.setattr(tc, "run_plan", lambda plan, xg, *a: calls.append(xg.shape[0]) or real(plan, xg, *a))
    gen = torch.Generator().manual_seed(3)
    qm = _exl2(*MIXED, gen)
    x = torch.randn(6, qm.k, generator=gen).half()
    ref = reference.quant_matmul(x, [qm])
    opts = dataclasses.replace(options(), quant_rows=64, gemv_rows=0)
    with use_options(dataclasses.replace(opts, qmm_kernel="tc")):
        assert rel_err(exl2_qmm.QmmGroup([qm], None).run(x), ref) < TOL
        assert rel_err(exl2_qmm.qmm(x, [qm]), ref) < TOL
        assert rel_err(quant_matmul_cuda(x, [qm]), ref) < TOL
        # one row too: the decode GEMV steps aside
        assert not gemv_takes(1, qm.n, qm.k) and gemv_takes(1, qm.n)
        assert rel_err(quant_matmul_cuda(x[:1], [qm]), ref[:1]) < TOL
        assert rel_err(exl2_matmul(x[:1], qm), ref[:1]) < TOL
    assert calls == [6, 6, 6, 1, 1]
    with use_options(dataclasses.replace(opts, qmm_kernel="qmm")):
        assert rel_err(exl2_qmm.QmmGroup([qm], None).run(x), ref) < TOL
        assert gemv_takes(1, qm.n, qm.k)
    assert calls == [6, 6, 6, 1, 1]
    monkeypatch.setitem(exl2_tc_plan.TC_ROWS, (qm.k, qm.n), (4, 8))
    with use_options(dataclasses.replace(opts, qmm_kernel="auto")):
        group = exl2_qmm.QmmGroup([qm], None)
        assert rel_err(group.run(x), ref) < TOL and calls == [6, 6, 6, 1, 1, 6]
        assert rel_err(group.run(x[:3]), ref[:3]) < TOL and calls == [6, 6, 6, 1, 1, 6]


def test_kernel_option() -> None:
    """EXLPY_QMM_KERNEL: qmm by default until exl2_tc's latest code has run on a GPU (auto: exl2_tc for the rows
    TC_ROWS names); a bad value is a ConfigError naming the variable and the choices."""
    from exlpy.kernels import exl2_tc_plan as tp

    assert RuntimeOptions.from_env({}).qmm_kernel == "qmm"
    assert RuntimeOptions.from_env({"EXLPY_QMM_KERNEL": "tc"}).qmm_kernel == "tc"
    with pytest.raises(ConfigError, match="EXLPY_QMM_KERNEL.*auto, qmm, tc"):
        RuntimeOptions.from_env({"EXLPY_QMM_KERNEL": "fast"})
    with use_options(RuntimeOptions.from_env({"EXLPY_QMM_KERNEL": "tc"})):
        assert tp.takes(1, 4096, 4096) and tp.takes(64, 4096, 4096) and not tp.takes(65, 4096, 4096)
    with use_options(RuntimeOptions.from_env({"EXLPY_QMM_KERNEL": "qmm"})):
        assert not tp.takes(8, 4096, 4096)
    # auto: the measured rows (5-32 on every shape); groups build the kernel's plans only where it may run
    with use_options(RuntimeOptions.from_env({"EXLPY_QMM_KERNEL": "auto"})):
        assert tp.wanted() and tp.takes(5, 4096, 4096) and tp.takes(32, 4096, 14336)
        assert not tp.takes(4, 4096, 4096) and not tp.takes(33, 4096, 4096) and not tp.takes(1, 4096, 4096)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tp, "TC_ROWS", {})
            assert not tp.wanted() and not tp.takes(8, 4096, 4096)
    with use_options(RuntimeOptions.from_env({"EXLPY_QMM_KERNEL": "qmm"})):
        assert not tp.wanted()
    with use_options(RuntimeOptions.from_env({"EXLPY_QMM_KERNEL": "tc"})):
        assert tp.wanted()


@pytest.mark.parametrize("grid", [0, 3])
def test_plan_runs_and_steps(grid: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's tasks (one program per task of whole groups, or stream-K: `grid` programs per SM with equal
    shares of K steps): every (column block, row) covered exactly once, tasks starting on a K step with the right
    group and rows left in it, steps that never cross a group boundary, arrival counts right, shares balanced."""
    pytest.importorskip("triton")
    from exlpy.kernels import exl2_tc_plan as tp

    gen = torch.Generator().manual_seed(2)
    # converter-like: 8-bit 32-row groups, 4-bit 128-row groups, 3-bit 128-row groups, last group cut at K
    groups = [(8, 32)] * 3 + [(4, 128)] * 5 + [(3, 128)] * 2 + [(3, 96)]
    qm = _exl2(sum(r for _, r in groups), 96, groups, gen)
    for bm in (16, 32, 64):
        monkeypatch.setitem(tp.CONFIG, bm, {**tp.CONFIG[bm], "BLOCK_N": 32, "GRID": grid})
        plan = tp.plan_for([qm], bm)
        (ln,) = plan.launches
        rows = ln.tasks.tolist()
        f = {name: i for i, name in enumerate(tp.FIELDS)}
        assert ln.widths == (1 << 8) | (1 << 4) | (1 << 3)
        kb = {b: (ln.kbs >> (5 * (b - 2))) & 31 for b in (8, 4, 3)}
        assert kb[8] == 1 and 128 % (32 * kb[4]) == 0 and 128 % (32 * kb[3]) == 0
        cover: dict[int, list[tuple[int, int]]] = {}
        gr = qm.layout.group_rows
        for r in rows:
            lo, hi = r[f["xr0"]] + r[f["r0"]], r[f["xr0"]] + r[f["r1"]]
            g = r[f["g0"]]
            assert gr[g] <= lo < gr[g + 1] and r[f["left0"]] == gr[g + 1] - lo
            assert (lo - gr[g]) % (32 * kb[r[f["bits"]]]) == 0  # on a K step of its group
            assert r[f["arrivals"]] == sum(1 for q in rows if q[f["cnt"]] == r[f["cnt"]])
            cover.setdefault(r[f["cb"]], []).append((lo, hi))
        assert sorted(cover) == [0, 1, 2]
        for spans in cover.values():
            spans.sort()
            assert spans[0][0] == 0 and spans[-1][1] == qm.k
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        if grid:
            ranges = ln.ranges.tolist()
            assert ln.grid == grid * 2 and ranges[0] == 0 and ranges[-1] == len(rows)  # 2 "SMs" on the CPU
            assert all(a <= b for a, b in zip(ranges, ranges[1:]))

            cost = [-(-(r[f["r1"]] - r[f["r0"]]) // (32 * kb[r[f["bits"]]])) * (kb[r[f["bits"]]] * r[f["bits"]]
                                                                                  + tp.STEP_COST) for r in rows]
            shares = [sum(cost[a:b]) for a, b in zip(ranges, ranges[1:])]
            assert max(shares) - min(shares) <= 2 * max(kb[b] * b + tp.STEP_COST for b in kb), shares
        else:
            assert ln.ranges is None and ln.grid == len(rows)


def test_runs_of_group_sizes() -> None:
    """A segment whose group size changes is cut into runs; the matrix's short last group ends the last run."""
    from exlpy.kernels.exl2_tc_plan import _runs

    gen = torch.Generator().manual_seed(4)
    qm = _exl2(416, 32, [(4, 64), (4, 64), (4, 128), (4, 128), (4, 32)], gen)
    runs = _runs(qm.layout)
    assert [(r.g_lo, r.g_hi, r.gsz) for r in runs] == [(0, 2, 64), (2, 5, 128)]


# --- 65-256 rows (prompt chunks, EXLPY_TC_MAX_ROWS) -----------------------------------------------------------

WIDE = dataclasses.replace(RuntimeOptions(), tc_max_rows=256)


@pytest.fixture
def wide_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 128- and 256-row classes at interpreter size: BLOCK_N 32, 4 warps, KB 1, row tiles of 64 rows (a
    256-row chunk is 4 tiles on the grid's second axis)."""
    from exlpy.kernels import exl2_tc_plan

    for bm in (16, 32, 64):
        monkeypatch.setitem(exl2_tc_plan.CONFIG, bm, {**exl2_tc_plan.CONFIG[bm], "BLOCK_N": 32})
    for bm in (128, 256):
        monkeypatch.setitem(exl2_tc_plan.CONFIG, bm, {**exl2_tc_plan.CONFIG[bm], "BLOCK_N": 32, "WARPS": 4, "KB": 1,
                                                      "TILE_M": 64})


@pytest.mark.interpreter
def test_wide_rows_interpreter(wide_tiles: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """65-256 rows on the converter's six widths (2-8 bit groups, act order) split over K: several row tiles, a
    partial last tile (65, 200 rows), a tile count below the class's (129 rows: 3 tiles in the 256 class); then
    one dot over all rows of a chunk (TILE_M = the class), and a plan without a K split (y written directly).
    The 1-64-row classes keep their launches (one grid axis). The row count enters only through the tile count
    and the run-time row mask, so these counts stand for the others (the interpreter costs ~1 s per tile)."""
    tc = _tc()
    from exlpy.kernels import exl2_tc_plan

    gen = torch.Generator().manual_seed(65)
    qm = _exl2(192, 40, [(8, 32), (6, 32), (5, 32), (4, 32), (3, 32), (2, 32)], gen)
    x = torch.randn(200, qm.k, generator=gen).half()
    ref = reference.quant_matmul(x, [qm])
    launched: list[tuple[int, int]] = []
    real = tc._tc

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]) -> object:
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(tc, "_tc", Spy())
    with use_options(WIDE):
        group = tc.TcGroup([qm], None)
        assert group.plan(128).split and group.plan(256).tile == 64
        for m in (65, 129, 200):
            launched.clear()
            assert rel_err(group.run(x[:m]), ref[:m]) < TOL, m
            assert [g[1] for g in launched] == [-(-m // 64)], (m, launched)
        launched.clear()
        assert rel_err(group.run(x[:40]), ref[:40]) < TOL and [len(g) for g in launched] == [1]
        for bm in (128, 256):  # the default row tile: one dot over 128 rows (200 rows: two tiles)
            monkeypatch.setitem(exl2_tc_plan.CONFIG, bm, {**exl2_tc_plan.CONFIG[bm], "TILE_M": 128})
        launched.clear()
        assert rel_err(group.run(x[:90]), ref[:90]) < TOL
        assert rel_err(group.run(x[:200]), ref[:200]) < TOL and [g[1] for g in launched] == [1, 2]
        plain = _exl2(256, 64, [(4, 128), (4, 128)], gen)
        monkeypatch.setitem(exl2_tc_plan.CONFIG, 256, {**exl2_tc_plan.CONFIG[256], "WAVES": 0})
        whole = tc.TcGroup([plain], None)
        assert not whole.plan(256).split
        xp = torch.randn(140, plain.k, generator=gen).half()
        assert rel_err(whole.run(xp), reference.quant_matmul(xp, [plain])) < TOL
    ws, cnt = tc._wide_workspace(torch.device("cpu"))
    assert not ws.any() and not cnt.any()


@pytest.mark.interpreter
def test_wide_fused_group_interpreter(wide_tiles: None) -> None:
    """A q|k|v-like group (three layouts, shared act order) at 70 and 150 rows with RMSNorm, bias and the residual
    added in place (the second product finds the wide workspace and its counters reset by the first), and GPTQ
    with act order (scales folded into the weights, as the wide classes do by default)."""
    tc = _tc()
    gen = torch.Generator().manual_seed(66)
    a = _exl2(160, 70, [(4, 64), (4, 64), (4, 32)], gen)
    parts = [a, _exl2(160, 40, [(6, 32), (4, 96), (3, 32)], gen, perm=a.perm),
             _exl2(160, 33, [(5, 64), (5, 96)], gen, perm=a.perm)]
    bias = torch.randn(143, generator=gen).half()
    norm = (1 + 0.1 * torch.randn(160, generator=gen)).half()
    with use_options(WIDE):
        for m in (70, 150):
            x = torch.randn(m, 160, generator=gen).half() * 3
            _check(x, parts, bias, torch.randn(m, 143, generator=gen).half(), norm)
        w = torch.randn(256, 48, generator=gen)
        t, dq = quantize_gptq(w, 64, gen, True)
        g = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 256, 48, "g")
        x = torch.randn(97, 256, generator=gen).half()
        assert rel_err(tc.tc_matmul(x, [g]), x.float() @ dq) < TOL
    ws, cnt = tc._wide_workspace(torch.device("cpu"))
    assert not ws.any() and not cnt.any()


@pytest.mark.interpreter
def test_wide_dispatch_interpreter(wide_tiles: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """EXLPY_TC_MAX_ROWS: 65-N rows of the multi-row entry points (QmmGroup.run, exl2_qmm.qmm, ops.quant_matmul,
    exl2_matmul) run this kernel whatever EXLPY_QMM_KERNEL says for 2-64; past N, at or past the shape's
    CROSSOVER, and by default (64) they dequantize for cuBLAS; a group whose wide plans cannot be made falls back
    to dequantize + cuBLAS too."""
    tc = _tc()
    from exlpy.kernels import exl2_qmm, exl2_qmm_plan
    from exlpy.kernels.exl2_matmul import exl2_matmul, quant_matmul_cuda

    calls: list[int] = []
    real = tc.run_plan
    monkeypatch.setattr(tc, "run_plan", lambda plan, xg, *a: calls.append(xg.shape[0]) or real(plan, xg, *a))
    gen = torch.Generator().manual_seed(67)
    qm = _exl2(96, 40, [(6, 32), (4, 32), (3, 32)], gen)
    x = torch.randn(160, qm.k, generator=gen).half()
    ref = reference.quant_matmul(x, [qm])
    with use_options(dataclasses.replace(WIDE, tc_max_rows=160)):
        group = exl2_qmm.QmmGroup([qm], None)
        assert group.tc is not None
        assert rel_err(group.run(x), ref) < TOL
        assert rel_err(exl2_qmm.qmm(x[:100], [qm]), ref[:100]) < TOL
        assert rel_err(quant_matmul_cuda(x[:70], [qm]), ref[:70]) < TOL
        assert rel_err(exl2_matmul(x[:80], qm), ref[:80]) < TOL
        assert calls == [160, 100, 70, 80]
        assert not exl2_qmm_plan.rows_kernel_takes(161, qm.k, qm.n)
        monkeypatch.setitem(exl2_qmm_plan.CROSSOVER, (qm.k, qm.n), 120)
        assert rel_err(quant_matmul_cuda(x[:130], [qm]), ref[:130]) < TOL  # cuBLAS from 120 rows on
        assert rel_err(quant_matmul_cuda(x[:119], [qm]), ref[:119]) < TOL
        assert calls == [160, 100, 70, 80, 119]
        monkeypatch.delitem(exl2_qmm_plan.CROSSOVER, (qm.k, qm.n))
        group.tc = None  # as when the tensor-core plans could not be made
        assert rel_err(group.run(x[:90]), ref[:90]) < TOL and len(calls) == 5
    with use_options(RuntimeOptions()):
        assert not exl2_qmm_plan.rows_kernel_takes(65, qm.k, qm.n)
        assert rel_err(quant_matmul_cuda(x[:70], [qm]), ref[:70]) < TOL and len(calls) == 5


def test_wide_option_and_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """EXLPY_TC_MAX_ROWS parses into tc_max_rows (64-256, a ConfigError naming it otherwise) and opens the 128- and
    256-row classes; their plans cut rows into TILE_M tiles, count arrivals per tile (counters per tile = the
    plan's column blocks), aim the K split at WAVES per SM over all tiles and use the wide workspace's
    bounds; the 1-64-row plans stay as they were (one tile of the class's rows)."""
    pytest.importorskip("triton")
    from exlpy.kernels import exl2_tc_plan as tp

    assert RuntimeOptions.from_env({}).tc_max_rows == 64
    assert RuntimeOptions.from_env({"EXLPY_TC_MAX_ROWS": "192"}).tc_max_rows == 192
    for bad in ("32", "257"):
        with pytest.raises(ConfigError, match="EXLPY_TC_MAX_ROWS"):
            RuntimeOptions.from_env({"EXLPY_TC_MAX_ROWS": bad})
    assert [tp.block_m(m) for m in (64, 65, 128, 129, 256)] == [64, 128, 128, 256, 256]
    with use_options(RuntimeOptions()):
        assert tp.wide_classes() == () and not tp.takes(65, 4096, 4096)
    with use_options(RuntimeOptions.from_env({"EXLPY_TC_MAX_ROWS": "128"})):
        assert tp.wide_classes() == (128,) and tp.wanted()
        assert tp.takes(65, 4096, 4096) and tp.takes(128, 4096, 4096) and not tp.takes(129, 4096, 4096)
    with use_options(RuntimeOptions.from_env({"EXLPY_TC_MAX_ROWS": "256", "EXLPY_QMM_KERNEL": "qmm"})):
        assert tp.wide_classes() == (128, 256) and tp.wanted() and tp.takes(256, 4096, 4096)
        assert not tp.takes(8, 4096, 4096)
        monkeypatch.setitem(tp._qmm_plan.CROSSOVER, (4096, 4096), 192)
        assert tp.takes(191, 4096, 4096) and not tp.takes(192, 4096, 4096) and tp.takes(192, 4096, 6144)
    gen = torch.Generator().manual_seed(68)
    groups = [(8, 32)] * 3 + [(4, 128)] * 5 + [(3, 128)] * 3
    qm = _exl2(sum(r for _, r in groups), 96, groups, gen)
    for bm in (16, 32, 64, 128, 256):
        monkeypatch.setitem(tp.CONFIG, bm, {**tp.CONFIG[bm], "BLOCK_N": 32})
    narrow = tp.plan_for([qm], 64)
    assert narrow.tile == 64 and narrow.counters == 3
    f = {name: i for i, name in enumerate(tp.FIELDS)}
    programs = {}
    for bm, tile in ((128, 64), (256, 64), (256, 128), (256, 256), (128, 128)):
        monkeypatch.setitem(tp.CONFIG, bm, {**tp.CONFIG[bm], "TILE_M": tile, "WAVES": 8})
        plan = tp.plan_for([qm], bm)
        (ln,) = plan.launches
        assert plan.tile == tile and plan.counters == 3 and plan.split
        rows = ln.tasks.tolist()
        for cb in range(3):  # every column block's K covered once, whatever the tiles
            spans = sorted((r[f["xr0"]] + r[f["r0"]], r[f["xr0"]] + r[f["r1"]]) for r in rows if r[f["cb"]] == cb)
            assert spans[0][0] == 0 and spans[-1][1] == qm.k and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        programs[(bm, tile)] = ln.programs
    # WAVES per SM (2 "SMs" on the CPU) over all row tiles: fewer K pieces per column block where there are more
    assert programs[(256, 64)] < programs[(256, 128)] < programs[(256, 256)]
    assert programs[(128, 64)] == programs[(256, 128)]
    # a product wider than the wide workspace's 256 rows allow runs unsplit (one program per column block)
    monkeypatch.setattr(tp, "WIDE_WS_ELEMS", 256 * 95)
    tp._plan_cached.cache_clear()
    with pytest.raises(ValueError, match="workspace"):
        tp.plan_for([qm], 256)


# --- CUDA ---------------------------------------------------------------------------------------------------

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mix", [[(4, 1.0)], MIXED_8B, [(6, 0.1), (5, 0.2), (3, 0.5), (2, 0.2)]])
def test_real_shapes_cuda(shape: tuple[int, int], mix: list[tuple[int, float]]) -> None:
    """8B shapes against the dequantized fp16 matmul, row counts across 1-64, each five times (a split-K epilogue
    race would show only now and then)."""
    tc = _tc()
    from exlpy.quant.exl2_ref import dequant_dense

    k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    qm = _exl2_big(k, n, _groups(k, mix), gen)
    w = dequant_dense(qm).cuda().half()
    group = tc.TcGroup([qm.to("cuda")], None)
    for m in (1, 2, 5, 8, 16, 17, 32, 33, 64):
        x = torch.randn(m, k, generator=gen).half().cuda()
        ref = x.float() @ w.float()
        for _ in range(5):
            assert rel_err(group.run(x), ref) < TOL, m


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("swap,prefetch,grid,fold,half", [(0, 1, 0, 0, 0), (1, 0, 0, 0, 0), (0, 0, 0, 1, 0),
                                                          (1, 1, 2, 0, 0), (1, 1, 3, 1, 0), (1, 1, 0, 0, 1),
                                                          (0, 1, 2, 0, 1)])
def test_launch_variants_cuda(swap: int, prefetch: int, grid: int, fold: int, half: int,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch-table alternatives a sweep may pick (orientation, prefetch, stream-K grid, folded scales, 4- and
    8-bit pairs decoded by f16x2 PTX) give the same products on the GPU, repeatedly (the split-K epilogue)."""
    tc = _tc()
    from exlpy.kernels import exl2_tc_plan
    from exlpy.quant.exl2_ref import dequant_dense

    gen = torch.Generator().manual_seed(99)
    qm = _exl2_big(4096, 4096, _groups(4096, [(8, 0.1), (5, 0.1), (4, 0.6), (3, 0.2)]), gen)
    w = dequant_dense(qm).cuda().float()
    for bm in (16, 32, 64):
        monkeypatch.setitem(exl2_tc_plan.CONFIG, bm, {**exl2_tc_plan.CONFIG[bm], "SWAP": swap, "PREFETCH": prefetch,
                                                      "GRID": grid, "FOLD": fold, "HALF": half})
    group = tc.TcGroup([qm.to("cuda")], None)
    for m in (1, 3, 24, 64):
        x = torch.randn(m, 4096, generator=gen).half().cuda()
        for _ in range(3):
            assert rel_err(group.run(x), x.float() @ w) < TOL, m


@requires_cuda
@pytest.mark.gpu
def test_gptq_real_shape_cuda() -> None:
    tc = _tc()
    gen = torch.Generator().manual_seed(17)
    w = torch.randn(4096, 2048, generator=gen) * 0.02
    t, dq = quantize_gptq(w, 128, gen, True)
    qm = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 4096, 2048, "g").to("cuda")
    for m in (1, 8, 31, 64):
        x = torch.randn(m, 4096, generator=gen).half()
        assert rel_err(tc.tc_matmul(x.cuda(), [qm]), x.float() @ dq) < TOL, m


@requires_cuda
@pytest.mark.gpu
def test_graph_replay_cuda() -> None:
    """q|k|v at 8B shapes (mixed widths, bias, norm) and down_proj with the residual added in place, captured once
    per row count and replayed with new inputs."""
    check_graph_replay(_tc().TcGroup)


@requires_cuda
@pytest.mark.gpu
def test_model_batched_decode_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A converter-written EXL2 model decoding 4 rows (graph step), then verifying 4 tokens per row (16 rows), with
    EXLPY_QMM_KERNEL=tc, runs this kernel and matches the fp32 CPU model's logits."""
    check_model_batched_decode(monkeypatch, _tc(),
                               dataclasses.replace(options(), quant_rows=64, gemv_rows=0, qmm_kernel="tc"))


WIDE_ROWS = (65, 96, 128, 129, 192, 256)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mix", [[(4, 1.0)], MIXED_8B, [(8, 0.1), (6, 0.1), (5, 0.2), (3, 0.4), (2, 0.2)], None])
def test_wide_rows_cuda(shape: tuple[int, int], mix: list[tuple[int, float]] | None) -> None:
    """65-256 rows (EXLPY_TC_MAX_ROWS=256) at 8B shapes, act order, uniform 4-bit and mixed 2-8 bit groups (None:
    as the converter writes down_proj, 8-bit 32-row groups then 4- and 3-bit 128-row ones), against the
    dequantized fp16 matmul, each three times (split-K epilogue per row tile)."""
    tc = _tc()
    from exlpy.quant.exl2_ref import dequant_dense

    k, n = shape
    gen = torch.Generator().manual_seed(k + n + 256)
    groups = _groups(k, mix) if mix else _groups(512, [(8, 1.0)], 32) + _groups(k - 512, [(4, 0.3), (3, 0.7)])
    qm = _exl2_big(k, n, groups, gen)
    w = dequant_dense(qm).cuda().float()
    with use_options(WIDE):
        group = tc.TcGroup([qm.to("cuda")], None)
        for m in WIDE_ROWS:
            x = torch.randn(m, k, generator=gen).half().cuda()
            ref = x.float() @ w
            for _ in range(3):
                assert rel_err(group.run(x), ref) < TOL, m


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("over", [{"TILE_M": 64}, {"TILE_M": 64, "BLOCK_N": 64, "WARPS": 4},
                                  {"BLOCK_N": 64, "WARPS": 8, "KB": 2}, {"HALF": 1}, {"GRID": 2}, {"WAVES": 0}])
def test_wide_launch_variants_cuda(over: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The 65-256-row launch-table alternatives benchmarks/exl2_speed.py --parts wide times (64-row tiles,
    narrower column blocks, f16x2 pairs, stream-K, no K split) give the same products, with the residual added in
    place and a bias."""
    tc = _tc()
    from exlpy.kernels import exl2_tc_plan
    from exlpy.quant.exl2_ref import dequant_dense

    gen = torch.Generator().manual_seed(257)
    qm = _exl2_big(4096, 4096, _groups(4096, [(8, 0.1), (5, 0.1), (4, 0.6), (3, 0.2)]), gen)
    w = dequant_dense(qm).cuda().float()
    for bm in (128, 256):
        monkeypatch.setitem(exl2_tc_plan.CONFIG, bm, {**exl2_tc_plan.CONFIG[bm], **over})
    bias = torch.randn(4096, generator=gen).half().cuda()
    with use_options(WIDE):
        group = tc.TcGroup([qm.to("cuda")], bias)
        for m in (96, 200):
            x = torch.randn(m, 4096, generator=gen).half().cuda()
            res = torch.randn(m, 4096, generator=gen).half().cuda()
            ref = x.float() @ w + bias.float() + res.float()
            for _ in range(2):
                assert rel_err(group.run(x, res.clone()), ref) < TOL, m


@requires_cuda
@pytest.mark.gpu
def test_wide_gptq_and_graph_cuda() -> None:
    """GPTQ 4-bit with act order at 65-256 rows, and a 128-row product captured in a CUDA graph and replayed
    with new inputs (the prompt chunks the generator captures)."""
    tc = _tc()
    gen = torch.Generator().manual_seed(258)
    w = torch.randn(4096, 2048, generator=gen) * 0.02
    t, dq = quantize_gptq(w, 128, gen, True)
    qm = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 4096, 2048, "g").to("cuda")
    with use_options(WIDE):
        for m in WIDE_ROWS:
            x = torch.randn(m, 4096, generator=gen).half()
            assert rel_err(tc.tc_matmul(x.cuda(), [qm]), x.float() @ dq) < TOL, m
        group = tc.TcGroup([qm], None)
        x = torch.randn(128, 4096, generator=gen).half().cuda()
        group.run(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = group.run(x)
        for _ in range(3):
            x.copy_(torch.randn(128, 4096, generator=gen).half())
            graph.replay()
            assert rel_err(y, x.float().cpu() @ dq) < TOL


@requires_cuda
@pytest.mark.gpu
def test_model_prompt_chunk_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A converter-written EXL2 model (mixed widths, act order) with EXLPY_TC_MAX_ROWS=256: a 2 x 100-token prompt
    (200 rows per projection) runs this kernel, not dequantize + cuBLAS, and matches the fp32 CPU model's logits."""
    from exlpy import ExLlamaV2, ExLlamaV2Config
    from tests.conftest import logits_tol, shared_path

    tc = _tc()
    calls: list[int] = []
    real = tc.run_plan
    monkeypatch.setattr(tc, "run_plan", lambda plan, xg, *a: calls.append(xg.shape[0]) or real(plan, xg, *a))
    d = shared_path("models", "smollm2-135m-exl2-4.0")
    cpu = ExLlamaV2(ExLlamaV2Config(str(d)))
    cpu.load(device="cpu")
    ids = torch.randint(0, 1000, (2, 100), generator=torch.Generator().manual_seed(0))
    want = cpu.forward(ids)
    del cpu
    with use_options(dataclasses.replace(options(), tc_max_rows=256)):
        model = ExLlamaV2(ExLlamaV2Config(str(d)))
        model.load()
        got = model.forward(ids)
    assert 200 in calls
    assert rel_err(got, want) <= logits_tol(model, 1e-3)


@pytest.mark.slow
def test_tc_compiles_for_sm90() -> None:
    """Every width, a mixed launch, BLOCK_M 16/32/64 and GPTQ compile for an H100 (sm_90a) without a GPU: no
    register spills, tensor cores in the K loop, every split-K partial sum taken back atomically. The 65-256-row
    classes' one dot over 128 rows sits at the register limit: spills only outside the K loop (set-up and
    epilogue, once per program), none inside it; their 64-row tiles none at all."""
    pytest.importorskip("triton")
    from tests.conftest import run_compile_check

    res = run_compile_check("tc_compile_check.py")
    assert {"exl2 2-bit M16", "exl2 8-bit M16", "exl2 8+4+3-bit M16", "exl2 4-bit M64", "gptq 4-bit M16",
            "exl2 4-bit M128", "exl2 4-bit M256", "exl2 8+4+3-bit M256", "gptq 4-bit M256"} <= set(res)
    for name, v in res.items():
        wide_dot = ("M128" in name or "M256" in name) and "tile64" not in name
        assert 0 < v["regs"] <= 255 and v["shared"] <= 227 * 1024, (name, v)
        assert v["spill_bytes"] == 0 or (wide_dot and v["spill_bytes"] <= 1024), (name, v)
        assert v["loop"]["STL"] == 0 and v["loop"]["LDL"] == 0, (name, v["loop"])
        assert v["loop"]["HGMMA"] + v["loop"]["HMMA"] > 0, (name, v["loop"])
        if "whole" not in name:
            assert v["split_k"]["add"] > 0 and v["split_k"]["exch"] == v["split_k"]["add"], (name, v["split_k"])
