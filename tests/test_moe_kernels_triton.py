"""The grouped MoE kernels (exlpy/kernels/moe.py) against their torch references and the old whole-op torch path
(reference.moe_experts): small shapes on CPU under the Triton interpreter, Mixtral-8x7B layer shapes and CUDA-graph
capture on a GPU. Routings cover batch-1 decode, skewed loads (one expert takes a run of several row tiles),
experts no token chose (holding NaN, which must never be read), E not a power of two and sizes that are not
multiples of the tiles.

Tests marked `interpreter` run Triton's interpreter on CPU tensors: tests/conftest.py runs them in a child pytest
with TRITON_INTERPRET=1, so this session keeps compiled kernels for the CUDA tests.
"""

from __future__ import annotations

import os

import pytest
import torch

from exlpy.kernels import reference
from tests.conftest import requires_cuda
from tests.test_moe import check_replays_with_new_routing

triton = pytest.importorskip("triton")

from exlpy.kernels.moe import moe_combine, moe_down, moe_gate_up, moe_route, moe_sort, plan  # noqa: E402


def _cpu_ok() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def _routing(T: int, E: int, k: int, skew: bool, g: torch.Generator, device: str) -> torch.Tensor:
    """ids [T, k], k distinct experts per token; `skew`: expert 0 in every token, experts >= k never chosen."""
    if skew:
        rest = torch.stack([1 + torch.randperm(k - 1, generator=g) for _ in range(T)]) if k > 1 else None
        ids = torch.zeros(T, 1, dtype=torch.long) if rest is None else torch.cat(
            [torch.zeros(T, 1, dtype=torch.long), rest], dim=1)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return ids.to(device)


def _weights(E: int, H: int, inter: int, g: torch.Generator, device: str, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    if device != "cpu":  # real shapes: drawn on the device (GBs of fp32 on the host would take long)
        g = torch.Generator(device).manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    gu = (torch.randn(E, 2 * inter, H, generator=g, device=device) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, inter, generator=g, device=device) / inter ** 0.5).to(dtype)
    return gu, down


def _check(T: int, E: int, k: int, H: int, inter: int, skew: bool, kind: str = "silu", device: str = "cpu",
           dtype: torch.dtype = torch.float32, tol: float = 1e-5, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    gu, down = _weights(E, H, inter, g, device, dtype)
    ids = _routing(T, E, k, skew, g, device)
    unused = sorted(set(range(E)) - set(ids.reshape(-1).tolist()))
    if unused:  # never routed: must never be read
        gu[unused], down[unused] = float("nan"), float("nan")
    h = torch.randn(T, H, generator=g).to(device, dtype)
    w = torch.rand(T, k, generator=g).to(device, dtype)
    order, counts = moe_sort(ids, E)
    ref_order, ref_counts = reference.moe_sort(ids, E)
    assert torch.equal(order, ref_order) and torch.equal(counts, ref_counts)
    a = moe_gate_up(h, order, counts, gu, k, kind)
    ref_a = reference.moe_gate_up(h, order, counts, gu, k, kind)
    assert a.shape == ref_a.shape and torch.isfinite(a).all()
    assert _rel(a, ref_a) < tol
    y = moe_down(ref_a, order, counts, down)
    ref_y = reference.moe_down(ref_a, order, counts, down)
    assert y.shape == ref_y.shape and torch.isfinite(y).all()
    assert _rel(y, ref_y) < tol
    # the whole block: the kernels composed as ops.moe_experts composes them, against the old torch path
    out = moe_combine(moe_down(a, order, counts, down), w)
    assert _rel(out, reference.moe_experts(h, w, ids, gu, down, kind)) < tol


@pytest.mark.interpreter
@pytest.mark.parametrize("T,E,k,H,inter,skew", [
    (1, 8, 2, 48, 40, False),     # batch-1 decode: one row per routed expert
    (6, 5, 2, 40, 24, False),     # E not a power of two, sizes off the tiles
    (37, 4, 3, 32, 20, True),     # one expert owns 37 rows: three 16-row tiles; expert 3 never chosen
    (40, 3, 1, 24, 36, True),     # top-1, everything to expert 0 (64-row tiles)
])
def test_kernels_match_references(T: int, E: int, k: int, H: int, inter: int, skew: bool) -> None:
    _cpu_ok()
    _check(T, E, k, H, inter, skew)


@pytest.mark.interpreter
def test_narrow_column_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device with many SMs few routed experts take 16-column tiles (the plan as an H100 makes it)."""
    _cpu_ok()
    from exlpy.kernels import moe

    monkeypatch.setattr(moe, "_sms", lambda t: 132)
    assert moe.plan(2, 8, 4, 40, 132)[1] == 16
    _check(2, 8, 2, 48, 40, False)


@pytest.mark.interpreter
@pytest.mark.parametrize("N,E", [(300, 128), (2100, 5), (7, 3)])
def test_sort_equals_the_stable_torch_sort(N: int, E: int) -> None:
    """The counting sort over several chunks of pairs (CHUNK = 8192 / E_P2): the same order and counts as torch's
    stable argsort, with experts that get no pair."""
    _cpu_ok()
    ids = torch.randint(0, max(1, E - 1), (N, 1), generator=torch.Generator().manual_seed(N))
    order, counts = moe_sort(ids, E)
    ref_order, ref_counts = reference.moe_sort(ids, E)
    assert torch.equal(order, ref_order) and torch.equal(counts, ref_counts) and counts[-1] == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("E,k,norm_p", [(8, 2, 1.0), (60, 8, 0.0), (4, 3, 2.0), (128, 1, 0.5)])
def test_route_equals_softmax_topk(E: int, k: int, norm_p: float) -> None:
    """Softmax, top-k (k not a power of two too) and each renormalisation: the same experts as torch.topk, the
    same weights; NaN logits still name experts inside [0, E)."""
    _cpu_ok()
    g = torch.Generator().manual_seed(E + k)
    for dtype in (torch.float32, torch.float16):
        logits = (torch.randn(9, E, generator=g) * 3).to(dtype)
        w, ids = moe_route(logits, k, norm_p)
        ref_w, ref_ids = reference.moe_route(logits, k, norm_p)
        assert torch.equal(ids, ref_ids) and w.dtype == dtype
        assert _rel(w, ref_w) < (1e-6 if dtype == torch.float32 else 1e-3)
    logits[0] = float("nan")
    ids = moe_route(logits, k, norm_p)[1]
    assert ((ids >= 0) & (ids < E)).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_combine_with_and_without_residual(dtype: torch.dtype) -> None:
    _cpu_ok()
    g = torch.Generator().manual_seed(4)
    T, k, H = 5, 3, 1100  # H over one column block
    y, w = torch.randn(T * k, H, generator=g).to(dtype), torch.rand(T, k, generator=g).to(dtype)
    res = torch.randn(T, H, generator=g).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert _rel(moe_combine(y, w), reference.moe_combine(y, w)) < tol
    assert _rel(moe_combine(y, w, res), reference.moe_combine(y, w, res)) < tol


@pytest.mark.interpreter
def test_gelu_and_half_precision() -> None:
    _cpu_ok()
    _check(5, 4, 2, 32, 24, False, kind="gelu_tanh")
    _check(5, 4, 2, 32, 24, False, dtype=torch.float16, tol=5e-3)


def test_kernels_have_their_references_signatures() -> None:
    import inspect

    from exlpy.kernels import moe

    for name in ("moe_route", "moe_sort", "moe_gate_up", "moe_down", "moe_combine"):
        assert inspect.signature(getattr(moe, name)) == inspect.signature(getattr(reference, name)), name


def test_grid_covers_every_routing() -> None:
    """The row tiles the kernels need, sum over experts of ceil(count / BLOCK_M), never exceed the fixed grid
    `plan` sizes from N and E alone, for any routing (every count vector summing to N)."""
    g = torch.Generator().manual_seed(0)
    for N, E in [(1, 8), (2, 8), (8, 128), (64, 8), (256, 128), (4096, 8), (700, 60)]:
        bm, _, _, _, tiles = plan(N, E)
        worst = 0
        for trial in range(200):
            n_used = min(E, N) if trial == 0 else int(torch.randint(1, min(E, N) + 1, (1,), generator=g))
            cut = torch.sort(torch.randperm(N - 1, generator=g)[:n_used - 1] + 1).values.tolist() if N > 1 else []
            counts = [b - a for a, b in zip([0, *cut], [*cut, N])]
            worst = max(worst, sum(-(-c // bm) for c in counts))
        assert worst <= tiles


# --- GPU ------------------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 300])
def test_cuda_mixtral_layer_shapes(T: int) -> None:
    """Mixtral-8x7B's expert shapes (H 4096, I 14336, 8 experts, top 2) in fp16, through ops (the Triton kernels)."""
    from exlpy.kernels import ops

    _check(T, 8, 2, 4096, 14336, False, device="cuda", dtype=torch.float16, tol=5e-3, seed=T)
    g = torch.Generator().manual_seed(1)
    gu, down = _weights(8, 4096, 14336, g, "cuda", torch.float16)
    ids = _routing(T, 8, 2, False, g, "cuda")
    h = torch.randn(T, 4096, generator=g).to("cuda", torch.float16)
    w = torch.rand(T, 2, generator=g).to("cuda", torch.float16)
    assert _rel(ops.moe_experts(h, w, ids, gu, down, "silu"), reference.moe_experts(h, w, ids, gu, down, "silu")) \
        < 5e-3


@requires_cuda
@pytest.mark.gpu
def test_cuda_graph_capture_and_replay_with_new_routing() -> None:
    """ops.moe_experts captured once in a CUDA graph (capture refuses any host sync), replayed with other tokens
    routed elsewhere: each replay equals the eager result of its own routing."""
    from exlpy.kernels import ops

    T, E, k, H, inter = 4, 16, 4, 512, 384
    g = torch.Generator().manual_seed(2)
    gu, down = _weights(E, H, inter, g, "cuda", torch.float16)
    h = torch.zeros(T, H, dtype=torch.float16, device="cuda")
    w = torch.zeros(T, k, dtype=torch.float16, device="cuda")
    ids = torch.zeros(T, k, dtype=torch.long, device="cuda")

    def refill(seed: int) -> None:
        gg = torch.Generator().manual_seed(seed)
        h.copy_(torch.randn(T, H, generator=gg))
        w.copy_(torch.rand(T, k, generator=gg))
        ids.copy_(_routing(T, E, k, seed % 2 == 0, gg, "cpu"))

    check_replays_with_new_routing(lambda: ops.moe_experts(h, w, ids, gu, down, "silu"), refill,
                                   lambda: reference.moe_experts(h, w, ids, gu, down, "silu"))


# --- the kernels inside a model ----------------------------------------------------------------------------------
_MOE_OPS = {"moe_route", "moe_sort", "moe_gate_up", "moe_down", "moe_combine"}


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])  # DBRX differs in what the kernels don't see
def test_models_through_the_kernels_match_hf(tmp_path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Tiny random models written by transformers, prefill then token-by-token decode on CPU tensors with every
    MoE op routed to its Triton kernel (the interpreter): HF fp32's logits."""
    _cpu_ok()
    import exlpy.kernels.triton_ops  # noqa: F401 - registers the kernels
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
    from exlpy.kernels import ops
    from tests.arch_models import VOCAB, make_arch_model
    from tests.conftest import rel_err

    hf = make_arch_model(tmp_path, case)
    config = ExLlamaV2Config(str(tmp_path))
    config.max_seq_len = 32
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, batch_size=2, lazy=True)
    model.load(device="cpu")
    ids = torch.randint(2, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf(ids).logits  # type: ignore[operator]
    used: set[str] = set()

    def impl(name: str, t: torch.Tensor):  # noqa: ANN202
        if name in _MOE_OPS:
            used.add(name)
            return ops._TRITON[name]
        return getattr(reference, name)

    monkeypatch.setattr(ops, "_impl", impl)
    got = [model.forward(ids[:, :8], cache)] + [model.forward(ids[:, i:i + 1], cache) for i in range(8, 10)]
    assert used == _MOE_OPS
    assert rel_err(torch.cat(got, dim=1), want) <= 2e-3
