"""The multi-row EXL2 expert kernels (exlpy/kernels/moe_exl2_rows.py: 3-16 sorted rows per expert) against the
references `reference.moe_gate_up_exl2 / moe_down_exl2`: every width and mixed widths, K whole steps or cut inside
a block, 0 to 20 rows per expert (row tiles of 8: one expert over three tiles, tiles with one live row), gate and
up with one act order or two, split-K sums through the shared workspace; moe_exl2's routing to them; their sm_90a
compile; Mixtral-shaped experts on a GPU.

Tests marked `interpreter` run the Triton kernels on CPU tensors (tests/conftest.py); `gpu` tests skip without CUDA.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from exlpy.kernels import reference
from exlpy.runtime import options, use_options
from tests.conftest import requires_cuda
from tests.test_moe_exl2 import _cpu_ok, _rel, _stack

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _split_k_kernels_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """EXLPY_MOE_ROWS=0 or EXLPY_MOE_GEMV=0 in the environment turns the multi-row kernels off: here they are on, for
    mixed stacks too (moe_exl2_rows.MIXED: off in use until the mixed variant compiles fast on a GPU)."""
    from exlpy.kernels import moe_exl2_rows

    monkeypatch.setattr(moe_exl2_rows, "MIXED", True)
    with use_options(dataclasses.replace(options(), moe_gemv=True, moe_rows=True)):
        yield


def _ids(counts: list[int], top_k: int, g: torch.Generator) -> torch.Tensor:
    """ids [T, top_k] with exactly counts[e] pairs routed to expert e, each token's experts distinct (counts of
    top_k == 1 any; else dealt round-robin from the fullest experts)."""
    left = list(counts)
    rows = []
    while sum(left):
        pick = sorted(range(len(left)), key=lambda e: -left[e])[:top_k]
        assert all(left[e] for e in pick), counts
        for e in pick:
            left[e] -= 1
        rows.append([pick[i] for i in torch.randperm(top_k, generator=g).tolist()])
    return torch.tensor(rows, dtype=torch.long)


def _check(counts: list[int], top_k: int, H: int, inter: int, seed: int, uniform: int = 0, same_perm: bool = True,
           dtype: torch.dtype = torch.float32, kind: str = "silu", tol: float = 1e-5, device: str = "cpu") -> None:
    """The kernels through moe_exl2's entry points, with a spy on the route taken, against the references. Where
    moe_exl2 routes here (every case of this file) that one call is the kernels' check: the spy asserts they ran,
    with the width checked here; a case routed elsewhere calls them directly as well. (The kernels once ran twice
    per case, directly and routed: the same launches, twice the interpreter time.)"""
    from exlpy.kernels import moe_exl2, moe_exl2_gemv, moe_exl2_rows

    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    perm = torch.stack([torch.randperm(H, generator=g) for _ in range(E)]) if same_perm else None
    gate, up, down = (_stack(E, H, inter, g, dtype, perm, uniform)[0].to(device),
                      _stack(E, H, inter, g, dtype, perm, uniform)[0].to(device),
                      _stack(E, inter, H, g, dtype, None, uniform)[0].to(device))
    ids = _ids(counts, top_k, g).to(device)
    x = (torch.randn(ids.shape[0], H, generator=g) * 4).to(device, dtype)
    order, counts_t = reference.moe_sort(ids, E)
    assert counts_t.tolist() == counts
    N = order.shape[0]
    width = moe_exl2_gemv.gemv_width(gate, up)
    assert width is not None and width == (uniform if uniform else 0) and moe_exl2_gemv.gemv_width(down) == width
    ref_a = reference.moe_gate_up_exl2(x, order, counts_t, gate, up, top_k, kind)
    ref_y = reference.moe_down_exl2(ref_a, order, counts_t, down)
    taken = []
    saved = moe_exl2_rows.gate_up_rows, moe_exl2_rows.down_rows
    try:  # the spy records each launch's width argument (gate_up_rows' 8th, down_rows' 5th)
        moe_exl2_rows.gate_up_rows = lambda *a: taken.append(("gate_up", a[7])) or saved[0](*a)
        moe_exl2_rows.down_rows = lambda *a: taken.append(("down", a[4])) or saved[1](*a)
        a = moe_exl2.moe_gate_up_exl2(x, order, counts_t, gate, up, top_k, kind)
        y = moe_exl2.moe_down_exl2(ref_a, order, counts_t, down)
    finally:
        moe_exl2_rows.gate_up_rows, moe_exl2_rows.down_rows = saved
    if moe_exl2_rows.takes(N, E, width):
        assert taken == [("gate_up", width), ("down", width)]
    else:
        assert taken == []
        assert _rel(a, ref_a) < tol and _rel(y, ref_y) < tol  # whatever kernels moe_exl2 took
        a = moe_exl2_rows.gate_up_rows(x, order, counts_t, gate, up, top_k, kind, width,
                                       torch.empty(N, inter, dtype=dtype, device=device))
        y = moe_exl2_rows.down_rows(ref_a, order, counts_t, down, width, torch.empty(N, H, dtype=dtype, device=device))
    assert torch.isfinite(a).all() and _rel(a, ref_a) < tol, _rel(a, ref_a)
    assert torch.isfinite(y).all() and _rel(y, ref_y) < tol, _rel(y, ref_y)


@pytest.mark.interpreter
@pytest.mark.parametrize("uniform,H,inter", [
    (4, 128, 64),   # one width, K whole steps (no masks)
    (0, 88, 72),    # mixed widths per expert and block (LAYOUTS_88), the last block cut at K
    (3, 88, 72),    # 3 bits: codes straddling words, masked
])
def test_rows_per_expert_0_to_20(uniform: int, H: int, inter: int) -> None:
    """Experts with 20 rows (three row tiles of 8, the last with 4 live), none, one and 13; top-1 routing (four
    experts: LAYOUTS_88's fifth has a group off the 32-row grid, which these kernels do not take)."""
    _cpu_ok()
    _check([20, 0, 1, 13], 1, H, inter, seed=uniform + H, uniform=uniform)


@pytest.mark.interpreter
@pytest.mark.parametrize("uniform", [2, 5, 6, 8])
def test_rows_every_width_top2_two_act_orders(uniform: int) -> None:
    """Top-2 routing (tokens gathered by pair // 2), gate and up with their own act orders (two gathered copies of
    x), 2-bit stacks two blocks per step; K = 64 / 96 whole steps or not."""
    _cpu_ok()
    _check([3, 6, 5, 4], 2, 64 if uniform == 2 else 96, 40, seed=uniform, uniform=uniform, same_perm=False)


@pytest.mark.interpreter
def test_rows_split_k_over_several_steps_and_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """K splits of several steps each (the plan of a 2-SM device: gate|up's K = 128 in two splits of two 32-row
    steps), fp16 and bf16 activations, GELU; the shared workspace is zero again after every launch. (K was 256 on
    4 SMs, fp16's K 128: the same splits of several steps, at twice the interpreter's work.)"""
    _cpu_ok()
    from exlpy.kernels import moe_exl2_gemv, moe_exl2_rows

    monkeypatch.setattr(moe_exl2_rows, "_sms", lambda t: 2)
    tiles, cols, warps, blocks, splits, chunk = moe_exl2_rows.plan(24, 3, 72, 128, 1, 2, 2)
    assert splits > 1 and chunk > 32
    _check([9, 3, 12], 1, 128, 72, seed=31, uniform=4)
    _check([4, 4, 9, 5], 2, 64, 40, seed=32, uniform=4, dtype=torch.float16, kind="gelu_tanh", tol=5e-3)
    _check([8, 5, 3], 1, 64, 96, seed=33, dtype=torch.bfloat16, tol=2e-2)
    assert moe_exl2_gemv._WORKSPACES and all(not ws.any() for ws in moe_exl2_gemv._WORKSPACES.values())


@pytest.mark.interpreter
def test_other_tile_heights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row tiles of 6 (the --sweep's other heights): the live-row steps lowered to divide it, mixed and one-width
    stacks."""
    _cpu_ok()
    from exlpy.kernels import moe_exl2_rows

    monkeypatch.setattr(moe_exl2_rows, "ROWS", 6)
    _check([13, 0, 5], 1, 64, 40, seed=41, uniform=4)
    _check([7, 2, 9, 1], 1, 96, 40, seed=42)


def test_route_by_rows_per_expert() -> None:
    """Mean sorted rows per routed expert above moe_exl2_gemv.GEMV_MAX_ROWS and up to ROWS_MAX_MEAN take these
    kernels (Mixtral at 16 to 64 tokens, Qwen3-MoE at 3-16 rows over its 128 experts); the decision is host
    arithmetic; EXLPY_MOE_GEMV=0 turns them off with the GEMV kernels."""
    pytest.importorskip("triton")
    from exlpy.kernels import moe_exl2_gemv, moe_exl2_rows

    assert moe_exl2_rows.ROWS_MIN_MEAN == moe_exl2_gemv.GEMV_MAX_ROWS
    takes = moe_exl2_rows.takes
    assert not takes(2, 8) and not takes(16, 8)  # Mixtral batch 1 and 8: the GEMV kernels
    assert takes(32, 8) and takes(64, 8) and takes(128, 8) and not takes(130, 8)  # 16, 32, 64 tokens; 65
    assert not takes(256, 128) and takes(512, 128) and not takes(4096, 128)  # Qwen3-MoE top 8: 32, 64, 512 tokens
    assert takes(3, 1) and not takes(2, 1) and not takes(0, 8)
    with use_options(dataclasses.replace(options(), moe_gemv=False)):
        assert not takes(64, 8)


def test_mixed_stacks_take_the_tile_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed-width stacks stay on the tile kernels in use (MIXED off: their variant's compile stalled on an H100);
    uniform ones of any width take the multi-row kernels."""
    pytest.importorskip("triton")
    from exlpy.kernels import moe_exl2_rows

    monkeypatch.setattr(moe_exl2_rows, "MIXED", False)
    assert not moe_exl2_rows.takes(64, 8, 0)
    assert all(moe_exl2_rows.takes(64, 8, w) for w in (2, 3, 4, 5, 6, 8))


def test_plan_at_mixtral_shapes() -> None:
    """64 pairs over 8 experts on 132 SMs: 16 row tiles, 512-column blocks, K cut into whole steps, the estimated
    live programs within ROWS_WAVES per SM; an odd row tile is refused."""
    pytest.importorskip("triton")
    from exlpy.kernels import moe_exl2_rows as mr

    for n_out, k, mats in ((14336, 4096, 2), (4096, 14336, 1)):
        nb, even = mr._nb(4, k)
        assert even
        tiles, cols, warps, blocks, splits, chunk = mr.plan(64, 8, n_out, k, nb, mats, 132)
        assert tiles == 16 and (cols, warps) == (mr.ROWS_COLS, mr.ROWS_WARPS) and blocks * cols >= n_out
        assert chunk % (32 * nb) == 0 and (splits - 1) * chunk < k <= splits * chunk
        live = 8 * blocks * splits * mats
        assert 132 <= live and (splits == 1 or (live // splits) * (splits - 1) < mr.ROWS_WAVES * 132)
    assert mr._nb(0, 4096) == (1, True) and mr._nb(0, 88) == (1, False)
    saved = mr.ROWS
    try:
        mr.ROWS = 7
        with pytest.raises(ValueError, match=r"ROWS \(7\).*must be even"):
            mr.plan(64, 8, 4096, 14336, 1, 1, 132)
        mr.ROWS = 6  # the live-row steps divide the tile height: every count up to it has its copy of the loop
        assert (mr._step(4), mr._step(0)) == (2, 2)
        mr.ROWS = 12
        assert (mr._step(4), mr._step(0)) == (2, 4)
    finally:
        mr.ROWS = saved


@pytest.mark.slow
def test_rows_kernels_compile_for_sm90_without_spills() -> None:
    """benchmarks/moe_rows_compile_check.py (4-bit, 3-bit, mixed; whole steps and masked; the gather): no register
    spills, registers within 255 at the default configuration."""
    pytest.importorskip("triton")
    from tests.conftest import child_env

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_rows_compile_check.py"), "--json",
                        "--widths", "4,3,0"], capture_output=True, text=True,
                       env=child_env(drop=("TRITON_INTERPRET",)), timeout=900, cwd=ROOT)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("JSON ")]
    if not lines and "ptxas" in r.stderr.lower():
        pytest.skip(f"triton cannot compile for CUDA here: {r.stderr[-300:]}")
    assert lines, r.stderr[-3000:]
    res = json.loads(lines[0][5:])
    assert {"rows8 gate_up 4-bit", "rows8 down mixed masked", "rows8 gather fp16 gate_up"} <= set(res)
    for name, v in res.items():
        assert 0 < v["regs"] <= 255 and v["spill_bytes"] == 0, (name, v)


# --- GPU ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral_stacks() -> dict[int, tuple]:
    """Mixtral-8x7B's expert shapes (H 4096, I 14336, 8 experts) in fp16, 4-bit stacks (mixed ones take the tile
    kernels in use: moe_exl2_rows.MIXED), built once (random EXL2 tensors on the CPU take most of the time)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = {}
    for uniform in (4,):
        g = torch.Generator().manual_seed(40 + uniform)
        perm = torch.stack([torch.randperm(4096, generator=g) for _ in range(8)])
        out[uniform] = tuple(s.to("cuda") for s in (
            _stack(8, 4096, 14336, g, torch.float16, perm, uniform, fast=True)[0],
            _stack(8, 4096, 14336, g, torch.float16, perm, uniform, fast=True)[0],
            _stack(8, 14336, 4096, g, torch.float16, None, uniform, fast=True)[0]))
    return out


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("uniform", [4])  # mixed stacks: interpreter-tested; in use they take the tile kernels
@pytest.mark.parametrize("T", [8, 16, 32])
def test_cuda_mixtral_shapes(mixtral_stacks: dict, uniform: int, T: int) -> None:
    """8, 16 and 32 tokens of top-2 routing over Mixtral-shaped EXL2 experts (2, 4 and 8 rows per expert on
    average, some expert with 0 where the draw leaves one out): the kernels equal the references; 16 and 32
    tokens are routed to them, 8 to the GEMV kernels."""
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])
    counts = torch.bincount(ids.reshape(-1), minlength=8).tolist()
    _check_gpu(counts, ids, uniform, mixtral_stacks[uniform])


def _check_gpu(counts: list[int], ids: torch.Tensor, uniform: int, stacks: tuple) -> None:
    from exlpy.kernels import moe_exl2, moe_exl2_rows

    gate, up, down = stacks
    g = torch.Generator().manual_seed(sum(counts) + uniform)
    ids = ids.to("cuda")
    # unit-scale inputs: fp16 down outputs of random experts overflow at the small cases' scale of 4
    x = torch.randn(ids.shape[0], 4096, generator=g).to("cuda", torch.float16)
    order, counts_t = reference.moe_sort(ids, 8)
    N = order.shape[0]
    ref_a = reference.moe_gate_up_exl2(x, order, counts_t, gate, up, 2, "silu")
    a = moe_exl2_rows.gate_up_rows(x, order, counts_t, gate, up, 2, "silu", uniform,
                                   torch.empty(N, 14336, dtype=torch.float16, device="cuda"))
    assert _rel(a, ref_a) < 5e-3, _rel(a, ref_a)
    assert _rel(moe_exl2.moe_gate_up_exl2(x, order, counts_t, gate, up, 2, "silu"), ref_a) < 5e-3
    ref_y = reference.moe_down_exl2(ref_a, order, counts_t, down)
    y = moe_exl2_rows.down_rows(ref_a, order, counts_t, down, uniform,
                                torch.empty(N, 4096, dtype=torch.float16, device="cuda"))
    assert torch.isfinite(y).all() and _rel(y, ref_y) < 5e-3, _rel(y, ref_y)
    assert _rel(moe_exl2.moe_down_exl2(ref_a, order, counts_t, down), ref_y) < 5e-3
    assert moe_exl2_rows.takes(N, 8, uniform) == (ids.shape[0] > 8)
