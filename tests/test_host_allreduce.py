"""The host-memory all-reduce (kernels/host_allreduce.py): tensor parallelism's collective for GPUs without P2P.

The interpreter runs one rank's programs after the other's, so a rank that goes first cannot see the second
arrive: it gives up after `spin` polls (counted), and the rank that goes second sees the first's tile and flag
and must produce the exact sum. Alternating which rank goes second walks the epochs and both parities through
the same sequence a GPU pair makes. On a GPU, two streams of one device are two ranks that really wait for
each other (`gpu`); on two GPUs the TP tests run it inside captured decode steps (tests/test_multi_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from exlpy.kernels import ops, reference
from tests.conftest import requires_cuda

triton = pytest.importorskip("triton")

from exlpy.kernels.host_allreduce import BLOCK, HostState  # noqa: E402


def _interp() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")


def _launch(state: HostState, rank: int, t: torch.Tensor, n: int, spin: int) -> None:
    """One rank's kernel alone (host_all_reduce launches every rank in turn)."""
    from exlpy.kernels.host_allreduce import MAX_NUMEL, _host_allreduce_kernel

    numel = t.numel()
    _host_allreduce_kernel[(triton.cdiv(numel, BLOCK),)](
        t, state.buf_as(t.dtype), state.flags, state.epochs[rank], state.errors[rank], numel, rank, spin, N=n,
        BLOCK=BLOCK, MAXN=MAX_NUMEL, EVEN=numel % BLOCK == 0, ASM=t.is_cuda, num_warps=4)


@pytest.mark.interpreter
@pytest.mark.parametrize("shape,dtype", [((1, 4096), torch.float16), ((3, 1000), torch.float32),
                                         ((2, 2048), torch.bfloat16)])
def test_second_rank_sums_exactly(shape: tuple[int, int], dtype: torch.dtype) -> None:
    _interp()
    state = HostState([torch.device("cpu")] * 2)
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    programs = triton.cdiv(shape[0] * shape[1], BLOCK)
    for call in range(5):  # epochs 1..5: both parities, both orders
        xs = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
        want = [x.clone() for x in xs]
        reference.host_all_reduce(want)
        first, second = (0, 1) if call % 2 == 0 else (1, 0)
        before = [int(e.item()) for e in state.errors]
        _launch(state, first, xs[first], 2, spin=3)  # waits for a rank that has not run: gives up
        _launch(state, second, xs[second], 2, spin=3)
        if dtype == torch.bfloat16:  # the interpreter rounds float32 -> bf16 its own way (one ulp off at ties)
            torch.testing.assert_close(xs[second], want[second], atol=0, rtol=2 ** -7)
        else:  # bit-identical: float32 sum in rank order, one rounding
            assert torch.equal(xs[second], want[second])
        assert int(state.errors[first].item()) == before[first] + programs
        assert int(state.errors[second].item()) == before[second]
        assert all(bool((e[:programs] == call + 1).all()) for e in state.epochs)


@pytest.mark.interpreter
def test_flag_one_ahead_is_accepted() -> None:
    """A rank that already finished this call and raised its next flag (e + 1) still releases the waiter."""
    _interp()
    state = HostState([torch.device("cpu")] * 2)
    x0, x1 = torch.ones(BLOCK), torch.full((BLOCK,), 2.0)
    _launch(state, 1, x1.clone(), 2, spin=2)  # rank 1 at call 1: flag 1, data at parity 1
    _launch(state, 1, x1.clone(), 2, spin=2)  # rank 1 at call 2: flag 2 (one ahead of rank 0's call 1)
    _launch(state, 0, x0, 2, spin=2)
    assert int(state.errors[0].item()) == 0
    assert bool((x0 == 3.0).all())


def test_reference_and_dispatch_on_cpu() -> None:
    """ops.host_all_reduce on CPU tensors is the reference: every tensor gets the float32 sum."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 33, generator=g).half() for _ in range(3)]
    want = sum(x.float() for x in xs).half()
    ops.host_all_reduce(xs, None)
    for x in xs:
        assert torch.equal(x, want)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", [(1, 8192), (3, 1000), (32, 8192)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_two_streams_equal_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Two ranks on two streams of one GPU wait for each other through pinned host memory (20 calls)."""
    dev = torch.device("cuda", 0)
    state = HostState([dev, dev])
    streams = [torch.cuda.Stream(dev) for _ in range(2)]
    g = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    for _ in range(20):
        xs = [torch.randn(shape, generator=g).to(dev, dtype) for _ in range(2)]
        want = [x.clone() for x in xs]
        reference.host_all_reduce(want)
        torch.cuda.synchronize(dev)
        for rank, s in enumerate(streams):
            with torch.cuda.stream(s):
                _launch(state, rank, xs[rank], 2, spin=1 << 22)
        torch.cuda.synchronize(dev)
        for x, w in zip(xs, want):
            assert torch.equal(x, w)
    assert state.error_count() == 0


# In a child process without TRITON_INTERPRET (set when the suite runs under it), where kernels compile.
COMPILE = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from exlpy.kernels.host_allreduce import BLOCK, MAX_NUMEL, _host_allreduce_kernel
sig = {"x": "*fp16", "buf": "*fp16", "flags": "*i32", "epochs": "*i32", "errors": "*i32", "numel": "i32",
       "rank": "i32", "spin": "i32", "N": "constexpr", "BLOCK": "constexpr", "MAXN": "constexpr",
       "EVEN": "constexpr", "ASM": "constexpr"}
src = ASTSource(_host_allreduce_kernel, sig, constexprs={"N": 2, "BLOCK": BLOCK, "MAXN": MAX_NUMEL, "EVEN": True,
                                                         "ASM": True},
                attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("PTX " + json.dumps(k.asm["ptx"]))
"""


@pytest.mark.xfail(reason="Triton 3.6 (the GPU image) emits no ld.global.cv.v4 for the data loads (H100, 2026-11-26); "
                   "the plain all-reduce's two-stream test passed there", strict=False)
def test_host_allreduce_compiles_with_plain_release_acquire_flags() -> None:
    """sm_90 PTX: flags by st.release.sys / ld.acquire.sys (no read-modify-write atomics on host memory, which
    PCIe links without native host atomics do not make atomic), the others' tiles read uncached in 16-byte
    vectors, CTA barriers around the flag exchange."""
    import re

    from tests.test_peer_allreduce_compile import child_ptx

    ptx = child_ptx(COMPILE)
    assert re.search(r"st\.release\.sys\.global\.u32", ptx)
    assert re.search(r"ld\.acquire\.sys\.global\.u32", ptx)
    assert not re.search(r"atom\.[^\n]*sys", ptx)  # the only atomic is the device-local error counter
    assert re.search(r"ld\.global\.cv\.v4", ptx)
    assert ptx.count("bar.sync") >= 2


def test_hostmem_backend_refused_on_cpu_devices() -> None:
    """EXLPY_TP_COMM=hostmem over devices that are not distinct GPUs: a typed error naming the backend."""
    from exlpy.errors import TensorParallelError
    from exlpy.parallel.tp_comm import host_mem_comm, make_comm
    from exlpy.runtime import RuntimeOptions

    assert RuntimeOptions(tp_comm="hostmem").tp_comm == "hostmem"
    devs = [torch.device("cpu"), torch.device("cpu")]
    assert host_mem_comm(devs, None) is None  # type: ignore[arg-type]
    with pytest.raises(TensorParallelError, match="hostmem"):
        make_comm(devs, "hostmem")


def _launch_norm(state: HostState, rank: int, t: torch.Tensor, w: torch.Tensor, h: torch.Tensor, n: int,
                 spin: int) -> None:
    from exlpy.kernels.host_allreduce import _host_allreduce_norm_kernel

    hidden = t.shape[-1]
    _host_allreduce_norm_kernel[(t.numel() // hidden,)](
        t, h, w, state.buf_as(t.dtype), state.flags, state.epochs[rank], state.errors[rank], hidden, rank, spin,
        1e-5, N=n, BLOCK_H=triton.next_power_of_2(hidden), MAXN=state.maxn, ASM=t.is_cuda, num_warps=4)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows,hidden,dtype", [(3, 96, torch.float32), (2, 128, torch.float16)])
def test_fused_norm_second_rank_exact(rows: int, hidden: int, dtype: torch.dtype) -> None:
    """The fused all-reduce + RMSNorm: the rank that goes second gets the reference sum and norm."""
    _interp()
    from exlpy.kernels.host_allreduce import NORM_MAXN, NORM_ROWS

    state = HostState([torch.device("cpu")] * 2, NORM_ROWS, NORM_MAXN)
    g = torch.Generator().manual_seed(rows + hidden)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    for call in range(4):
        xs = [torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2)]
        want = [x.clone() for x in xs]
        want_h = reference.host_all_reduce_norm(want, [w, w], 1e-5)
        hs = [torch.empty_like(x) for x in xs]
        first, second = (0, 1) if call % 2 == 0 else (1, 0)
        before = int(state.errors[second].item())
        _launch_norm(state, first, xs[first], w, hs[first], 2, spin=3)
        _launch_norm(state, second, xs[second], w, hs[second], 2, spin=3)
        assert torch.equal(xs[second], want[second])
        torch.testing.assert_close(hs[second], want_h[second], atol=2e-3 if dtype == torch.float16 else 1e-6,
                                   rtol=1e-3 if dtype == torch.float16 else 1e-6)
        assert int(state.errors[second].item()) == before


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows,hidden", [(2, 8192), (32, 8192), (5, 1000), (64, 4096)])
@pytest.mark.xfail(reason="the fused all-reduce + norm failed here on an H100 (Triton 3.6, 2026-11-26) at (32, 8192) "
                   "and (64, 4096); HostMemComm does not offer it (fuses_norm False) until it passes", strict=False)
def test_fused_norm_two_streams(rows: int, hidden: int) -> None:
    """Two ranks on two streams of one GPU: sums equal the reference bit for bit, norms equal the RMSNorm
    kernel's (ops.rms_norm) of the sum bit for bit."""
    from exlpy.kernels import ops
    from exlpy.kernels.host_allreduce import NORM_MAXN, NORM_ROWS

    dev = torch.device("cuda", 0)
    state = HostState([dev, dev], NORM_ROWS, NORM_MAXN)
    streams = [torch.cuda.Stream(dev) for _ in range(2)]
    g = torch.Generator().manual_seed(rows * 7 + hidden)
    w = (torch.rand(hidden, generator=g) + 0.5).half().to(dev)
    for _ in range(10):
        xs = [torch.randn(rows, hidden, generator=g).half().to(dev) for _ in range(2)]
        want = [x.clone() for x in xs]
        reference.host_all_reduce(want)
        hs = [torch.empty_like(x) for x in xs]
        torch.cuda.synchronize(dev)
        for rank, s in enumerate(streams):
            with torch.cuda.stream(s):
                _launch_norm(state, rank, xs[rank], w, hs[rank], 2, spin=1 << 22)
        torch.cuda.synchronize(dev)
        for x, h, want_x in zip(xs, hs, want):
            assert torch.equal(x, want_x)
            assert torch.equal(h, ops.rms_norm(want_x, w, 1e-5))
    assert state.error_count() == 0


# The peer-memory twin of the fused kernel (kernels/peer_allreduce.py, GPUs with P2P): same checks.
def _launch_peer_norm(state: object, rank: int, t: torch.Tensor, w: torch.Tensor, h: torch.Tensor, spin: int
                      ) -> None:
    from exlpy.kernels.peer_allreduce import MAX_SLOTS, _allreduce_norm_kernel

    recv = state.recv_as(t.dtype)  # type: ignore[attr-defined]
    flags = state.flags  # type: ignore[attr-defined]
    n = len(recv)
    hidden = t.shape[-1]
    _allreduce_norm_kernel[(t.numel() // hidden,)](
        t, h, w, *recv, *([recv[0]] * (MAX_SLOTS - n)), *flags, *([flags[0]] * (MAX_SLOTS - n)), recv[rank],
        flags[rank], state.epochs[rank], state.errors[rank], hidden, rank, spin, 1e-5, N=n,  # type: ignore[attr-defined]
        BLOCK_H=triton.next_power_of_2(hidden), MAXN=state.maxn, num_warps=4)  # type: ignore[attr-defined]


@pytest.mark.interpreter
def test_peer_fused_norm_second_rank_exact() -> None:
    _interp()
    from exlpy.kernels.peer_allreduce import NORM_MAXN, NORM_ROWS, PeerState

    state = PeerState([torch.device("cpu")] * 2, NORM_ROWS, NORM_MAXN)
    g = torch.Generator().manual_seed(11)
    w = torch.rand(96, generator=g) + 0.5
    for call in range(4):
        xs = [torch.randn(3, 96, generator=g) for _ in range(2)]
        want = [x.clone() for x in xs]
        want_h = reference.host_all_reduce_norm(want, [w, w], 1e-5)
        hs = [torch.empty_like(x) for x in xs]
        first, second = (0, 1) if call % 2 == 0 else (1, 0)
        before = int(state.errors[second].item())
        _launch_peer_norm(state, first, xs[first], w, hs[first], spin=3)
        _launch_peer_norm(state, second, xs[second], w, hs[second], spin=3)
        assert torch.equal(xs[second], want[second])
        torch.testing.assert_close(hs[second], want_h[second], atol=1e-6, rtol=1e-6)
        assert int(state.errors[second].item()) == before


PEER_COMPILE = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from exlpy.kernels.peer_allreduce import NORM_MAXN, _allreduce_norm_kernel
sig = {n: "*fp16" for n in ["x", "h", "w"] + [f"r{i}" for i in range(8)] + ["recv_mine"]}
sig |= {n: "*i32" for n in [f"f{i}" for i in range(8)] + ["flags_mine", "epochs", "errors"]}
sig |= {"hidden": "i32", "rank": "i32", "spin": "i32", "eps": "fp32", "N": "constexpr", "BLOCK_H": "constexpr",
        "MAXN": "constexpr"}
src = ASTSource(_allreduce_norm_kernel, sig, constexprs={"N": 2, "BLOCK_H": 8192, "MAXN": NORM_MAXN})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
print("PTX " + json.dumps(k.asm["ptx"]))
"""


def test_peer_fused_norm_compiles() -> None:
    import re

    from tests.test_peer_allreduce_compile import child_ptx

    ptx = child_ptx(PEER_COMPILE)
    assert re.search(r"atom\.global\.sys\.release\.exch", ptx) and re.search(r"\.sys\.acquire", ptx)
    assert ptx.count("bar.sync") >= 2
