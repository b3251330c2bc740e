"""One-shot all-reduce over peer memory for decode-sized messages (single process, GPUs with P2P access).

A batch-1 decode step of a tensor-parallel model needs one all-reduce of a few KB per transformer block; the
GPU time of a general-purpose collective for such a message is dominated by its fixed protocol. Here each
slot's kernel reads every peer's partial straight over NVLink and sums, so a call is one kernel per GPU and
two flag exchanges. It is captured in CUDA graphs like any kernel.

Protocol, per program b (one tile of BLOCK elements; the grid is the same on every GPU):
  1. epoch e = epochs[b] + 1 (a per-program counter in local memory, advanced identically on every GPU
     because every GPU makes the same sequence of calls);
  2. start barrier: store e into every peer's start flag [b, rank] (release, system scope), then wait until
     our own start flags [b, j] from every peer j equal e (acquire): every partial's tile b is written;
  3. load tile b of every partial and sum in float32 (registers);
  4. end barrier, the same with the end flags: every peer has finished reading our tile b;
  5. store the sum into our own partial, epochs[b] = e.
Waits compare for equality, so counters may wrap. A wait gives up after `spin` polls (a peer that never
comes: the result is then wrong, but the GPU is not hung); `errors[0]` counts such give-ups.
One thread drives a state at a time: two threads interleaving their ranks' launches on the same streams can
make each GPU wait for a kernel queued behind its own (NCCL's single-process group calls share this rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SLOTS = 8
_SLOTS = tl.constexpr(MAX_SLOTS)  # the flag row stride, inside the kernels
MAX_PROGRAMS = 128
BLOCK = 8192  # elements per program: one program's tile stays in registers across the end barrier
MAX_NUMEL = MAX_PROGRAMS * BLOCK
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


@triton.jit
def _barrier(flags_mine, f0, f1, f2, f3, f4, f5, f6, f7, errors, phase_off, b, rank, e, spin,
             N: tl.constexpr):
    for j in tl.static_range(N):
        if j != rank:
            peer = _pick(j, f0, f1, f2, f3, f4, f5, f6, f7)
            tl.atomic_xchg(peer + phase_off + b * _SLOTS + rank, e, sem="release", scope="sys")
    for j in tl.static_range(N):
        if j != rank:
            ptr = flags_mine + phase_off + b * _SLOTS + j
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
            n = 0
            while (seen != e) & (n < spin):
                seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
                n += 1
            if seen != e:
                tl.atomic_add(errors, 1)


# Every GPU must run the *same* compiled kernel without a compile in between: a rank (or size) specialised
# by Triton would compile for rank 1 while rank 0's kernel already waits at the barrier.
@triton.jit(do_not_specialize=["numel", "rank", "spin"])
def _allreduce_kernel(out, p0, p1, p2, p3, p4, p5, p6, p7, f0, f1, f2, f3, f4, f5, f6, f7, flags_mine,
                      epochs, errors, numel, rank, spin, N: tl.constexpr, BLOCK: tl.constexpr,
                      PROGRAMS: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(epochs + b) + 1
    _barrier(flags_mine, f0, f1, f2, f3, f4, f5, f6, f7, errors, 0, b, rank, e, spin, N)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(N):
        src = _pick(j, p0, p1, p2, p3, p4, p5, p6, p7)
        acc += tl.load(src + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.debug_barrier()  # every thread's loads are done before any thread tells the peers so
    _barrier(flags_mine, f0, f1, f2, f3, f4, f5, f6, f7, errors, PROGRAMS * _SLOTS, b, rank, e, spin, N)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)
    tl.store(epochs + b, e)


class PeerState:
    """Flags, per-program epochs and an error counter on every slot's device (zeroed together)."""

    def __init__(self, devices: list[torch.device]) -> None:
        if len(devices) > MAX_SLOTS:
            raise ValueError(f"peer all-reduce supports at most {MAX_SLOTS} devices, got {len(devices)}")
        self.devices = devices
        self.flags = [torch.zeros(2 * MAX_PROGRAMS * MAX_SLOTS, dtype=torch.int32, device=d) for d in devices]
        self.epochs = [torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=d) for d in devices]
        self.errors = [torch.zeros(1, dtype=torch.int32, device=d) for d in devices]

    def error_count(self) -> int:
        return sum(int(e.item()) for e in self.errors)


def fits(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.numel() <= MAX_NUMEL and t.dtype in (torch.float16, torch.bfloat16,
                                                                         torch.float32)


def peer_all_reduce(tensors: list[torch.Tensor], state: PeerState, spin: int = SPIN) -> None:
    """In-place sum over `tensors` (one per device of `state`, same shape, contiguous): one kernel per GPU,
    each launched on its device's current stream. Reference: `reference.peer_all_reduce`."""
    n = len(tensors)
    numel = tensors[0].numel()
    programs = triton.cdiv(numel, BLOCK)
    pad = [tensors[0]] * (MAX_SLOTS - n)
    fpad = [state.flags[0]] * (MAX_SLOTS - n)
    for rank, t in enumerate(tensors):
        with torch.cuda.device(t.device):
            _allreduce_kernel[(programs,)](
                t, *tensors, *pad, *state.flags, *fpad, state.flags[rank], state.epochs[rank], state.errors[rank],
                numel, rank, spin, N=n, BLOCK=BLOCK, PROGRAMS=MAX_PROGRAMS, num_warps=8)
