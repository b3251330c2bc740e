"""Collective backends for tensor parallelism inside one process.

The TP forward needs one collective: an in-place sum over the slots' tensors (all-reduce); all-gathers are
all-reduces of zero-padded buffers (uneven splits need no special case, and decode-sized messages are
latency-bound anyway). Backends:

- `local`: sums through ordinary tensor copies. Serves CPU "devices" (tests) and, on GPUs, is the
  peer-to-peer path: cross-device `copy_` is ordered against both devices' current streams by PyTorch.
- `host`: stages partials through one pinned host buffer (the spec's design; works without P2P).
- `nccl`: `torch.cuda.nccl.all_reduce`, NCCL's single-process multi-GPU group call on the current streams.

Select with `EXLPY_TP_COMM=local|host|nccl`; the default is nccl when every slot is a distinct CUDA device and
NCCL answers, else local. benchmarks/results/tp.md records how they compare.
"""

from __future__ import annotations

import os

import torch

from exlpy.errors import TensorParallelError


class LocalComm:
    """Reduce onto the first slot's device, then copy the sum back to every slot."""

    name = "local"

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) == 1:
            return
        acc = tensors[0]
        for t in tensors[1:]:
            acc.add_(t if t.device == acc.device else t.to(acc.device, non_blocking=True))
        for t in tensors[1:]:
            t.copy_(acc, non_blocking=True)


class HostComm:
    """Partials go to one pinned host buffer, every device reads all of them back and sums locally."""

    name = "host"

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def _pinned(self, n: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._buf is None or self._buf.dtype != dtype or self._buf.numel() < n * numel:
            self._buf = torch.empty(n * numel, dtype=dtype, pin_memory=torch.cuda.is_available())
        return self._buf[:n * numel].view(n, numel)

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) == 1:
            return
        buf = self._pinned(len(tensors), tensors[0].numel(), tensors[0].dtype)
        for i, t in enumerate(tensors):
            buf[i].copy_(t.reshape(-1), non_blocking=True)
        for t in tensors:
            if t.is_cuda:
                torch.cuda.current_stream(t.device).synchronize()  # the host buffer is complete only now
        for t in tensors:
            t.copy_(buf.to(t.device, non_blocking=True).sum(0).view_as(t))
        for t in tensors:
            if t.is_cuda:
                # The pinned buffer is reused by the next call: its reads must be done before it is rewritten.
                torch.cuda.current_stream(t.device).synchronize()


class NcclComm:
    """NCCL all-reduce over distinct CUDA devices, from one process (torch.cuda.nccl)."""

    name = "nccl"

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) == 1:
            return
        import torch.cuda.nccl as nccl

        nccl.all_reduce(tensors)


def nccl_usable(devices: list[torch.device]) -> bool:
    if len({str(d) for d in devices}) != len(devices) or any(d.type != "cuda" for d in devices):
        return False
    try:
        import torch.cuda.nccl as nccl

        probe = [torch.ones(8, device=d) for d in devices]
        if not nccl.is_available(probe):
            return False
        nccl.all_reduce(probe)
        for d in devices:
            torch.cuda.synchronize(d)
        return bool(all(float(p[0]) == len(devices) for p in probe))
    except Exception:  # noqa: BLE001 - any failure means "use another backend"
        return False


def make_comm(devices: list[torch.device], name: str | None = None) -> LocalComm | HostComm | NcclComm:
    """The backend `name` (or EXLPY_TP_COMM, or the fastest that works) for these slot devices."""
    name = name or os.environ.get("EXLPY_TP_COMM") or None
    all_cuda = all(d.type == "cuda" for d in devices)
    if name == "local":
        return LocalComm()
    if name == "host":
        return HostComm()
    if name == "nccl":
        if not nccl_usable(devices):
            raise TensorParallelError(f"EXLPY_TP_COMM=nccl but NCCL cannot all-reduce over {devices}")
        return NcclComm()
    if name is not None:
        raise TensorParallelError(f"unknown TP collective backend '{name}' (EXLPY_TP_COMM): use local, host "
                                  "or nccl")
    if all_cuda and len(devices) > 1 and nccl_usable(devices):
        return NcclComm()
    return LocalComm()
