"""One-shot all-reduce through mapped host memory, for GPUs *without* peer access (single process).

On a GPU pair without P2P (PCIe machines, virtual machines that hide the peer path) the peer kernel
(peer_allreduce.py) cannot run and NCCL falls back to its shared-memory transport: a chain of copies through
host buffers and a protocol sized for large messages, which a decode step pays 17-19 times for a few KB
each. Here every GPU writes its partial straight into one pinned host buffer (the GPU sees pinned memory
through unified addressing: stores and loads go over PCIe, no copy engine), raises a flag there, waits for
the other GPUs' flags and sums their partials, read back over PCIe: one kernel per GPU, one PCIe write and
N - 1 reads of the message, one flag exchange. The load-time timing (parallel/tp_comm.py) keeps it only
where it beats NCCL, and only up to the message size where it does.

Protocol, per program b (tile b of BLOCK elements; BLOCK is fixed, so tile b always belongs to program b):
  1. e = epochs[b] + 1 (a per-program counter in this GPU's memory, advanced identically on every GPU
     because every GPU makes the same sequence of calls), parity = e % 2;
  2. store our tile into the shared buffer [parity, our rank, tile b]; a CTA barrier, then a release
     (system scope) store of e into the shared flag [b, our rank];
  3. wait (acquire, system scope) until the flag [b, j] of every other rank j is e (or e + 1: j may already
     have finished this call and raised its next flag), then a CTA barrier;
  4. sum every rank's tile in rank order in float32 (our own from registers), so that every GPU computes
     bit-identical sums and the replicated residual streams never drift apart; store; epochs[b] = e.
Two parities suffice as in the peer kernel: at count e + 2 we overwrite [parity(e), rank], which the others
read at count e; at count e + 1 we waited for their flag e + 1, raised only after their count-e kernel
completed (kernels on one stream run in order).

The flags are plain release stores and acquire loads (inline PTX), never read-modify-write atomics: atomics
to host memory are not atomic over a PCIe link without native host atomics (cudaDevAttrHostNativeAtomic
Supported is 0 on most x86 machines), and a lost update would be a missed flag. The Triton interpreter
(CPU tests) takes the same protocol with atomics (`ASM=False`), which are exact there.
A wait gives up after `spin` polls (a rank that never comes: the result is then wrong, but nothing hangs);
`errors[0]` counts such give-ups. One thread drives a state at a time (see peer_allreduce.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exlpy.kernels.allreduce_flags import (  # noqa: F401 - MAX_SLOTS, NORM_*: this collective's limits too
    MAX_SLOTS,
    NORM_HIDDEN,
    NORM_MAXN,
    NORM_ROWS,
    SLOTS,
    FlagState,
    norm_launch,
    row_prologue,
    store_release,
    store_sum_norm,
    sum_rows,
    wait_flags,
)
from exlpy.kernels.allreduce_flags import fits as _fits
from exlpy.kernels.allreduce_flags import norm_fits as _norm_fits

MAX_PROGRAMS = 256
BLOCK = 2048  # elements per program: four programs (four PCIe streams) for a 70B hidden row, 128 at batch 32
MAX_NUMEL = MAX_PROGRAMS * BLOCK  # 512K elements (batch 64 of hidden 8192); larger messages go to NCCL
SPIN = 1 << 22  # polls of host memory (~1 µs each over PCIe): seconds, only a rank that never launches hits it


# Every GPU runs the *same* compiled kernel (rank and size not specialised: a compile for rank 1 while rank
# 0's kernel already waits at the flags would stall it).
@triton.jit(do_not_specialize=["numel", "rank", "spin"])
def _host_allreduce_kernel(x, buf, flags, epochs, errors, numel, rank, spin, N: tl.constexpr,
                           BLOCK: tl.constexpr, MAXN: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(epochs + b) + 1
    par = e % 2
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    if EVEN:  # whole tiles: unmasked, so the PCIe traffic goes in 16-byte vectors
        mine = tl.load(x + offs)
        tl.store(buf + (par * N + rank) * MAXN + offs, mine)
    else:
        mine = tl.load(x + offs, mask=mask, other=0.0)
        tl.store(buf + (par * N + rank) * MAXN + offs, mine, mask=mask)
    tl.debug_barrier()  # every thread's stores are issued before the flag says so (release below)
    store_release(flags + b * SLOTS + rank, e, ASM)
    wait_flags(flags, b, rank, e, spin, errors, N, True, ASM)
    tl.debug_barrier()  # the acquire above orders every thread's loads of the other tiles
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(N):  # rank order on every GPU: identical sums everywhere
        if j == rank:
            acc += mine.to(tl.float32)
        elif EVEN:
            acc += tl.load(buf + (par * N + j) * MAXN + offs, cache_modifier=".cv").to(tl.float32)
        else:
            acc += tl.load(buf + (par * N + j) * MAXN + offs, mask=mask, other=0.0,
                           cache_modifier=".cv").to(tl.float32)
    if EVEN:
        tl.store(x + offs, acc.to(x.dtype.element_ty))
    else:
        tl.store(x + offs, acc.to(x.dtype.element_ty), mask=mask)
    tl.store(epochs + b, e)


@triton.jit(do_not_specialize=["rank", "spin"])
def _host_allreduce_norm_kernel(x, h, w, buf, flags, epochs, errors, hidden, rank, spin, eps, N: tl.constexpr,
                                BLOCK_H: tl.constexpr, MAXN: tl.constexpr, ASM: tl.constexpr):
    """The all-reduce of [rows, hidden] with the next block's RMSNorm in its epilogue: program b owns row b
    (the same protocol as above, a row per tile), stores the sum into x and rms_norm(sum) * w into h, rounded
    exactly as the sum's own kernel and the RMSNorm kernel (kernels/rmsnorm.py) would."""
    b, e, par, cols, cmask, offs, mine = row_prologue(x, epochs, hidden, BLOCK_H)
    tl.store(buf + (par * N + rank) * MAXN + offs, mine, mask=cmask)
    tl.debug_barrier()
    store_release(flags + b * SLOTS + rank, e, ASM)
    wait_flags(flags, b, rank, e, spin, errors, N, True, ASM)
    tl.debug_barrier()
    acc = sum_rows(mine, buf, par, offs, cmask, rank, N, MAXN, BLOCK_H, ".cv")
    store_sum_norm(x, h, w, acc, offs, cols, cmask, hidden, eps)
    tl.store(epochs + b, e)


class HostState(FlagState):
    """The shared pinned buffer ([2 parities, N ranks, `maxn`] elements of 4 bytes, viewed as the dtype of
    each call: 8 MB for 2 GPUs and the defaults) and flags ([`programs`, MAX_SLOTS] int32) in host memory;
    per-program epochs and an error counter on every GPU (allreduce_flags.FlagState)."""

    def __init__(self, devices: list[torch.device], programs: int = MAX_PROGRAMS, maxn: int = MAX_NUMEL) -> None:
        super().__init__(devices, programs, maxn, "host-memory all-reduce")
        pin = any(d.type == "cuda" for d in devices)
        self.buf = torch.zeros(2 * len(devices) * maxn, dtype=torch.float32, pin_memory=pin)
        self.flags = torch.zeros(programs * MAX_SLOTS, dtype=torch.int32, pin_memory=pin)

    def buf_as(self, dtype: torch.dtype) -> torch.Tensor:
        return self._views_as(dtype, [self.buf])[0]


def fits(t: torch.Tensor) -> bool:
    return _fits(t, MAX_NUMEL)


def host_all_reduce(tensors: list[torch.Tensor], state: HostState, spin: int = SPIN) -> None:
    """In-place sum over `tensors` (one per device of `state`, same shape, contiguous, at most MAX_NUMEL
    elements): one kernel per GPU on its device's current stream. Reference: `reference.host_all_reduce`."""
    n = len(tensors)
    numel = tensors[0].numel()
    assert all(fits(t) for t in tensors), f"host all-reduce takes contiguous tensors of <= {MAX_NUMEL} elements"
    programs = triton.cdiv(numel, BLOCK)
    buf = state.buf_as(tensors[0].dtype)
    asm = tensors[0].is_cuda  # the interpreter (CPU tensors) takes the atomics
    for rank, t in enumerate(tensors):
        with _device(t):
            _host_allreduce_kernel[(programs,)](t, buf, state.flags, state.epochs[rank], state.errors[rank], numel,
                                                rank, spin, N=n, BLOCK=BLOCK, MAXN=MAX_NUMEL,
                                                EVEN=numel % BLOCK == 0, ASM=asm,
                                                num_warps=4)


def _device(t: torch.Tensor):  # noqa: ANN202 - a context manager
    import contextlib

    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def norm_fits(t: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused all-reduce + RMSNorm kernel takes `t` ([rows, hidden], the norm's dtype)."""
    return _norm_fits(t, weight, MAX_NUMEL)


def host_all_reduce_norm(tensors: list[torch.Tensor], weights: list[torch.Tensor], eps: float, state: HostState,
                         spin: int = SPIN) -> list[torch.Tensor]:
    """In-place sum over `tensors` ([..., hidden], one per device of `state`, a NORM_ROWS / NORM_MAXN state)
    and, per device, rms_norm(sum, weights[k], eps) as a new tensor: one kernel per GPU. Reference:
    `reference.host_all_reduce_norm`."""
    n = len(tensors)
    hidden, rows, block, warps = norm_launch(tensors)
    assert all(norm_fits(t, w) for t, w in zip(tensors, weights)), "fused all-reduce + norm: unsupported shape"
    buf = state.buf_as(tensors[0].dtype)
    outs = [torch.empty_like(t) for t in tensors]
    for rank, (t, w, h) in enumerate(zip(tensors, weights, outs)):
        with _device(t):
            _host_allreduce_norm_kernel[(rows,)](t, h, w, buf, state.flags, state.epochs[rank], state.errors[rank],
                                                 hidden, rank, spin, eps, N=n, BLOCK_H=block, MAXN=state.maxn,
                                                 ASM=t.is_cuda, num_warps=warps)
    return outs
