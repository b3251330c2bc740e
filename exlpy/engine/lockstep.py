"""Lock-step execution of one forward per GPU: how tensor parallelism runs the ordinary blocks.

Each GPU (a *lane*) runs the same module code as a single-GPU model, as a coroutine. A module suspends at a
collective (`await group.all_reduce(t)`); when every lane has reached it, the collective runs once over all
lanes' tensors and every lane resumes. One thread drives all lanes, so each GPU's kernels of one stretch
between collectives are issued back to back on its own current stream, exactly as a hand-written stage
loop would issue them: no thread hand-offs, no GIL contention, and a CUDA-graph capture that has one
capture stream per GPU open sees every GPU's work (collective kernels included) on that GPU's stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.errors import TensorParallelError


@contextlib.contextmanager
def current_streams(streams: dict[str, Any], join: bool = False) -> Iterator[None]:
    """Each device's current stream (keys: device strings) is the given stream for the block, after it waited for
    the work issued so far on the device's previous stream; restored afterwards (with `join`, the previous stream
    waits for the block's work too)."""
    prev = {}
    for key, s in streams.items():
        dev = torch.device(key)
        prev[key] = torch.cuda.current_stream(dev)
        s.wait_stream(prev[key])
        with torch.cuda.device(dev):
            torch.cuda.set_stream(s)
    try:
        yield
    finally:
        for key, p in prev.items():
            with torch.cuda.device(torch.device(key)):
                torch.cuda.set_stream(p)
                if join:
                    p.wait_stream(streams[key])


@dataclass
class _Op:
    kind: str  # "all_reduce" | "all_reduce_norm" | "gather_first" | "start" | "join"
    tensor: torch.Tensor
    offset: int = 0
    total: int = 0
    norm: tuple[torch.Tensor, float] | None = None  # all_reduce_norm: this GPU's norm weight, eps

    def __await__(self) -> Generator[_Op, Any, Any]:
        result = yield self
        return result


class LockstepGroup:
    """The collectives of one tensor-parallel model: what `RowParallel` / `ColumnParallel` / the
    vocab-parallel embedding await. `comm` is the backend (exlpy/parallel/tp_comm.py); `prefill`, when set,
    takes the all-reduces of prefill-sized messages outside capture (exlpy/parallel/tp_copy.py, two GPUs)."""

    def __init__(self, comm: Any, prefill: Any = None, overlap_chunks: int = 1) -> None:
        self.comm = comm
        self.prefill = prefill
        self.capturing = False  # set while a CUDA graph is captured: no cross-device copies then
        # Row chunks of a prefill-sized closing projection (RuntimeOptions.tp_overlap_chunks; RowParallel reads it)
        self.overlap_chunks = overlap_chunks
        self._side: dict[str, torch.cuda.Stream] = {}  # per device (its string): where started all-reduces run

    def all_reduce_start(self, t: torch.Tensor) -> _Op:
        """Begin summing `t` in place on each GPU's side stream, after the work issued so far on its current
        stream, and return at once: the current stream may go on with work that does not touch `t` (the next row
        chunk's GEMM). `all_reduce_join` makes the current streams wait for every sum begun so far."""
        return _Op("start", t)

    def all_reduce_join(self, t: torch.Tensor) -> _Op:
        return _Op("join", t)

    def overlaps(self, t: torch.Tensor) -> bool:
        """Whether projections may chunk and start their all-reduces: not while capturing (decode-sized messages
        never chunk anyway). On CPU lanes (tests) a started all-reduce runs at once. The same answer on every lane."""
        return not self.capturing and self.overlap_chunks > 1

    def all_reduce(self, t: torch.Tensor) -> _Op:
        return _Op("all_reduce", t)

    def all_reduce_norm(self, t: torch.Tensor, weight: torch.Tensor, eps: float) -> _Op:
        """Sum `t` in place and return rms_norm(sum, weight, eps): in one kernel where the backend fuses it."""
        return _Op("all_reduce_norm", t, norm=(weight, eps))

    def fuses_norm(self) -> bool:
        return bool(getattr(self.comm, "fuses_norm", False))

    def gather_first(self, part: torch.Tensor, offset: int, total: int) -> _Op:
        return _Op("gather_first", part, offset, total)

    def prefills(self, t: torch.Tensor) -> bool:
        """Whether an all-reduce of `t` (this GPU's part) goes to the prefill collective, whose last pass can also
        norm the sum (RowParallel.prefill_norm). The same answer on every lane: same size, same capture state."""
        return self.prefill is not None and not self.capturing and self.prefill.takes(t)

    def start(self, ops: list[_Op]) -> Any:
        """An all-reduce (with or without the next norm) that the prefill collective takes, begun and not waited
        for: its `Pending`, whose `finish` completes the sums on the current streams and returns what each lane
        receives; None where the ordinary backend runs it."""
        kinds = {op.kind for op in ops}
        tensors = [op.tensor for op in ops]
        if (self.prefill is None or self.capturing or len(kinds) != 1 or not kinds <= {"all_reduce", "all_reduce_norm"}
                or not self.prefill.applies(tensors)):
            return None
        norms = [op.norm for op in ops] if ops[0].kind == "all_reduce_norm" else None
        return self.prefill.start(tensors, norms)  # type: ignore[arg-type]

    def run(self, ops: list[_Op]) -> list[Any]:
        kinds = {op.kind for op in ops}
        if len(kinds) != 1:
            raise TensorParallelError(f"tensor-parallel lanes reached different collectives: {sorted(kinds)}")
        if ops[0].kind in ("start", "join"):
            return self._side_streams(ops)
        pending = self.start(ops)
        if pending is not None:
            return pending.finish()
        if ops[0].kind == "all_reduce":
            self.comm.all_reduce([op.tensor for op in ops])
            return [None] * len(ops)
        if ops[0].kind == "all_reduce_norm":
            return self._all_reduce_norm(ops)
        return self._gather_first(ops)

    def _side_streams(self, ops: list[_Op]) -> list[None]:
        devices = [op.tensor.device for op in ops]
        if any(d.type != "cuda" for d in devices):  # CPU lanes (tests): nothing runs beside anything
            if ops[0].kind == "start":
                self.comm.all_reduce([op.tensor for op in ops])
            return [None] * len(ops)
        if len({str(d) for d in devices}) != len(devices):
            raise TensorParallelError(f"overlapped all-reduce needs one distinct CUDA device per lane, got {devices}")
        # Keyed by the device: a stream lives on one GPU, and each lane's work must stay on its own GPU's streams.
        side = {str(d): self._side.get(str(d)) or self._side.setdefault(str(d), torch.cuda.Stream(d)) for d in devices}
        if ops[0].kind == "join":
            for d in devices:
                torch.cuda.current_stream(d).wait_stream(side[str(d)])
        else:
            with current_streams(side):  # each side stream first waits for its device's work so far (the chunk)
                self.comm.all_reduce([op.tensor for op in ops])
        return [None] * len(ops)

    def _all_reduce_norm(self, ops: list[_Op]) -> list[torch.Tensor]:
        from exlpy.kernels import ops as kernels

        tensors = [op.tensor for op in ops]
        norms = [op.norm for op in ops]
        assert all(n is not None for n in norms)
        eps = norms[0][1]  # type: ignore[index]
        fused = getattr(self.comm, "all_reduce_norm", None)
        if fused is not None:
            return fused(tensors, [n[0] for n in norms], eps)  # type: ignore[index]
        self.comm.all_reduce(tensors)
        out = []
        for t, n in zip(tensors, norms):
            with _device(t.device):
                out.append(kernels.rms_norm(t, n[0], eps))  # type: ignore[index]
        return out

    def _gather_first(self, ops: list[_Op]) -> list[Any]:
        first = ops[0].tensor
        total = ops[0].total
        if self.capturing:
            # Inside a graph each GPU only touches its own memory: a zero-padded all-reduce instead of copies.
            full = []
            for op in ops:
                with _device(op.tensor.device):
                    f = torch.zeros(*op.tensor.shape[:-1], total, dtype=op.tensor.dtype, device=op.tensor.device)
                    f[..., op.offset:op.offset + op.tensor.shape[-1]] = op.tensor
                    full.append(f)
            self.comm.all_reduce(full)
            return [full[0]] + [None] * (len(ops) - 1)
        out = torch.empty(*first.shape[:-1], total, dtype=first.dtype, device=first.device)
        for op in ops:  # slot order is vocabulary order; the copies are ordered on the first device's stream
            if op.tensor.shape[-1]:
                out[..., op.offset:op.offset + op.tensor.shape[-1]].copy_(op.tensor)
        return [out] + [None] * (len(ops) - 1)


def _device(dev: torch.device) -> contextlib.AbstractContextManager[Any]:
    # Kernels (Triton's above all) launch on the *current* device and its current stream: make it the lane's.
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def run_lanes(lanes: Sequence[tuple[torch.device, Coroutine[Any, Any, Any]]], group: LockstepGroup | None
              ) -> list[Any]:
    """Drive every lane's coroutine to its end, running each collective when all lanes have reached it."""
    coros = [c for _, c in lanes]
    devices = [d for d, _ in lanes]
    inbox: list[Any] = [None] * len(lanes)
    try:
        while True:
            ops: list[_Op] = []
            done: list[Any] = []
            for i, coro in enumerate(coros):
                with _device(devices[i]):
                    try:
                        ops.append(coro.send(inbox[i]))
                    except StopIteration as stop:
                        done.append(stop.value)
            if done:
                if len(done) != len(coros):
                    raise TensorParallelError("tensor-parallel lanes diverged: some finished while others wait "
                                              "at a collective")
                return done
            if group is None:
                raise TensorParallelError(f"a forward reached a collective ({ops[0].kind}) outside tensor "
                                          "parallelism")
            inbox = group.run(ops)
    finally:
        for c in coros:
            c.close()  # a failed lane must not leave the others suspended (no-op for finished ones)
