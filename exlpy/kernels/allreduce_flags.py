"""What the two one-shot all-reduces share (peer_allreduce.py: over P2P; host_allreduce.py: through pinned host
memory): the flag exchange's device helpers, the fused RMSNorm epilogue, the per-program epochs and error
counters every GPU keeps, and the size limits of a call. The protocol itself is described in those two modules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SLOTS = 8  # ranks a state supports; the flag row of a program has this many int32 slots
SLOTS = tl.constexpr(MAX_SLOTS)  # the flag row stride, inside the kernels
NORM_ROWS = 64  # rows of a fused all-reduce + norm call (batched decode); more go unfused
NORM_HIDDEN = 16384
NORM_MAXN = NORM_ROWS * NORM_HIDDEN
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def load_acquire(ptr, ASM: tl.constexpr):
    """A system-scope acquire load of a flag: inline PTX (ASM), or an atomic add of 0 (peer memory, where
    atomics are exact; the interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.acquire.sys.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)
    else:
        return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def store_release(ptr, value, ASM: tl.constexpr):
    """A system-scope release store of a flag: inline PTX (ASM), or an atomic exchange."""
    if ASM:
        tl.inline_asm_elementwise("st.release.sys.global.u32 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [ptr, value], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def wait_flags(flags, b, rank, e, spin, errors, N: tl.constexpr, AHEAD: tl.constexpr, ASM: tl.constexpr):
    """Poll program b's flag [b, j] of every other rank j until it is e (or, AHEAD, e + 1: j already finished
    this call and raised its next flag); after `spin` polls give up and count it in errors[0]."""
    for j in tl.static_range(N):
        if j != rank:
            ptr = flags + b * SLOTS + j
            seen = load_acquire(ptr, ASM)
            n = 0
            if AHEAD:
                while (seen != e) & (seen != e + 1) & (n < spin):
                    seen = load_acquire(ptr, ASM)
                    n += 1
                if (seen != e) & (seen != e + 1):
                    tl.atomic_add(errors, 1)
            else:
                while (seen != e) & (n < spin):
                    seen = load_acquire(ptr, ASM)
                    n += 1
                if seen != e:
                    tl.atomic_add(errors, 1)


@triton.jit
def row_prologue(x, epochs, hidden, BLOCK_H: tl.constexpr):
    """The fused kernels' start: program b owns row b of x [rows, hidden]; its call count e = epochs[b] + 1 and
    parity; the row's columns, their mask, offsets, and our partial of the row."""
    b = tl.program_id(0)
    e = tl.load(epochs + b) + 1
    par = e % 2
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    offs = b * hidden + cols
    return b, e, par, cols, cmask, offs, tl.load(x + offs, mask=cmask, other=0.0)


@triton.jit
def sum_rows(mine, buf, par, offs, cmask, rank, N: tl.constexpr, MAXN: tl.constexpr, BLOCK_H: tl.constexpr,
             CACHE: tl.constexpr):
    """The fused kernels' sum of a row over the ranks in rank order (identical bits on every GPU), fp32: our own
    partial from registers, every other rank j's from buf [parity, j] (read with cache modifier CACHE)."""
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(N):
        if j == rank:
            acc += mine.to(tl.float32)
        else:
            acc += tl.load(buf + (par * N + j) * MAXN + offs, mask=cmask, other=0.0,
                           cache_modifier=CACHE).to(tl.float32)
    return acc


@triton.jit
def store_sum_norm(x, h, w, acc, offs, cols, cmask, hidden, eps):
    """The fused kernels' epilogue: the row's sum acc (fp32) into x in x's dtype, and rms_norm(sum) * w into h,
    rounded as kernels/rmsnorm.py rounds."""
    y = acc.to(x.dtype.element_ty)
    tl.store(x + offs, y, mask=cmask)
    yf = y.to(tl.float32)
    inv = tl.rsqrt(tl.sum(yf * yf, axis=0) / hidden + eps)
    wv = tl.load(w + cols, mask=cmask, other=0.0)
    tl.store(h + offs, ((yf * inv).to(wv.dtype) * wv).to(h.dtype.element_ty), mask=cmask)


class FlagState:
    """Per-program epochs and an error counter on every device of a state (a program's tile must be the same
    region in every call: the fused-norm kernels keep a state of their own, `programs` = NORM_ROWS, `maxn` =
    NORM_MAXN), and views of its buffers of [2 parities, N ranks, `maxn`] 4-byte elements as a call's dtype."""

    def __init__(self, devices: list[torch.device], programs: int, maxn: int, what: str) -> None:
        if len(devices) > MAX_SLOTS:
            raise ValueError(f"{what} supports at most {MAX_SLOTS} devices, got {len(devices)}")
        self.devices = devices
        self.maxn = maxn
        self.epochs = [torch.zeros(programs, dtype=torch.int32, device=d) for d in devices]
        self.errors = [torch.zeros(1, dtype=torch.int32, device=d) for d in devices]
        self._views: dict[torch.dtype, list[torch.Tensor]] = {}

    def _views_as(self, dtype: torch.dtype, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """`buffers` viewed as `dtype`, [2 * N * maxn] elements each (the rest unused), made once per dtype."""
        v = self._views.get(dtype)
        if v is None:
            size = 2 * len(self.devices) * self.maxn
            v = self._views[dtype] = [r.view(dtype)[:size] for r in buffers]
        return v

    def error_count(self) -> int:
        return sum(int(e.item()) for e in self.errors)


def fits(t: torch.Tensor, max_numel: int) -> bool:
    return t.is_contiguous() and t.numel() <= max_numel and t.dtype in _DTYPES


def norm_fits(t: torch.Tensor, weight: torch.Tensor, max_numel: int) -> bool:
    """Whether a fused all-reduce + RMSNorm kernel takes `t` ([rows, hidden], the norm's dtype)."""
    hidden = t.shape[-1]
    return (fits(t, max_numel) and t.dtype == weight.dtype and weight.dim() == 1 and weight.numel() == hidden
            and weight.is_contiguous() and hidden <= NORM_HIDDEN and t.numel() // hidden <= NORM_ROWS)


def norm_launch(tensors: list[torch.Tensor]) -> tuple[int, int, int, int]:
    """(hidden, rows, BLOCK_H, warps) of a fused all-reduce + norm call over `tensors` [..., hidden]."""
    hidden = tensors[0].shape[-1]
    block = triton.next_power_of_2(hidden)
    return hidden, tensors[0].numel() // hidden, block, 4 if block <= 2048 else 8 if block <= 8192 else 16
