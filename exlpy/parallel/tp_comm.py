"""Collective backends for tensor parallelism inside one process.

The TP forward needs one collective: an in-place sum over the slots' tensors (all-reduce); all-gathers are
all-reduces of zero-padded buffers (uneven splits need no special case, and decode-sized messages are
latency-bound anyway). Backends:

- `local`: sums through ordinary tensor copies. Serves CPU "devices" (tests) and, on GPUs, is the
  peer-to-peer path: cross-device `copy_` is ordered against both devices' current streams by PyTorch.
- `host`: stages partials through one pinned host buffer (the spec's design; works without P2P).
- `nccl`: `torch.cuda.nccl.all_reduce`, NCCL's single-process multi-GPU group call on the current streams.
- `peer`: a one-shot Triton all-reduce that reads the peers' partials over P2P (kernels/peer_allreduce.py),
  for decode-sized messages; larger ones go to NCCL (or `local`).
- `hostmem`: a one-shot Triton all-reduce through one pinned host buffer (kernels/host_allreduce.py), for
  GPUs without P2P, where NCCL takes its shared-memory transport; messages above the size where it was timed
  faster than NCCL go to NCCL.

Select with `EXLPY_TP_COMM=local|host|nccl|peer|hostmem` (read once into exlpy.runtime.RuntimeOptions). By
default, when every slot is a distinct CUDA device, the candidates that work (the peer kernel passing its
probe, NCCL answering; the host-memory kernel only when named, until it has run on a GPU pair) are *timed at
load* as a decode step uses them, a run of one-row
all-reduces captured in one CUDA graph per GPU, and the fastest is chosen (`comm.timings` keeps the figures):
which one wins depends on the machine (NVLink generation or none, driver, NCCL version), and a host-timed eager
call measures the launch, not what a captured step pays. The host-memory kernel is also timed against NCCL at
8 and 32 rows, and keeps only the sizes where it wins. Otherwise local. benchmarks/results/tp.md and
multigpu.md record how they compare.
"""

from __future__ import annotations

from typing import Any

import torch

from exlpy.capture import gc_paused
from exlpy.errors import TensorParallelError


class LocalComm:
    """Reduce onto the first slot's device, then copy the sum back to every slot."""

    name = "local"
    timings: dict[str, float] | None = None  # seconds per captured one-row all-reduce, when chosen by timing

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
    timings: dict[str, float] | None = None

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
    timings: dict[str, float] | None = None

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) == 1:
            return
        import torch.cuda.nccl as nccl

        nccl.all_reduce(tensors)


class PeerComm:
    """Decode-sized sums by the peer-memory kernel, larger ones by `fallback`."""

    name = "peer"
    timings: dict[str, float] | None = None

    def __init__(self, devices: list[torch.device], fallback: NcclComm | LocalComm) -> None:
        from exlpy.kernels.peer_allreduce import NORM_MAXN, NORM_ROWS, PeerState

        self.state = PeerState(devices)
        self.norm_state = PeerState(devices, NORM_ROWS, NORM_MAXN)  # the fused all-reduce + norm's own
        self.fallback = fallback
        self.fuses_norm = True  # see HostMemComm; the probe turns it off if the fused kernel failed it

    def all_reduce_norm(self, tensors: list[torch.Tensor], weights: list[torch.Tensor], eps: float
                        ) -> list[torch.Tensor]:
        """In-place sum, and every device's RMSNorm of it (one kernel per GPU where the shape fits)."""
        from exlpy.kernels.peer_allreduce import norm_fits, peer_all_reduce_norm

        if self.fuses_norm and all(norm_fits(t, w) for t, w in zip(tensors, weights)):
            return peer_all_reduce_norm(tensors, weights, eps, self.norm_state)
        self.all_reduce(tensors)
        return [_normed(t, w, eps) for t, w in zip(tensors, weights)]

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        from exlpy.kernels.peer_allreduce import fits, peer_all_reduce

        if len(tensors) == 1:
            return
        if all(fits(t) for t in tensors):
            peer_all_reduce(tensors, self.state)
        else:
            self.fallback.all_reduce(tensors)


class HostMemComm:
    """Sums of up to `max_numel` elements by the host-memory kernel, larger ones by `fallback`."""

    name = "hostmem"
    timings: dict[str, float] | None = None

    def __init__(self, devices: list[torch.device], fallback: NcclComm | LocalComm) -> None:
        from exlpy.kernels.host_allreduce import MAX_NUMEL, NORM_MAXN, NORM_ROWS, HostState

        self.state = HostState(devices)
        self.norm_state = HostState(devices, NORM_ROWS, NORM_MAXN)  # the fused all-reduce + norm's own
        self.fallback = fallback
        self.max_numel = MAX_NUMEL  # lowered at load where NCCL was timed faster for larger messages
        # Closing projections hand the next block's norm to the collective (model/parallel_linear.py) when the
        # backend fuses it. Not this one for now: its fused kernel failed tests/test_host_allreduce.py's two-stream
        # test on an H100 (Triton 3.6, 2026-11-26), while the plain all-reduce passed.
        self.fuses_norm = False

    def all_reduce_norm(self, tensors: list[torch.Tensor], weights: list[torch.Tensor], eps: float
                        ) -> list[torch.Tensor]:
        """In-place sum, and every device's RMSNorm of it (one kernel per GPU where the shape fits)."""
        from exlpy.kernels import ops
        from exlpy.kernels.host_allreduce import norm_fits

        if (self.fuses_norm and tensors[0].numel() <= self.max_numel
                and all(norm_fits(t, w) for t, w in zip(tensors, weights))):
            return ops.host_all_reduce_norm(tensors, weights, eps, self.norm_state)
        self.all_reduce(tensors)
        return [_normed(t, w, eps) for t, w in zip(tensors, weights)]

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        from exlpy.kernels import ops
        from exlpy.kernels.host_allreduce import fits

        if len(tensors) == 1:
            return
        if tensors[0].numel() <= self.max_numel and all(fits(t) for t in tensors):
            ops.host_all_reduce(tensors, self.state)
        else:
            self.fallback.all_reduce(tensors)


def _normed(t: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    from exlpy.kernels import ops

    with torch.cuda.device(t.device) if t.is_cuda else _nullcontext():
        return ops.rms_norm(t, w, eps)


def _nullcontext():  # noqa: ANN202 - a context manager
    import contextlib

    return contextlib.nullcontext()


def host_mem_comm(devices: list[torch.device], fallback: NcclComm | LocalComm) -> HostMemComm | None:
    """A HostMemComm over distinct CUDA `devices` if a probe sums correctly (two calls, every size class of
    the kernel: masked and whole tiles), else None. Never without the Triton kernels (EXLPY_NO_TRITON): the
    reference's cross-device copies could not be captured in the decode graphs."""
    from exlpy.kernels import ops

    if len({str(d) for d in devices}) != len(devices) or any(d.type != "cuda" for d in devices):
        return None
    if not ops.has_cuda_kernels():
        return None
    try:
        from exlpy.kernels.host_allreduce import MAX_SLOTS, host_all_reduce, host_all_reduce_norm

        if len(devices) > MAX_SLOTS:
            return None
        comm = HostMemComm(devices, fallback)
        want = float(sum(range(1, len(devices) + 1)) * len(devices))  # the second call sums the first's sums
        for shape in ((3, 1000), (2, 4096)):
            probe = [torch.full(shape, float(i + 1), device=d) for i, d in enumerate(devices)]
            for _ in range(2):
                host_all_reduce(probe, comm.state, spin=1 << 20)
            for d in devices:
                torch.cuda.synchronize(d)
            if comm.state.error_count() or not all(bool((p == want).all()) for p in probe):
                return None
        comm.fuses_norm = _norm_probe(
            lambda xs, ws, spin: host_all_reduce_norm(xs, ws, 1e-5, comm.norm_state, spin=spin),
            comm.norm_state.error_count, devices)
        return comm
    except Exception:  # noqa: BLE001 - any failure means "use another backend"
        return None


def _norm_probe(run: Any, errors: Any, devices: list[torch.device]) -> bool:
    """Whether a fused all-reduce + RMSNorm kernel (`run(tensors, weights, spin)` -> normed tensors; `errors()`
    its state's give-ups) gives the reference's sums and norms (two calls)."""
    from exlpy.kernels import reference

    try:
        g = torch.Generator().manual_seed(0)
        w = torch.rand(1000, generator=g).half() + 0.5
        for _ in range(2):
            xs = [torch.randn(3, 1000, generator=g).half().to(d) for d in devices]
            want = [x.cpu() for x in xs]
            want_h = reference.host_all_reduce_norm(want, [w] * len(want), 1e-5)
            hs = run(xs, [w.to(d) for d in devices], 1 << 20)
            for d in devices:
                torch.cuda.synchronize(d)
            if errors() or not all(
                    torch.equal(x.cpu(), want[0]) and (h.cpu().float() - want_h[0].float()).abs().max() <= 1e-2
                    for x, h in zip(xs, hs)):
                return False
        return True
    except Exception:  # noqa: BLE001 - any failure means "do not fuse"
        return False


def peer_comm(devices: list[torch.device], fallback: NcclComm | LocalComm) -> PeerComm | None:
    """A PeerComm over `devices` if every pair has P2P access and a probe sums correctly, else None."""
    if len({str(d) for d in devices}) != len(devices) or any(d.type != "cuda" for d in devices):
        return None
    try:
        from exlpy.kernels.peer_allreduce import MAX_SLOTS, peer_all_reduce

        if len(devices) > MAX_SLOTS or not all(torch.cuda.can_device_access_peer(a, b)
                                               for a in devices for b in devices if a != b):
            return None
        for a in devices:  # a cross-device copy makes torch enable peer access between the two devices
            for b in devices:
                if a != b:
                    torch.ones(1, device=a).to(b)
        comm = PeerComm(devices, fallback)
        probe = [torch.full((3, 1000), float(i + 1), device=d) for i, d in enumerate(devices)]
        for _ in range(2):
            peer_all_reduce(probe, comm.state)
        for d in devices:
            torch.cuda.synchronize(d)
        want = float(sum(range(1, len(devices) + 1)) * len(devices))  # the second call sums the first's sums
        ok = comm.state.error_count() == 0 and all(bool((p == want).all()) for p in probe)
        if not ok:
            return None
        from exlpy.kernels.peer_allreduce import peer_all_reduce_norm

        comm.fuses_norm = _norm_probe(
            lambda xs, ws, spin: peer_all_reduce_norm(xs, ws, 1e-5, comm.norm_state, spin=spin),
            comm.norm_state.error_count, devices)
        return comm
    except Exception:  # noqa: BLE001 - any failure means "use another backend"
        return None


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


Comm = LocalComm | HostComm | NcclComm | PeerComm | HostMemComm


def make_comm(devices: list[torch.device], name: str | None = None, numel: int = 8192) -> Comm:
    """The backend `name` (RuntimeOptions.tp_comm; None: the fastest that works, timed on a one-row all-reduce
    of `numel` elements, the model's hidden size) for these slot devices."""
    all_cuda = all(d.type == "cuda" for d in devices)
    if name == "local":
        return LocalComm()
    if name == "host":
        return HostComm()
    if name == "nccl":
        if not nccl_usable(devices):
            raise TensorParallelError(f"EXLPY_TP_COMM=nccl but NCCL cannot all-reduce over {devices}")
        return NcclComm()
    if name == "peer":
        peer = peer_comm(devices, NcclComm() if nccl_usable(devices) else LocalComm())
        if peer is None:
            raise TensorParallelError(f"EXLPY_TP_COMM=peer but the peer all-reduce does not work over {devices} "
                                      "(needs P2P access between every pair of GPUs)")
        return peer
    if name == "hostmem":
        hm = host_mem_comm(devices, NcclComm() if nccl_usable(devices) else LocalComm())
        if hm is None:
            raise TensorParallelError(f"EXLPY_TP_COMM=hostmem but the host-memory all-reduce does not work over "
                                      f"{devices} (needs distinct CUDA devices that can read pinned host memory)")
        return hm
    if name is not None:
        raise TensorParallelError(f"unknown TP collective backend '{name}' (EXLPY_TP_COMM): use local, host, "
                                  "nccl, peer or hostmem")
    if not (all_cuda and len(devices) > 1):
        return LocalComm()
    fallback: NcclComm | LocalComm = NcclComm() if nccl_usable(devices) else LocalComm()
    # The host-memory kernel is opt-in (EXLPY_TP_COMM=hostmem) until it has run on two real GPUs: written and
    # tested on CPU (interpreter) and one GPU (two streams) on 2026-11-26, not yet timed or checked on a GPU pair.
    candidates: list[NcclComm | PeerComm | HostMemComm] = [c for c in (peer_comm(devices, fallback),)
                                                           if c is not None]
    if not isinstance(fallback, NcclComm):
        return candidates[0] if candidates else fallback
    if not candidates:
        return fallback
    candidates.append(fallback)
    timings = {c.name: time_all_reduce(c, devices, numel) for c in candidates}
    best = min(candidates, key=lambda c: timings[c.name])
    if isinstance(best, HostMemComm):
        best.max_numel = hostmem_limit(best, fallback, devices, numel, timings)
    best.timings = timings
    return best


def hostmem_limit(comm: HostMemComm, nccl: NcclComm, devices: list[torch.device], numel: int,
                  timings: dict[str, float]) -> int:
    """The largest message (in elements) up to which the host-memory kernel was timed faster than NCCL, of
    1, 8 and 32 rows of `numel` (its one PCIe link carries the whole message twice; NCCL's transport may
    overtake it on batched decode); the figures go into `timings`."""
    from exlpy.kernels.host_allreduce import MAX_NUMEL

    limit = numel
    for rows in (8, 32):
        n = rows * numel
        if n > MAX_NUMEL:
            break
        t_host = time_all_reduce(comm, devices, n)
        t_nccl = time_all_reduce(nccl, devices, n)
        timings[f"hostmem_{rows}rows"], timings[f"nccl_{rows}rows"] = t_host, t_nccl
        if t_host > t_nccl:
            break
        limit = n
    return limit


def time_all_reduce(comm: NcclComm | PeerComm | HostMemComm, devices: list[torch.device], numel: int, reps: int = 16,
                    replays: int = 8) -> float:
    """Seconds per in-place all-reduce of `numel` fp16 elements when `reps` of them are captured in one graph
    per GPU and replayed (a decode step's collectives); inf if the backend cannot be captured."""
    import time

    xs = [torch.zeros(numel, dtype=torch.float16, device=d) for d in devices]
    try:
        for _ in range(2):  # compiles the peer kernel, sets up NCCL's communicator outside the capture
            comm.all_reduce(xs)
        for d in devices:
            torch.cuda.synchronize(d)
        graphs = [torch.cuda.CUDAGraph() for _ in devices]
        streams = [torch.cuda.Stream(d) for d in devices]
        prev = [torch.cuda.current_stream(d) for d in devices]
        begun = []
        with gc_paused():  # no earlier graph is destroyed mid-capture (exlpy/capture.py)
            try:
                for g, d, st in zip(graphs, devices, streams):
                    with torch.cuda.device(d):
                        torch.cuda.set_stream(st)
                        # "relaxed": a second capture may begin while the first is open (engine/graphs.py)
                        g.capture_begin(capture_error_mode="relaxed")
                        begun.append((g, d))
                for _ in range(reps):
                    comm.all_reduce(xs)
            finally:
                for g, d in begun:
                    with torch.cuda.device(d):
                        g.capture_end()
                for d, p in zip(devices, prev):
                    with torch.cuda.device(d):
                        torch.cuda.set_stream(p)

        def replay(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                for g, d in zip(graphs, devices):
                    with torch.cuda.device(d):
                        g.replay()
            for d in devices:
                torch.cuda.synchronize(d)
            return time.perf_counter() - t0

        replay(2)
        return replay(replays) / (replays * reps)
    except Exception:  # noqa: BLE001 - a backend that cannot be captured loses
        return float("inf")
