"""One-shot all-reduce over peer memory for decode-sized messages (single process, GPUs with P2P access).

A decode step of a tensor-parallel model needs one all-reduce of a few KB (batch 1) to 1 MB (batch 64) per
closing projection; a general-purpose collective pays a fixed protocol cost for such a message. Here each GPU
*pushes* its partial into every peer's receive buffer over NVLink and raises one flag per peer, waits for the
peers' flags, and sums its own partial with what it received: one kernel per GPU and a single flag exchange
per call (the previous design pulled the peers' partials and needed a second barrier so that nobody
overwrote a partial still being read: 10 µs a call at batch 1, 25 µs at batch 32 on two H200s).

Protocol, per program b (tile b of BLOCK elements; BLOCK is fixed, so tile b always belongs to program b):
  1. e = epochs[b] + 1 (a per-program counter in local memory, advanced identically on every GPU because
     every GPU makes the same sequence of calls), parity = e % 2;
  2. store our tile into every peer's receive buffer [parity, our rank, tile b]; a CTA barrier, then a
     release (system scope) store of e into each peer's flag [b, our rank];
  3. wait (acquire) until our flags [b, j] from every peer j equal e, then a CTA barrier;
  4. sum our tile and the received ones in float32, store into our tensor, epochs[b] = e.
Why two receive buffers suffice: at count e + 2 we overwrite the peer's [parity(e)] buffer; the peer read it
at count e, and we know it finished count e because at count e + 1 we waited for its flag e + 1, which it
raised only after its kernel of count e had completed (kernels on one stream run in order).
Waits compare for equality, so counters may wrap. A wait gives up after `spin` polls (a peer that never
comes: the result is then wrong, but the GPU is not hung); `errors[0]` counts such give-ups.
One thread drives a state at a time: two threads interleaving their ranks' launches on the same streams can
make each GPU wait for a kernel queued behind its own (NCCL's single-process group calls share this rule).
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
    store_sum_norm,
    sum_rows,
    wait_flags,
)
from exlpy.kernels.allreduce_flags import fits as _fits
from exlpy.kernels.allreduce_flags import norm_fits as _norm_fits

MAX_PROGRAMS = 128
BLOCK = 4096  # elements per program: two programs for a 70B hidden row, 64 for batch 32
MAX_NUMEL = MAX_PROGRAMS * BLOCK  # 512K elements: batch 64 of hidden 8192; larger messages go to NCCL
SPIN = 1 << 24  # polls, well over a second: only a peer that never launches hits it


@triton.jit
def _pick(j: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    if j == 0:
        return p0
    elif j == 1:
        return p1
    elif j == 2:
        return p2
    elif j == 3:
        return p3
    elif j == 4:
        return p4
    elif j == 5:
        return p5
    elif j == 6:
        return p6
    else:
        return p7


# Every GPU must run the *same* compiled kernel without a compile in between: a rank (or size) specialised
# by Triton would compile for rank 1 while rank 0's kernel already waits at the barrier.
@triton.jit(do_not_specialize=["numel", "rank", "spin"])
def _allreduce_kernel(x, r0, r1, r2, r3, r4, r5, r6, r7, f0, f1, f2, f3, f4, f5, f6, f7, recv_mine, flags_mine,
                      epochs, errors, numel, rank, spin, N: tl.constexpr, BLOCK: tl.constexpr,
                      MAXN: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(epochs + b) + 1
    par = e % 2
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    mine = tl.load(x + offs, mask=mask, other=0.0)
    for j in tl.static_range(N):  # push our tile into slot `rank` of every peer's receive buffer
        if j != rank:
            dst = _pick(j, r0, r1, r2, r3, r4, r5, r6, r7)
            tl.store(dst + (par * N + rank) * MAXN + offs, mine, mask=mask)
    tl.debug_barrier()  # every thread's stores are issued before the flags say so (release below)
    for j in tl.static_range(N):
        if j != rank:
            peer = _pick(j, f0, f1, f2, f3, f4, f5, f6, f7)
            tl.atomic_xchg(peer + b * SLOTS + rank, e, sem="release", scope="sys")
    wait_flags(flags_mine, b, rank, e, spin, errors, N, False, False)
    tl.debug_barrier()  # the acquire above orders every thread's loads of the received tiles
    acc = mine.to(tl.float32)
    for j in tl.static_range(N):
        if j != rank:
            acc += tl.load(recv_mine + (par * N + j) * MAXN + offs, mask=mask, other=0.0,
                           cache_modifier=".cg").to(tl.float32)
    tl.store(x + offs, acc.to(x.dtype.element_ty), mask=mask)
    tl.store(epochs + b, e)


@triton.jit(do_not_specialize=["rank", "spin"])
def _allreduce_norm_kernel(x, h, w, r0, r1, r2, r3, r4, r5, r6, r7, f0, f1, f2, f3, f4, f5, f6, f7, recv_mine,
                           flags_mine, epochs, errors, hidden, rank, spin, eps, N: tl.constexpr,
                           BLOCK_H: tl.constexpr, MAXN: tl.constexpr):
    """The all-reduce of [rows, hidden] with the next block's RMSNorm in its epilogue (batched decode): program
    b owns row b, pushes it to every peer as above, sums every rank's row in rank order (identical bits on
    every GPU), stores the sum into x and rms_norm(sum) * w into h, rounded as kernels/rmsnorm.py rounds. A
    peer already one call ahead (flag e + 1) also releases the wait."""
    b, e, par, cols, cmask, offs, mine = row_prologue(x, epochs, hidden, BLOCK_H)
    for j in tl.static_range(N):
        if j != rank:
            dst = _pick(j, r0, r1, r2, r3, r4, r5, r6, r7)
            tl.store(dst + (par * N + rank) * MAXN + offs, mine, mask=cmask)
    tl.debug_barrier()
    for j in tl.static_range(N):
        if j != rank:
            peer = _pick(j, f0, f1, f2, f3, f4, f5, f6, f7)
            tl.atomic_xchg(peer + b * SLOTS + rank, e, sem="release", scope="sys")
    wait_flags(flags_mine, b, rank, e, spin, errors, N, True, False)
    tl.debug_barrier()
    acc = sum_rows(mine, recv_mine, par, offs, cmask, rank, N, MAXN, BLOCK_H, ".cg")
    store_sum_norm(x, h, w, acc, offs, cols, cmask, hidden, eps)
    tl.store(epochs + b, e)


class PeerState(FlagState):
    """Flags and the receive buffers on every slot's device, besides FlagState's per-program epochs and error
    counters (zeroed together). A receive buffer holds [2 parities, N slots, `maxn`] elements of 4 bytes, viewed
    as the dtype of each call (8 MB per GPU for 2 GPUs and the defaults)."""

    def __init__(self, devices: list[torch.device], programs: int = MAX_PROGRAMS, maxn: int = MAX_NUMEL) -> None:
        super().__init__(devices, programs, maxn, "peer all-reduce")
        n = len(devices)
        self.flags = [torch.zeros(programs * MAX_SLOTS, dtype=torch.int32, device=d) for d in devices]
        self.recv = [torch.zeros(2 * n * maxn, dtype=torch.float32, device=d) for d in devices]

    def recv_as(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The receive buffers viewed as `dtype`, [2 * N * maxn] elements each (the rest unused)."""
        return self._views_as(dtype, self.recv)


def fits(t: torch.Tensor) -> bool:
    return _fits(t, MAX_NUMEL)


def peer_all_reduce(tensors: list[torch.Tensor], state: PeerState, spin: int = SPIN) -> None:
    """In-place sum over `tensors` (one per device of `state`, same shape, contiguous): one kernel per GPU,
    each launched on its device's current stream. Reference: `reference.peer_all_reduce`."""
    n = len(tensors)
    numel = tensors[0].numel()
    assert all(fits(t) for t in tensors), f"peer all-reduce takes contiguous tensors of <= {MAX_NUMEL} elements"
    programs = triton.cdiv(numel, BLOCK)
    recv = state.recv_as(tensors[0].dtype)
    pad = [recv[0]] * (MAX_SLOTS - n)
    fpad = [state.flags[0]] * (MAX_SLOTS - n)
    # Not launched with PDL (exlpy/kernels/pdl.py): tried on two H200s (2026-11-26), the multi-GPU tests then hung
    # in their first tensor-parallel forward (not diagnosed), and the benchmark's gain was within run-to-run noise.
    for rank, t in enumerate(tensors):
        with torch.cuda.device(t.device):
            _allreduce_kernel[(programs,)](
                t, *recv, *pad, *state.flags, *fpad, recv[rank], state.flags[rank], state.epochs[rank],
                state.errors[rank], numel, rank, spin, N=n, BLOCK=BLOCK, MAXN=MAX_NUMEL, num_warps=4)


def norm_fits(t: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused all-reduce + RMSNorm kernel takes `t` ([rows, hidden], the norm's dtype)."""
    return _norm_fits(t, weight, MAX_NUMEL)


def peer_all_reduce_norm(tensors: list[torch.Tensor], weights: list[torch.Tensor], eps: float, state: PeerState,
                         spin: int = SPIN) -> list[torch.Tensor]:
    """In-place sum over `tensors` ([..., hidden], one per device of a NORM_ROWS / NORM_MAXN `state`) and, per
    device, rms_norm(sum, weights[k], eps) as a new tensor: one kernel per GPU. Reference:
    `reference.host_all_reduce_norm` (the same contract)."""
    n = len(tensors)
    hidden, rows, block, warps = norm_launch(tensors)
    assert all(norm_fits(t, w) for t, w in zip(tensors, weights)), "fused all-reduce + norm: unsupported shape"
    recv = state.recv_as(tensors[0].dtype)
    pad = [recv[0]] * (MAX_SLOTS - n)
    fpad = [state.flags[0]] * (MAX_SLOTS - n)
    outs = [torch.empty_like(t) for t in tensors]
    for rank, (t, w, h) in enumerate(zip(tensors, weights, outs)):
        with torch.cuda.device(t.device):
            _allreduce_norm_kernel[(rows,)](
                t, h, w, *recv, *pad, *state.flags, *fpad, recv[rank], state.flags[rank], state.epochs[rank],
                state.errors[rank], hidden, rank, spin, eps, N=n, BLOCK_H=block, MAXN=state.maxn, num_warps=warps)
    return outs
