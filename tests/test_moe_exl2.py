"""EXL2 experts of MoE blocks: the stacked layout (exlpy/quant/experts.py), the grouped packed-weight kernels
(exlpy/kernels/moe_exl2.py; at few rows per expert moe_exl2_gemv.py) against their references, and EXL2 MoE
models through them and through the graph runner. Expert layouts differ per expert (mixed 2-8 bit widths, groups
of any height, the last one cut at K, their own act orders), as the converter writes them.

Tests marked `interpreter` run the Triton kernels on CPU tensors (tests/conftest.py: a child pytest with
TRITON_INTERPRET=1); `gpu` tests run on CUDA and skip without it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from exlpy.kernels import reference
from exlpy.quant.exl2_ref import build_exl2_matrix, dequant_dense
from exlpy.quant.experts import ExpertStack, stack_exl2
from exlpy.quant.pack import random_exl2
from exlpy.runtime import options, use_options
from tests.conftest import requires_cuda
from tests.test_moe import check_cuda_graph_decode, check_replays_with_new_routing, check_runner_decode


@pytest.fixture(autouse=True)
def _gemv_kernels_on() -> Iterator[None]:
    """The GEMV path is on by default; EXLPY_MOE_GEMV=0 in the environment must not take it out of these tests."""
    with use_options(dataclasses.replace(options(), moe_gemv=True)):
        yield

# per-expert (bits, rows) layouts, cycled over the experts; each sums to K = 88 (mixed, cut last group, uniform;
# the last one has a group boundary off the 32-row grid, so stacks of 5 or more experts take the kernels' general
# per-row decoding, the others their 32-row block path)
LAYOUTS_88 = [[(3, 32), (5, 32), (8, 24)], [(4, 88)], [(6, 64), (2, 24)], [(5, 32), (3, 56)], [(4, 40), (6, 48)]]


def _layouts(k: int, e: int, uniform: int = 0) -> list[tuple[int, int]]:
    if uniform:  # one width in groups of 64 rows, the last cut at K
        return [(uniform, min(64, k - r)) for r in range(0, k, 64)]
    if k == 88:
        return LAYOUTS_88[e % len(LAYOUTS_88)]
    widths = (4, 3, 6, 5, 8, 2)
    out, r, g = [], 0, e
    while r < k:  # groups of 32 rows (the last cut at K), widths cycling from a per-expert start
        out.append((widths[g % len(widths)], min(32, k - r)))
        r += 32
        g += 1
    return out


def _stack(E: int, k: int, n: int, g: torch.Generator, dtype: torch.dtype = torch.float32,
           perm: torch.Tensor | None = None, uniform: int = 0, fast: bool = False) -> tuple[ExpertStack, list]:
    """E random EXL2 experts stacked; fast: words drawn directly (pack.random_words), for the GPU tests' big shapes."""
    mats = []
    for e in range(E):
        t = random_exl2(k, n, _layouts(k, e, uniform), g, fast=fast)
        inv = t["q_invperm"] if perm is None else torch.argsort(perm[e]).to(torch.int32)
        mats.append(build_exl2_matrix(t["q_weight"], inv, t["q_scale"], t["q_scale_max"], t["q_groups"], k, n,
                                      f"experts.{e}"))
    return stack_exl2(mats, dtype, "experts"), mats


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def test_stack_decodes_every_expert_exactly() -> None:
    """Each expert decoded from the stacked tables equals its own matrix's exact dequantization."""
    g = torch.Generator().manual_seed(0)
    stack, mats = _stack(5, 88, 40, g)
    assert stack.num_experts == 5 and stack.k == 88 and stack.n == 40
    for e, qm in enumerate(mats):
        assert torch.equal(stack.dequant(e), dequant_dense(qm))


def test_stack_refuses_experts_of_other_shapes() -> None:
    from exlpy.errors import QuantFormatError

    g = torch.Generator().manual_seed(1)
    _, a = _stack(1, 88, 40, g)
    _, b = _stack(1, 88, 72, g)
    with pytest.raises(QuantFormatError, match="expert 1.*share one shape"):
        stack_exl2(a + b, torch.float32, "layer.experts")


def _case(T: int, E: int, k: int, H: int, inter: int, seed: int, device: str = "cpu",
          dtype: torch.dtype = torch.float32, same_perm: bool = True, uniform: int = 0, h_scale: float = 4.0,
          fast: bool = False) -> tuple:
    g = torch.Generator().manual_seed(seed)
    perm = torch.stack([torch.randperm(H, generator=g) for _ in range(E)]) if same_perm else None
    gate, gm = _stack(E, H, inter, g, dtype, perm, uniform, fast)
    up, um = _stack(E, H, inter, g, dtype, perm, uniform, fast)
    down, dm = _stack(E, inter, H, g, dtype, None, uniform, fast)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    h = (torch.randn(T, H, generator=g) * h_scale).to(dtype)
    w = torch.rand(T, k, generator=g).to(dtype)
    # the same experts as dense stacks: [E, 2I, H] gate|up and [E, H, I] down
    gu = torch.stack([torch.cat([dequant_dense(a).t(), dequant_dense(b).t()]) for a, b in zip(gm, um)])
    dn = torch.stack([dequant_dense(d).t() for d in dm])
    stacks = [s.to(device) for s in (gate, up, down)]
    return (h.to(device), w.to(device), ids.to(device), *stacks, gu.to(device, dtype), dn.to(device, dtype))


@pytest.mark.parametrize("T", [1, 7, 40])
def test_reference_equals_the_dense_experts(T: int) -> None:
    """The packed references compose to the dense experts' whole-op reference (reference.moe_experts)."""
    from exlpy.kernels import ops

    h, w, ids, gate, up, down, gu, dn = _case(T, 6, 2, 88, 72, seed=T)
    want = reference.moe_experts(h, w, ids, gu, dn, "silu")
    assert _rel(ops.moe_experts_exl2(h, w, ids, gate, up, down, "silu"), want) < 1e-5
    res = torch.randn_like(h)
    assert _rel(ops.moe_experts_exl2(h, w, ids, gate, up, down, "silu", res), want + res) < 1e-5


def _cpu_ok() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")


def _check_kernels(T: int, E: int, k: int, H: int, inter: int, seed: int, kind: str = "silu", device: str = "cpu",
                   dtype: torch.dtype = torch.float32, tol: float = 1e-5, same_perm: bool = True,
                   skew: bool = False, uniform: int = 0, h_scale: float = 4.0, case: tuple | None = None) -> None:
    """`case`: a prebuilt `_case` of at least T tokens (its first T taken), for shapes whose experts are slow to
    build."""
    from exlpy.kernels.moe_exl2 import _width, moe_down_exl2, moe_gate_up_exl2

    if case is None:
        case = _case(T, E, k, H, inter, seed, device, dtype, same_perm, uniform, h_scale)
    h, w, ids, gate, up, down, gu, dn = case
    h, w, ids = h[:T], w[:T], ids[:T]
    assert _width(gate) == _width(down) == (uniform if uniform in (2, 4, 8) else 0)
    if skew:  # expert 0 in every token, the others never chosen past k
        ids = torch.stack([torch.arange(k) for _ in range(T)]).to(device)
    order, counts = reference.moe_sort(ids, E)
    a = moe_gate_up_exl2(h, order, counts, gate, up, k, kind)
    ref_a = reference.moe_gate_up_exl2(h, order, counts, gate, up, k, kind)
    assert a.shape == ref_a.shape and torch.isfinite(a).all()
    assert _rel(a, ref_a) < tol
    y = moe_down_exl2(ref_a, order, counts, down)
    ref_y = reference.moe_down_exl2(ref_a, order, counts, down)
    assert y.shape == ref_y.shape and torch.isfinite(y).all()
    assert _rel(y, ref_y) < tol
    # end to end against the dense experts: the gate|up kernel's output through the packed down reference (the
    # down kernel is checked just above; running it again on `a` repeated its launches, not its code paths)
    out = reference.moe_combine(reference.moe_down_exl2(a, order, counts, down), w)
    assert _rel(out, reference.moe_experts(h, w, ids, gu, dn, kind)) < tol


def test_block_alignment_is_detected() -> None:
    g = torch.Generator().manual_seed(2)
    assert _stack(4, 88, 40, g)[0].aligned and _stack(4, 72, 40, g)[0].aligned
    assert not _stack(5, 88, 40, g)[0].aligned  # expert 4: a group boundary at row 40


@pytest.mark.interpreter
@pytest.mark.parametrize("T,E,k,H,inter,same_perm,skew", [
    (1, 8, 2, 88, 72, True, False),     # batch-1 decode; mixed widths, a last group cut at K; gate|up unaligned
    (6, 5, 2, 96, 40, False, False),    # gate and up with their own act orders; E not a power of two
    (37, 4, 3, 64, 56, True, True),     # one expert owns 37 rows (three 16-row tiles); expert 3 never chosen
])
def test_kernels_match_references(T: int, E: int, k: int, H: int, inter: int, same_perm: bool, skew: bool) -> None:
    _cpu_ok()
    _check_kernels(T, E, k, H, inter, seed=T, same_perm=same_perm, skew=skew)


@pytest.mark.interpreter
@pytest.mark.parametrize("width", [4, 8, 2, 3])
def test_uniform_width_stacks(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stacks of one width in the tile kernels (the GEMV kernels kept off: 3 rows over 4 experts would take
    them): 2, 4 and 8 bits load each block's words once; K = 88 and 72 end in a partial block (the last expert's
    last words end the stack). 3 bits take the gather path."""
    _cpu_ok()
    from exlpy.kernels import moe_exl2_gemv, moe_exl2_rows

    monkeypatch.setattr(moe_exl2_gemv, "GEMV_MAX_ROWS", 0)
    monkeypatch.setattr(moe_exl2_rows, "ROWS_MAX_MEAN", 0)
    _check_kernels(3, 4, 2, 88, 72, seed=width, uniform=width)


@pytest.mark.interpreter
def test_gelu_and_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu_ok()
    from exlpy.kernels import moe_exl2_gemv, moe_exl2_rows

    monkeypatch.setattr(moe_exl2_gemv, "GEMV_MAX_ROWS", 0)  # the tile kernels (test_gemv_path_* take the others)
    monkeypatch.setattr(moe_exl2_rows, "ROWS_MAX_MEAN", 0)  # (and test_moe_exl2_rows.py the multi-row ones)
    _check_kernels(5, 4, 2, 64, 40, seed=3, kind="gelu_tanh")
    _check_kernels(5, 4, 2, 64, 40, seed=4, dtype=torch.float16, tol=5e-3)
    # fp16 decode tiles of one-width stacks take several 32-row blocks per trip (the last past K, read nothing)
    _check_kernels(3, 4, 2, 88, 72, seed=5, dtype=torch.float16, tol=5e-3, uniform=4)


@pytest.mark.interpreter
@pytest.mark.parametrize("width", [2, 3, 4, 5, 6, 8])
def test_gemv_path_every_width(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Few rows per expert take the GEMV kernels (split-K through the fp32 workspace) for one-width stacks of
    every width: batch 1 and 3 tokens (two rows of one expert, each on its own), K = 88 and 72 ending in a
    partial block (masked rows); 3 and 4 bits also K = 128 / 64 (whole steps, no masks), gate and up with one act
    order (4) or two (3)."""
    _cpu_ok()
    from exlpy.kernels import moe_exl2_gemv

    taken = []
    for name in ("gate_up_gemv", "down_gemv"):
        f = getattr(moe_exl2_gemv, name)
        monkeypatch.setattr(moe_exl2_gemv, name, lambda *a, f=f, name=name: taken.append(name) or f(*a))
    _check_kernels(1, 4, 2, 88, 72, seed=width, uniform=width)
    runs = 1
    if width in (3, 4):
        _check_kernels(3, 4, 2, 128, 64, seed=10 + width, uniform=width, same_perm=width == 4)
        runs = 2
    assert taken.count("gate_up_gemv") == runs and taken.count("down_gemv") == runs


@pytest.mark.interpreter
def test_gemv_path_mixed_widths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Aligned stacks of mixed widths (every width, per expert and block, as the converter writes them) take the
    GEMV kernels, each block decoded at its own width; a stack with a group off the 32-row grid does not."""
    _cpu_ok()
    from exlpy.kernels import moe_exl2_gemv

    taken = []
    f = moe_exl2_gemv.gate_up_gemv
    monkeypatch.setattr(moe_exl2_gemv, "gate_up_gemv", lambda *a: taken.append(a[-2]) or f(*a))
    _check_kernels(2, 4, 2, 192, 88, seed=21, same_perm=False)  # 32-row groups cycling 4, 3, 6, 5, 8, 2 bits
    _check_kernels(1, 4, 2, 88, 72, seed=22)  # LAYOUTS_88: groups of 24-88 rows, a last block cut at K
    assert taken == [0, 0]
    _check_kernels(1, 5, 2, 88, 72, seed=23)  # expert 4's group boundary at row 40: the tile kernels
    assert taken == [0, 0]


@pytest.mark.interpreter
def test_gemv_path_half_precision_and_gelu() -> None:
    _cpu_ok()
    _check_kernels(2, 4, 2, 64, 96, seed=6, dtype=torch.float16, tol=5e-3, uniform=4)
    _check_kernels(1, 4, 2, 64, 96, seed=7, dtype=torch.bfloat16, tol=2e-2, uniform=4)
    _check_kernels(1, 4, 2, 88, 72, seed=8, kind="gelu_tanh", uniform=6)
    from exlpy.kernels import moe_exl2_gemv

    # the split-K workspaces are zero again after every launch (read by atomic exchange), and reused
    assert moe_exl2_gemv._WORKSPACES and all(not ws.any() for ws in moe_exl2_gemv._WORKSPACES.values())


def test_gemv_path_choice_and_split() -> None:
    """Decode (mean rows per routed expert <= GEMV_MAX_ROWS) takes the GEMV kernels, 32 tokens the tile kernels;
    K splits into whole steps, the programs within GEMV_WAVES per SM (Mixtral's shapes on 132 SMs)."""
    pytest.importorskip("triton")
    from exlpy.kernels import moe_exl2_gemv as gemv

    assert gemv.gemv_rows(2, 8) and gemv.gemv_rows(8, 128) and not gemv.gemv_rows(64, 8)
    for n_out, k, (nb, even) in ((14336, 4096, gemv.gemv_nb(4, 2, 4096)),
                                 (4096, 14336, gemv.gemv_nb(4, 1, 14336))):
        assert even
        bn, warps, blocks, splits, chunk = gemv.gemv_split(2, n_out, k, nb, 132)
        assert (bn, warps) == (gemv.GEMV_COLS, gemv.GEMV_WARPS)
        assert chunk % (32 * nb) == 0 and (splits - 1) * chunk < k <= splits * chunk
        assert 2 * 132 <= 2 * blocks * splits <= gemv.GEMV_WAVES * 132, (n_out, k, blocks, splits)
    assert gemv.gemv_split(8, 768, 2048, 1, 132)[:3] == (256, 4, 3)  # Qwen3-MoE's gate|up: no idle columns
    g = torch.Generator().manual_seed(3)
    four = _stack(2, 64, 40, g, uniform=4)[0]
    assert gemv.gemv_width(four) == 4 and gemv.gemv_width(four, _stack(2, 64, 40, g, uniform=5)[0]) == 0
    assert gemv.gemv_width(_stack(4, 88, 40, g)[0]) == 0  # mixed widths, aligned: each block its own
    assert gemv.gemv_width(_stack(5, 88, 40, g)[0]) is None  # a group off the 32-row grid: the tile kernels


def test_kernels_have_their_references_signatures() -> None:
    import inspect

    pytest.importorskip("triton")
    from exlpy.kernels import moe_exl2

    for name in ("moe_gate_up_exl2", "moe_down_exl2"):
        assert inspect.signature(getattr(moe_exl2, name)) == inspect.signature(getattr(reference, name)), name


# --- GPU ------------------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("uniform", [0, 4])
def test_cuda_qwen3_moe_layer_shapes(uniform: int) -> None:
    """Qwen3-30B-A3B's expert shapes (H 2048, I 768, 128 experts, top 8) in fp16, mixed widths per expert
    (uniform 0) or 4-bit stacks, at 1, 32 and 200 tokens over one set of experts (building 128 random EXL2 experts
    takes most of the time: built once per case, the test took 90 s for three token counts alone, and past the
    GPU suite's per-test timeout among 16 workers, 2026-11-26). Inputs of unit scale: at 4x (the small cases'
    scale) the down projection's fp16 outputs passed 65,504 for 32 and 200 tokens on an H100 (2026-11-26) over
    these random experts."""
    case = _case(200, 128, 8, 2048, 768, seed=200 + uniform, device="cuda", dtype=torch.float16, uniform=uniform,
                 h_scale=1.0, fast=True)
    for T in (1, 32, 200):
        _check_kernels(T, 128, 8, 2048, 768, seed=T, device="cuda", dtype=torch.float16, tol=5e-3, uniform=uniform,
                       h_scale=1.0, case=case)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("uniform", [0, 4])
def test_cuda_graph_capture_and_replay_with_new_routing(uniform: int) -> None:
    """ops.moe_experts_exl2 captured once in a CUDA graph (capture refuses host syncs), replayed with other
    routings: each replay equals the reference of its own routing. Mixed widths take the tile kernels, 4-bit
    stacks the GEMV kernels (16 rows over 16 experts; split-K sums through the workspace)."""
    from exlpy.kernels import ops

    T, E, k, H, inter = 4, 16, 4, 256, 192
    h0, w0, _, gate, up, down, gu, dn = _case(T, E, k, H, inter, seed=2, device="cuda", dtype=torch.float16,
                                              uniform=uniform)
    h, w = torch.zeros_like(h0), torch.zeros_like(w0)
    ids = torch.zeros(T, k, dtype=torch.long, device="cuda")

    def refill(seed: int) -> None:
        gg = torch.Generator().manual_seed(seed)
        h.copy_(torch.randn(T, H, generator=gg) * 4)
        w.copy_(torch.rand(T, k, generator=gg))
        ids.copy_(torch.stack([torch.randperm(E, generator=gg)[:k] for _ in range(T)]))

    check_replays_with_new_routing(lambda: ops.moe_experts_exl2(h, w, ids, gate, up, down, "silu"), refill,
                                   lambda: reference.moe_experts(h, w, ids, gu, dn, "silu"))


# --- models -----------------------------------------------------------------------------------------------------
def _exl2_moe_model(src: Path, dst: Path, seed: int) -> None:
    """`src`'s model with every expert projection replaced by random EXL2 tensors of per-expert layouts (gate
    and up of an expert share their act order, as converted files do)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    out = {n: t for n, t in tensors.items() if ".experts." not in n}
    g = torch.Generator().manual_seed(seed)
    for name, t in sorted(tensors.items()):
        if ".experts." in name:
            n, k = t.shape
            e = int(name.split(".experts.")[1].split(".")[0])
            for suffix, v in random_exl2(k, n, _layouts(k, e), g).items():
                out[f"{name.removesuffix('.weight')}.{suffix}"] = v
    for name in list(out):  # up shares gate's act order (Mixtral: w3 / w1; Qwen3-MoE: up_proj / gate_proj)
        for g_name, u_name in (("w1", "w3"), ("gate_proj", "up_proj")):
            if name.endswith(f".{g_name}.q_invperm"):
                out[name.replace(f".{g_name}.", f".{u_name}.")] = out[name].clone()
    save_file(out, str(dst / "model.safetensors"))


def _load(path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):  # noqa: ANN202
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config

    config = ExLlamaV2Config(str(path))
    config.max_seq_len = 64
    config.dtype = dtype
    model = ExLlamaV2(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if device == "auto":
            model.load_autosplit(ExLlamaV2Cache(model, lazy=True))
        else:
            model.load(device=device)
    return model


@pytest.fixture(scope="module")
def exl2_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.arch_models import make_arch_model

    out = {}
    for case in ("mixtral", "qwen3_moe"):
        src = tmp_path_factory.mktemp(f"{case}_src")
        make_arch_model(src, case)
        out[case] = tmp_path_factory.mktemp(f"{case}_exl2")
        _exl2_moe_model(src, out[case], seed=len(case))
    return out


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_exl2_moe_model_equals_its_per_expert_linears(exl2_moe: dict, case: str) -> None:
    """The stacked path (ops.moe_experts_exl2) gives the logits of the per-expert EXL2 linears (the path GPTQ
    experts still take), prefill and decode; its blocks are graph-safe."""
    from exlpy import ExLlamaV2Cache
    from exlpy.engine.forward import graph_runner
    from exlpy.model import moe as moe_mod
    from tests.arch_models import VOCAB
    from tests.conftest import rel_err

    model = _load(exl2_moe[case])
    blocks = [m for m in model.modules if isinstance(m, moe_mod.MoEMLP)]
    assert blocks and all(b.packed is not None and b.experts is None and b.graph_safe for b in blocks)
    assert graph_runner(model, types.SimpleNamespace(graph_safe=True, graph_cache={})) is not None  # type: ignore[arg-type]
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    cache = ExLlamaV2Cache(model, batch_size=2)
    got = torch.cat([model.forward(ids[:, :9], cache)] + [model.forward(ids[:, i:i + 1], cache) for i in (9, 10, 11)],
                    dim=1)
    for b in blocks:  # the same experts as one EXL2 linear each
        hid, inter = model.config.hidden_size, b.moe.expert_size
        b.experts = [tuple(moe_mod.load_linear(b.index, f"{b.key}.experts.{e}.{proj}", k, n, torch.device("cpu"),
                                               torch.float32)
                           for proj, k, n in (("gate_proj", hid, inter), ("up_proj", hid, inter),
                                              ("down_proj", inter, hid)))
                     for e in range(b.moe.num_experts)]
        b.packed = None
    want = model.forward(ids)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_exl2_moe_decode_through_the_graph_runner_equals_eager(exl2_moe: dict, case: str) -> None:
    """A batch of 3 decoded through the graph runner's static buffers (its body run eagerly on the CPU, the
    references serving the ops) equals plain eager decode."""
    check_runner_decode(_load(exl2_moe[case]))


@pytest.mark.interpreter
def test_exl2_moe_model_through_the_kernels(exl2_moe: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Qwen3-MoE model with its EXL2 experts run by the Triton kernels (interpreter) equals the references."""
    _cpu_ok()
    import exlpy.kernels.triton_ops  # noqa: F401 - registers the kernels
    from exlpy import ExLlamaV2Cache
    from exlpy.kernels import ops
    from tests.arch_models import VOCAB
    from tests.conftest import rel_err

    model = _load(exl2_moe["qwen3_moe"])
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(8))
    want = model.forward(ids)
    used: set[str] = set()

    def impl(name: str, t: torch.Tensor):  # noqa: ANN202
        if name in ("moe_gate_up_exl2", "moe_down_exl2"):
            used.add(name)
            return ops._TRITON[name]
        return getattr(reference, name)

    monkeypatch.setattr(ops, "_impl", impl)
    cache = ExLlamaV2Cache(model, batch_size=2)
    got = [model.forward(ids[:, :4], cache)] + [model.forward(ids[:, i:i + 1], cache) for i in (4, 5)]
    assert used == {"moe_gate_up_exl2", "moe_down_exl2"}
    assert rel_err(torch.cat(got, dim=1), want) <= 1e-4


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_cuda_exl2_moe_graph_decode_equals_eager_and_cpu(exl2_moe: dict, case: str) -> None:
    """fp16 on a GPU: decode replayed from CUDA graphs (the EXL2 MoE blocks captured) equals eager decode and
    the fp32 CPU reference path."""
    from tests.arch_models import VOCAB

    ids = torch.randint(2, VOCAB, (2, 30), generator=torch.Generator().manual_seed(7))
    want = _load(exl2_moe[case]).forward(ids)
    check_cuda_graph_decode(lambda: _load(exl2_moe[case], "cuda:0", torch.float16), want, ids)


def test_gptq_experts_run_per_expert_and_eagerly(tmp_path: Path) -> None:
    """GPTQ experts (no stacked kernel) stay one packed linear each, grouped by expert with the counts read on the
    host: the logits equal the same model with each expert written out as its exact dequantization, and the
    blocks are not graph-safe (such a model decodes eagerly)."""
    from safetensors.torch import load_file, save_file

    from exlpy.engine.forward import graph_runner
    from exlpy.model.moe import MoEMLP
    from exlpy.quant.pack import quantize_gptq
    from tests.arch_models import VOCAB, make_arch_model
    from tests.conftest import rel_err

    src = tmp_path / "src"
    make_arch_model(src, "qwen3_moe")
    dense = load_file(str(src / "model.safetensors"))
    quant = dict(dense)
    g = torch.Generator().manual_seed(4)
    for name, w in list(dense.items()):
        if ".experts." in name:
            t, dq = quantize_gptq(w.float().t(), 16, g)
            del quant[name]
            quant.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in t.items()})
            dense[name] = dq.t().contiguous()
    dirs = {"gptq": quant, "dense": dense}
    for d, tensors in dirs.items():
        (tmp_path / d).mkdir()
        shutil.copy(src / "config.json", tmp_path / d / "config.json")
        save_file(tensors, str(tmp_path / d / "model.safetensors"))
    model = _load(tmp_path / "gptq")
    blocks = [m for m in model.modules if isinstance(m, MoEMLP)]
    assert blocks and all(b.experts is not None and b.packed is None and not b.graph_safe for b in blocks)
    assert graph_runner(model, types.SimpleNamespace(graph_safe=True, graph_cache={})) is None  # type: ignore[arg-type]
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    assert rel_err(model.forward(ids), _load(tmp_path / "dense").forward(ids)) < 1e-4
