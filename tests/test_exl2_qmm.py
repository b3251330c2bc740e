"""The multi-row quantized matmul (exlpy/kernels/exl2_qmm.py, 2-64 rows) against the torch reference
(`reference.quant_matmul`): every row count class, every EXL2 bit width and a mixed matrix, act order, fused
groups with bias / residual / RMSNorm, GPTQ, split-K, and its dispatch. CPU interpreter at small shapes; CUDA at
an 8B model's shapes, under CUDA graphs, and inside a quantized model's batched decode.

Tests marked `interpreter` run Triton's interpreter on CPU tensors: tests/conftest.py runs them in a child pytest
with TRITON_INTERPRET=1, so this session keeps compiled kernels for the CUDA tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from exlpy.errors import ConfigError
from exlpy.kernels import ops, reference
from exlpy.quant.exl2_ref import build_exl2_matrix
from exlpy.quant.gptq_ref import build_gptq_matrix
from exlpy.quant.layout import QuantMatrix
from exlpy.quant.pack import quantize_gptq, random_exl2
from exlpy.runtime import RuntimeOptions, options, use_options
from tests.conftest import rel_err, requires_cuda, shared_path

TOL = 2e-3  # fp16 weights and x in the dots, fp32 accumulation (rel_err: max |diff| / max |ref|)


@pytest.fixture(autouse=True)
def _qmm_kernel():
    """These tests are exl2_qmm's: EXLPY_QMM_KERNEL=qmm keeps the rows exl2_tc would take by default (5-32,
    exl2_tc_plan.TC_ROWS) on it (exl2_tc has its own tests, tests/test_exl2_tc.py)."""
    with use_options(dataclasses.replace(options(), qmm_kernel="qmm")):
        yield


def _fused_rows() -> RuntimeOptions:
    """This session's options with the multi-row kernel taking 2-64 rows (EXLPY_QUANT_ROWS=64; the default 0 keeps
    it off until its GPU tests pass): for tests that reach the kernel through the model's dispatch."""
    return dataclasses.replace(options(), quant_rows=64)


def _exl2(k: int, n: int, groups: list[tuple[int, int]], gen: torch.Generator, act_order: bool = True,
          perm: torch.Tensor | None = None) -> QuantMatrix:
    t = random_exl2(k, n, groups, gen, act_order=act_order)
    qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], k, n, "t")
    return qm if perm is None else dataclasses.replace(qm, perm=perm)  # as q/k/v of one layer share act order


def _qmm():
    pytest.importorskip("triton")
    from exlpy.kernels import exl2_qmm

    return exl2_qmm


def check_group(group: Callable[[list[QuantMatrix], torch.Tensor | None], Any], x: torch.Tensor,
                parts: list[QuantMatrix], bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                norm: torch.Tensor | None = None) -> None:
    """group(parts, bias).run(x, residual, norm) (a QmmGroup, a TcGroup) against reference.quant_matmul: in x's
    dtype, added into `residual` in place when given, within TOL. Also tests/test_exl2_tc.py's."""
    ref = reference.quant_matmul(x, parts, bias, None if residual is None else residual.clone(), norm, 1e-5)
    y = group(parts, bias).run(x, residual, norm, 1e-5)
    if residual is not None:
        assert y is residual  # added in place
    assert y.shape == (x.shape[0], sum(p.n for p in parts)) and y.dtype == x.dtype
    assert rel_err(y, ref) < TOL, (x.shape, [p.layout.group_bits[:3] for p in parts])


def _check(x: torch.Tensor, parts: list[QuantMatrix], bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: torch.Tensor | None = None) -> None:
    check_group(_qmm().QmmGroup, x, parts, bias, residual, norm)


# (K, N, groups): small shapes; groups of whole 32-row blocks, as the converter writes them
WIDTHS = {b: (96, 72, [(b, 32)] * 3) for b in (2, 3, 4, 5, 6, 8)}
MIXED = (288, 70, [(8, 32), (6, 32), (5, 64), (4, 64), (3, 32), (2, 64)])


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 16, 17, 33, 64])
def test_row_counts_interpreter(m: int) -> None:
    """Every BLOCK_M class (16 / 32 / 64) at its edges, on a mixed 2-8 bit matrix (one launch, six widths)."""
    gen = torch.Generator().manual_seed(100 + m)
    qm = _exl2(*MIXED, gen)
    _check(torch.randn(m, qm.k, generator=gen).half(), [qm])


@pytest.mark.interpreter
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_bit_widths_interpreter(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    qm = _exl2(*WIDTHS[bits], gen)
    for m in (2, 17):
        _check(torch.randn(m, qm.k, generator=gen).half(), [qm])


@pytest.mark.interpreter
def test_partial_last_block_no_act_order_interpreter() -> None:
    """K not a multiple of 32 (the last block has fewer words than bits), odd N, identity row order."""
    gen = torch.Generator().manual_seed(5)
    for k, n, groups in ((116, 100, [(4, 32)] * 3 + [(4, 20)]), (104, 33, [(3, 64), (3, 40)]),
                         (70, 40, [(5, 64), (5, 6)])):
        qm = _exl2(k, n, groups, gen, act_order=False)
        assert qm.perm is not None  # the loader keeps an identity permutation: the gather then is a plain copy
        _check(torch.randn(5, k, generator=gen).half(), [qm])


@pytest.mark.interpreter
def test_fused_group_interpreter() -> None:
    """q|k|v-like group (three layouts, shared act order) in one launch, with RMSNorm, bias and the residual
    added in place, twice in a row (the split-K workspace and counters reset themselves)."""
    qmm = _qmm()
    gen = torch.Generator().manual_seed(21)
    a = _exl2(160, 70, [(4, 64), (4, 64), (4, 32)], gen)
    parts = [a, _exl2(160, 40, [(6, 32), (4, 96), (3, 32)], gen, perm=a.perm),
             _exl2(160, 33, [(5, 64), (5, 96)], gen, perm=a.perm)]
    plan = qmm.plan_for(parts, a.perm)
    assert plan.split and len(plan.launches) == 1 and plan.launches[0].widths == (1 << 3) | (1 << 4) | (1 << 5) | (
        1 << 6)
    bias = torch.randn(143, generator=gen).half()
    norm = (1 + 0.1 * torch.randn(160, generator=gen)).half()
    for m in (4, 40):
        x = torch.randn(m, 160, generator=gen).half() * 3
        _check(x, parts, bias, torch.randn(m, 143, generator=gen).half(), norm)
    ws, cnt = qmm._workspace(torch.device("cpu"))
    assert not ws.any() and not cnt.any()


@pytest.mark.interpreter
def test_launch_variants_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """One launch per width (ONE_LAUNCH 0); one program per column block running every segment of a mixed
    matrix (no K split: y written directly, as for a vocabulary-wide head whose columns the split-K workspace
    cannot hold); all give the same products."""
    qmm = _qmm()
    from exlpy.kernels import exl2_qmm_plan

    gen = torch.Generator().manual_seed(8)
    qm = _exl2(*MIXED, gen)
    x = torch.randn(6, qm.k, generator=gen).half()
    bias = torch.randn(qm.n, generator=gen).half()
    res = torch.randn(6, qm.n, generator=gen).half()
    monkeypatch.setitem(qmm.CONFIG, "ONE_LAUNCH", 0)
    plan = qmm.plan_for([qm], qm.perm)
    assert plan.split and sorted(ln.widths for ln in plan.launches) == [1 << b for b in (2, 3, 4, 5, 6, 8)]
    _check(x, [qm], bias)
    monkeypatch.setitem(qmm.CONFIG, "ONE_LAUNCH", 1)
    monkeypatch.setattr(exl2_qmm_plan, "WS_ELEMS", 64 * qm.n - 1)  # too small for this product: no split-K
    plan = qmm.plan_for([qm], qm.perm)
    assert not plan.split and plan.launches[0].programs == 1 and len(plan.segments) == len(qm.layout.segments)
    _check(x, [qm], bias, res)
    monkeypatch.setattr(exl2_qmm_plan, "WS_ELEMS", 1 << 21)
    monkeypatch.setitem(qmm.CONFIG, "WAVES", 0)
    monkeypatch.setitem(qmm.CONFIG, "BLOCK_N_16", 32)
    plan = qmm.plan_for([qm], qm.perm)
    assert not plan.split and plan.launches[0].programs == 3  # three column blocks, each whole
    _check(x, [qm], None, res)


@pytest.mark.interpreter
def test_column_slice_and_fp32_interpreter() -> None:
    """Strided column views (tensor-parallel slices taken in a forward pass); fp32 x in, fp32 y out."""
    gen = torch.Generator().manual_seed(9)
    qm = _exl2(116, 100, [(4, 32)] * 3 + [(4, 20)], gen).split_columns(32, 96, copy=False)
    _check(torch.randn(3, qm.k, generator=gen), [qm])


@pytest.mark.interpreter
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_interpreter(act_order: bool) -> None:
    """GPTQ 4-bit through the same kernel: plain groups, and act order (rows sorted by g_idx: GPTQ's desc_act
    groups are equal-sized, so they are whole blocks too). Uneven sorted groups would take the generic fused
    kernel (tests/test_quant_kernels.py), which also reads the packed weights once."""
    qmm = _qmm()
    from exlpy.kernels.exl2_matmul import exl2_matmul, quant_matmul_cuda
    from exlpy.kernels.exl2_qmm_plan import supports

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(256, 48, generator=gen)
    t, dq = quantize_gptq(w, 64, gen, act_order)
    qm = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 256, 48, "g")
    assert supports(qm) and (qm.perm is not None) == act_order
    for m in (3, 40):
        x = torch.randn(m, 256, generator=gen).half()
        ref = x.float() @ dq
        with use_options(_fused_rows()):
            assert rel_err(quant_matmul_cuda(x, [qm]), ref) < TOL
            assert rel_err(exl2_matmul(x, qm), ref) < TOL
        assert rel_err(qmm.qmm(x, [qm]), ref) < TOL


@pytest.mark.interpreter
def test_dequant_path_interpreter() -> None:
    """Past the fused rows (70 rows, or any count with EXLPY_QUANT_ROWS=0) the product dequantizes W in
    input-feature order (act order applied while writing) for cuBLAS: same result, EXL2 mixed and GPTQ."""
    _qmm()
    from exlpy.kernels.exl2_matmul import exl2_matmul, quant_matmul_cuda

    gen = torch.Generator().manual_seed(12)
    qm = _exl2(*MIXED, gen)
    t, dq = quantize_gptq(torch.randn(256, 48, generator=gen), 64, gen, True)
    gq = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 256, 48, "g")
    x = torch.randn(70, qm.k, generator=gen).half()
    assert rel_err(exl2_matmul(x, qm), reference.quant_matmul(x, [qm])) < TOL
    xg = torch.randn(70, 256, generator=gen).half()
    assert rel_err(exl2_matmul(xg, gq), xg.float() @ dq) < TOL
    with use_options(RuntimeOptions.from_env({"EXLPY_QUANT_ROWS": "0"})):
        res = torch.randn(3, qm.n, generator=gen).half()
        want = reference.quant_matmul(x[:3], [qm], None, res.clone())
        assert rel_err(quant_matmul_cuda(x[:3], [qm], None, res), want) < TOL


@pytest.mark.interpreter
def test_dequant_group_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused group past the fused rows: every part dequantized into its columns of one output (column slices
    of a bounded scratch), with bias, or accumulated into the residual by the GEMM."""
    _qmm()
    from exlpy.kernels import exl2_matmul

    monkeypatch.setattr(exl2_matmul, "_SCRATCH_ELEMS", 160 * 64)  # slices of 64 columns
    gen = torch.Generator().manual_seed(13)
    a = _exl2(160, 100, [(4, 64), (4, 64), (4, 32)], gen)
    parts = [a, _exl2(160, 72, [(6, 32), (4, 96), (3, 32)], gen, perm=a.perm)]
    x = torch.randn(66, 160, generator=gen).half()
    bias = torch.randn(172, generator=gen).half()
    norm = (1 + 0.1 * torch.randn(160, generator=gen)).half()
    got = exl2_matmul.quant_matmul_cuda(x, parts, bias, None, norm, 1e-5)
    assert rel_err(got, reference.quant_matmul(x, parts, bias, None, norm, 1e-5)) < TOL
    res = torch.randn(66, 172, generator=gen).half()
    want = reference.quant_matmul(x, parts, None, res.clone())
    assert exl2_matmul.quant_matmul_cuda(x, parts, None, res) is res and rel_err(res, want) < TOL


def test_dispatch_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    """EXLPY_QUANT_ROWS bounds the fused rows (0 turns the kernel off); the per-shape crossover table hands a
    shape to dequantize + cuBLAS from its row count on; a bad value is a ConfigError naming the variable."""
    from exlpy.kernels import exl2_qmm_plan as qp

    assert RuntimeOptions.from_env({}).quant_rows == 64  # on by default (GPU-verified, exlpy/runtime.py)
    with use_options(RuntimeOptions.from_env({"EXLPY_QUANT_ROWS": "0"})):
        assert not qp.rows_kernel_takes(2, 4096, 4096) and not qp.rows_kernel_takes(64, 4096, 4096)
    with use_options(RuntimeOptions.from_env({"EXLPY_QUANT_ROWS": "64"})):
        assert qp.rows_kernel_takes(2, 4096, 4096) and qp.rows_kernel_takes(64, 4096, 4096)
        assert not qp.rows_kernel_takes(1, 4096, 4096) and not qp.rows_kernel_takes(65, 4096, 4096)
        monkeypatch.setitem(qp.CROSSOVER, (4096, 4096), 33)
        assert qp.rows_kernel_takes(32, 4096, 4096) and not qp.rows_kernel_takes(33, 4096, 4096)
        assert qp.rows_kernel_takes(64, 4096, 14336)
    with use_options(RuntimeOptions.from_env({"EXLPY_QUANT_ROWS": "16"})):
        assert qp.rows_kernel_takes(16, 4096, 4096) and not qp.rows_kernel_takes(17, 4096, 4096)
    with pytest.raises(ConfigError, match="EXLPY_QUANT_ROWS"):
        RuntimeOptions.from_env({"EXLPY_QUANT_ROWS": "65"})
    with pytest.raises(ConfigError, match="EXLPY_QUANT_ROWS"):
        RuntimeOptions.from_env({"EXLPY_QUANT_ROWS": "many"})


def test_reference_matches_dense() -> None:
    """The CPU path of ops.quant_matmul (the reference) is the dense product of the dequantized parts."""
    from exlpy.quant.exl2_ref import dequant_dense

    gen = torch.Generator().manual_seed(3)
    a = _exl2(96, 40, [(4, 32)] * 3, gen)
    parts = [a, _exl2(96, 24, [(6, 64), (5, 32)], gen, perm=a.perm)]
    x = torch.randn(2, 5, 96, generator=gen)
    bias = torch.randn(64, generator=gen)
    res = torch.randn(2, 5, 64, generator=gen)
    want = res + x @ torch.cat([dequant_dense(p) for p in parts], 1) + bias
    got = ops.quant_matmul(x, parts, bias, res)
    assert got is res and rel_err(got, want) < 1e-5


# --- CUDA ---------------------------------------------------------------------------------------------------

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
MIXED_8B = [(8, 0.05), (4, 0.95)]  # a converter-like down_proj mix (§4.4 option table), in 128-row groups


def _exl2_big(k: int, n: int, groups: list[tuple[int, int]], gen: torch.Generator,
              perm: torch.Tensor | None = None) -> QuantMatrix:
    """A random EXL2 matrix of real size, quickly: random packed words are valid codes (no bit packing)."""
    words, qg = 0, []
    for b, rows in groups:
        qg += [b, words]
        words += (rows * b + 31) // 32
    rnd = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)  # noqa: E731
    qm = build_exl2_matrix(rnd(words, n), torch.randperm(k, generator=gen).to(torch.int32), rnd(len(groups), n // 8),
                           (0.01 * (0.5 + torch.rand(len(groups), generator=gen))).half(),
                           torch.tensor(qg, dtype=torch.int16), k, n, "big")
    return qm if perm is None else dataclasses.replace(qm, perm=perm)


def _groups(k: int, mix: list[tuple[int, float]], gs: int = 128) -> list[tuple[int, int]]:
    out, left = [], k
    for i, (b, p) in enumerate(mix):
        rows = left if i == len(mix) - 1 else min(left, -(-int(k * p) // gs) * gs)
        out += [(b, gs)] * (rows // gs) + ([(b, rows % gs)] if rows % gs else [])
        left -= rows
    return out


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mix", [[(4, 1.0)], MIXED_8B, [(6, 0.1), (5, 0.2), (3, 0.5), (2, 0.2)]])
def test_real_shapes_cuda(shape: tuple[int, int], mix: list[tuple[int, float]]) -> None:
    """8B shapes against the dequantized fp16 matmul, for row counts across 2-64, eager, each five times (the first
    GPU run lost split-K sums now and then: a load and a store of the workspace on different threads)."""
    qmm = _qmm()
    from exlpy.quant.exl2_ref import dequant_dense

    k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    qm = _exl2_big(k, n, _groups(k, mix), gen)
    w = dequant_dense(qm).cuda().half()
    q = qm.to("cuda")
    group = qmm.QmmGroup([q], None)
    for m in (2, 5, 8, 16, 17, 32, 33, 64):
        x = torch.randn(m, k, generator=gen).half().cuda()
        ref = (x.float() @ w.float())
        for _ in range(5):  # repeated: a race in the split-K epilogue shows only now and then
            assert rel_err(group.run(x), ref) < TOL, m


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_real_shape_cuda(act_order: bool) -> None:
    """GPTQ 4-bit g128 at gate|up's shape through ops.quant_matmul (the model's dispatch, EXLPY_QUANT_ROWS=64):
    2-64 rows run the multi-row kernel, 65+ dequantize + cuBLAS; all equal the exact dequantized product."""
    _qmm()
    gen = torch.Generator().manual_seed(17)
    w = torch.randn(4096, 2048, generator=gen) * 0.02
    t, dq = quantize_gptq(w, 128, gen, act_order)
    qm = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 4096, 2048, "g").to("cuda")
    for m in (2, 8, 31, 64, 65):
        x = torch.randn(m, 4096, generator=gen).half()
        with use_options(_fused_rows()):
            y = ops.quant_matmul(x.cuda(), [qm])
        assert rel_err(y, x.float() @ dq) < TOL, m


@requires_cuda
@pytest.mark.gpu
def test_graph_replay_cuda() -> None:
    """q|k|v at 8B shapes (mixed widths, bias, norm) and down_proj with the residual added in place, captured
    once per row count and replayed with new inputs: no host sync, no per-replay allocation."""
    qmm = _qmm()
    check_graph_replay(qmm.QmmGroup)


def check_graph_replay(make_group: Any) -> None:
    """The graph-replay check of a multi-row kernel's group class (exl2_qmm's QmmGroup, exl2_tc's TcGroup): q|k|v
    at 8B shapes with bias and norm, down_proj adding into the residual, captured per row count, replayed twice."""
    gen = torch.Generator().manual_seed(41)
    a = _exl2_big(4096, 4096, _groups(4096, [(5, 0.1), (4, 0.7), (3, 0.2)]), gen)
    parts = [a, _exl2_big(4096, 1024, _groups(4096, [(4, 1.0)]), gen, perm=a.perm),
             _exl2_big(4096, 1024, _groups(4096, [(6, 1.0)]), gen, perm=a.perm)]
    down = _exl2_big(14336, 4096, _groups(14336, MIXED_8B), gen)
    qkv = make_group([p.to("cuda") for p in parts], torch.randn(6144, generator=gen).half().cuda())
    dn = make_group([down.to("cuda")], None)
    norm = (1 + 0.1 * torch.randn(4096, generator=gen)).half().cuda()
    for m in (3, 24, 64):
        x = torch.randn(m, 4096, generator=gen).half().cuda()
        h = torch.randn(m, 14336, generator=gen).half().cuda()
        res = torch.zeros(m, 4096, dtype=torch.float16, device="cuda")
        qkv.run(x, None, norm, 1e-5)  # compiles and loads both kernels: loading a module under capture fails
        dn.run(h, res.clone())
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = qkv.run(x, None, norm, 1e-5)
            dn.run(h, res)
        for _ in range(2):
            x.copy_(torch.randn(m, 4096, generator=gen).half())
            h.copy_(torch.randn(m, 14336, generator=gen).half())
            r0 = torch.randn(m, 4096, generator=gen).half()
            res.copy_(r0)
            g.replay()
            ref = reference.quant_matmul(x.cpu(), parts, qkv.bias.cpu(), None, norm.cpu(), 1e-5)
            assert rel_err(y, ref) < TOL
            assert rel_err(res, reference.quant_matmul(h.cpu(), [down], None, r0.clone())) < TOL


def check_model_batched_decode(monkeypatch: pytest.MonkeyPatch, kernel: Any, opts: RuntimeOptions) -> None:
    """A converter-written EXL2 model loaded on the GPU under `opts` decoding 4 rows (graph step), then verifying
    4 tokens per row (16 rows): `kernel.run_plan` (exl2_qmm's, exl2_tc's) runs both, and the logits match the
    fp32 CPU model's. Also tests/test_exl2_tc.py's."""
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
    from tests.conftest import logits_tol

    calls = []
    real = kernel.run_plan
    monkeypatch.setattr(kernel, "run_plan", lambda plan, xb, *a: calls.append(xb.shape[0]) or real(plan, xb, *a))
    d = shared_path("models", "smollm2-135m-exl2-4.0")
    cpu = ExLlamaV2(ExLlamaV2Config(str(d)))
    cpu.load(device="cpu")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (4, 24), generator=gen)
    want = cpu.forward(ids)
    del cpu
    with use_options(opts):
        model = ExLlamaV2(ExLlamaV2Config(str(d)))
        cache = ExLlamaV2Cache(model, batch_size=4, max_seq_len=64, lazy=True)
        model.load_autosplit(cache)
        tol = logits_tol(model, 1e-3)
        model.forward(ids[:, :19], cache, preprocess_only=True)
        got = model.forward(ids[:, 19:20], cache)  # decode: 4 rows
        assert 4 in calls and rel_err(got[:, -1], want[:, 19]) <= tol
        got = model.forward(ids[:, 20:24], cache)  # verification-sized step: 4 tokens per row, 16 rows
        assert 16 in calls and rel_err(got, want[:, 20:24]) <= tol


@requires_cuda
@pytest.mark.gpu
def test_model_batched_decode_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A converter-written EXL2 model decoding 4 rows (graph step), then verifying 4 tokens per row (16 rows),
    runs the multi-row kernel and matches the fp32 CPU model's logits."""
    check_model_batched_decode(monkeypatch, _qmm(), _fused_rows())


@pytest.mark.slow
def test_qmm_compiles_for_sm90() -> None:
    """Every width, a mixed launch, BLOCK_M 16/32/64 and GPTQ compile for an H100 (sm_90a) without a GPU: no
    register spills, within the shared-memory limit (benchmarks/qmm_compile_check.py)."""
    pytest.importorskip("triton")
    from tests.conftest import run_compile_check

    res = run_compile_check("qmm_compile_check.py")
    assert {"exl2 2-bit M16", "exl2 8-bit M16", "exl2 8+4+3-bit M16", "exl2 4-bit M64", "gptq 4-bit M16"} <= set(res)
    for name, v in res.items():
        assert 0 < v["regs"] <= 255 and v["spill_bytes"] == 0 and v["shared"] <= 227 * 1024, (name, v)
        assert v["sass"]["HMMA"] > 0 or "M64" in name or "gather" in name, (name, v)  # tensor cores (M64: wgmma)
        if "split_k" in v and "whole" not in name:  # split-K variants: every partial sum taken back atomically
            assert v["split_k"]["add"] > 0 and v["split_k"]["exch"] == v["split_k"]["add"], (name, v["split_k"])
