"""Two-GPU all-reduce of prefill-sized messages by peer copies: the copy engines move the data, not the SMs.

Under tensor parallelism on two GPUs, each closing projection leaves a partial sum per GPU (the first GPU's
already holds the residual, added in its GEMM). For a long prefill chunk the message is large (2,048 tokens x
8,192 hidden in fp16: 32 MB) and NCCL's all-reduce takes ~145 us of SM time on each GPU, kernels that also
compete for SMs with whatever runs beside them (the other micro-batch's GEMMs in exlpy/engine/pipeline.py)
and wait for the peer's kernel to be scheduled. Here instead:

1. `start`: each GPU's partial is copied into a buffer on the other GPU by a cross-device `copy_`
   (cudaMemcpyAsync between peers: a DMA by the copy engines over NVLink, no kernel), both directions at once,
   each on a *send* stream of its source GPU while the destination's *receive* stream stands in for its compute
   stream in torch's cross-device barrier (so neither compute stream waits for a copy);
2. `Pending.finish`: each GPU's compute stream waits for its incoming copy and its outgoing one (the partial
   is about to be overwritten), then adds the received partial into its own, in place: one elementwise pass.
   Both GPUs then hold the same sum bit for bit (fp16 addition is commutative: y0 + y1 == y1 + y0). Where the
   closing projection knows the next block's RMSNorm (RowParallel.prefill_norm, linked at load), that pass
   also norms the sum (`ops.add_rms_norm`) and the next block takes its input from it (`batch.prenormed`): the
   add costs no kernel of its own, and the sum is not read back for the norm.

Between `start` and `finish` the GPUs are free to compute something else (the pipeline's other micro-batch);
called back to back (`all_reduce`) it is a plain all-reduce. Selected by `EXLPY_TP_PREFILL_COMM=copy` for
messages of at least `MIN_BYTES` outside CUDA-graph capture (exlpy/engine/lockstep.py); decode keeps its
backend (exlpy/parallel/tp_comm.py). CPU "devices" (tests) take the same steps with synchronous copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from exlpy.errors import TensorParallelError
from exlpy.parallel.p2p import peer_copy_ok

# Messages below this many bytes keep the decode backend: a copy has a fixed cost of a few microseconds plus
# two events per direction, which the one-shot peer kernel / NCCL beat at decode and short-chunk sizes. 2 MiB
# is 128 tokens of an 8,192-wide fp16 model; captured prompt chunks never take this path (no copies in graphs).
MIN_BYTES = 2 << 20


@dataclass
class Pending:
    """The copies of one all-reduce in flight: `finish` completes it on the devices' current streams."""

    tensors: list[torch.Tensor]
    received: list[torch.Tensor]
    events: list[list[torch.cuda.Event]] = field(default_factory=list)  # per device: what its add waits for
    norms: list[tuple[torch.Tensor, float]] | None = None  # per device: the next block's RMSNorm of the sum
    done: bool = False

    def finish(self) -> list[torch.Tensor | None]:
        """Each device's current stream waits for its copies, then adds the peer's partial into its own; with
        `norms`, in the same pass, the sum's RMSNorm (returned per device; None each without)."""
        from exlpy.kernels import ops

        if self.done:
            raise TensorParallelError("a copy all-reduce was finished twice")
        self.done = True
        out: list[torch.Tensor | None] = []
        events = self.events or [[] for _ in self.tensors]
        norms = self.norms or [None] * len(self.tensors)
        for t, r, evs, norm in zip(self.tensors, self.received, events, norms):
            with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
                if t.is_cuda:
                    stream = torch.cuda.current_stream(t.device)
                    for ev in evs:
                        stream.wait_event(ev)
                if norm is None:
                    t.add_(r)
                    out.append(None)
                else:
                    out.append(ops.add_rms_norm(t, r, norm[0], norm[1]))
        return out


class CopyAllReduce:
    """In-place sum of two devices' tensors by a peer copy each way and one add on each device."""

    name = "copy"

    def __init__(self, devices: Sequence[torch.device]) -> None:
        if len(devices) != 2:
            raise TensorParallelError(f"EXLPY_TP_PREFILL_COMM=copy sums over exactly two GPUs; this model is split "
                                      f"over {len(devices)} devices ({', '.join(str(d) for d in devices)})")
        self.devices = [torch.device(d) for d in devices]
        cuda = [d.type == "cuda" for d in self.devices]
        if any(cuda) and not all(cuda):
            raise TensorParallelError(f"EXLPY_TP_PREFILL_COMM=copy needs two CUDA devices or CPU test devices, got "
                                      f"{self.devices}")
        self.cuda = all(cuda)
        if self.cuda:
            a, b = self.devices
            if a == b:
                raise TensorParallelError(f"EXLPY_TP_PREFILL_COMM=copy needs two distinct GPUs, got {a} twice")
            if not (torch.cuda.can_device_access_peer(a, b) and torch.cuda.can_device_access_peer(b, a)):
                raise TensorParallelError(f"EXLPY_TP_PREFILL_COMM=copy needs peer access between {a} and {b} "
                                          "(NVLink or PCIe P2P); without it the copies would pass through the host")
            if not peer_copy_ok(a, b):  # P2P advertised but corrupting copies (spec §6.7, parallel/p2p.py)
                raise TensorParallelError(f"EXLPY_TP_PREFILL_COMM=copy: direct copies between {a} and {b} failed "
                                          "the round-trip check; use the default prefill collective")
            self.send = [torch.cuda.Stream(d) for d in self.devices]  # outgoing copy, on its source device
            self.recv = [torch.cuda.Stream(d) for d in self.devices]  # the destination's side of the barrier

    def takes(self, t: torch.Tensor) -> bool:
        """Whether an all-reduce of `t` (one device's part) goes this way: as large as `MIN_BYTES`."""
        return t.numel() * t.element_size() >= MIN_BYTES

    def applies(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether these parts go this way: two of them, large enough, on this pair's devices."""
        return (len(tensors) == 2 and self.takes(tensors[0])
                and all(t.device == d for t, d in zip(tensors, self.devices)))

    def start(self, tensors: Sequence[torch.Tensor], norms: list[tuple[torch.Tensor, float]] | None = None
              ) -> Pending:
        """Issue the two copies (each partial into a new buffer on the other device); the caller's current
        streams go on without waiting. `finish` on the returned object completes the sum (and with `norms`, per
        device an RMSNorm weight and eps, returns the sum's norm for the next block)."""
        t0, t1 = tensors
        if t0.shape != t1.shape or t0.dtype != t1.dtype:
            raise TensorParallelError(f"tensor-parallel all-reduce of unlike partials: {tuple(t0.shape)} "
                                      f"{t0.dtype} and {tuple(t1.shape)} {t1.dtype}")
        pending = Pending([t0, t1], [t1.clone(), t0.clone()]) if not self.cuda else self._start_cuda([t0, t1])
        pending.norms = norms
        return pending

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        self.start(tensors).finish()

    def _start_cuda(self, tensors: list[torch.Tensor]) -> Pending:
        compute = [torch.cuda.current_stream(d) for d in self.devices]
        received = []
        for i, d in enumerate(self.devices):
            with torch.cuda.device(d):
                # Allocated on the compute stream that will read it; the copy into it is ordered after that
                # stream's work so far (the receive stream waits for it below, the send stream for that).
                received.append(torch.empty_like(tensors[1 - i], device=d))
                self.send[i].wait_stream(compute[i])  # the partial is complete
                self.recv[i].wait_stream(compute[i])  # the buffer's earlier users are done
        events: list[list[torch.cuda.Event]] = [[], []]
        for src in (0, 1):
            dst = 1 - src
            prev = [torch.cuda.current_stream(d) for d in self.devices]
            try:
                # torch's cross-device copy runs on the source's current stream after a two-way barrier with the
                # destination's current stream: make those the send / receive streams, not the compute streams.
                _set_stream(self.devices[src], self.send[src])
                _set_stream(self.devices[dst], self.recv[dst])
                received[dst].copy_(tensors[src], non_blocking=True)
            finally:
                for d, p in zip(self.devices, prev):
                    _set_stream(d, p)
            # The compute streams reuse these tensors' memory only after the copies (if `finish` never runs).
            tensors[src].record_stream(self.send[src])
            received[dst].record_stream(self.recv[dst])
            sent, arrived = torch.cuda.Event(), torch.cuda.Event()
            with torch.cuda.device(self.devices[src]):
                sent.record(self.send[src])
            with torch.cuda.device(self.devices[dst]):
                arrived.record(self.recv[dst])
            events[src].append(sent)  # its partial is overwritten by the add: the copy must have read it
            events[dst].append(arrived)
        return Pending(tensors, received, events)


def _set_stream(device: torch.device, stream: torch.cuda.Stream) -> None:
    with torch.cuda.device(device):
        torch.cuda.set_stream(stream)


def make_prefill_comm(devices: Sequence[torch.device], name: str) -> CopyAllReduce | None:
    """The collective for prefill-sized messages (RuntimeOptions.tp_prefill_comm): None for `default` (the
    decode backend handles every size), a CopyAllReduce for `copy`."""
    if name == "default":
        return None
    if name == "copy":
        return CopyAllReduce(devices)
    raise TensorParallelError(f"unknown TP prefill collective '{name}' (EXLPY_TP_PREFILL_COMM): use default or copy")
