"""Tensor-parallel prefill in two micro-batches whose all-reduces overlap the other's compute.

A long prefill chunk under tensor parallelism computes a block, then waits for its all-reduce (2 per layer, a
[tokens, hidden] message each: 32 MB for 2,048 tokens of a 70B-shaped model), during which the GPU is idle.
Cut the chunk into two halves A and B (A the earlier tokens) and run both through the same lanes, A's kernels
first: when A reaches a collective, it is issued on a separate *communication stream* per GPU and B's
kernels run meanwhile on the compute stream; when B reaches its collective, A resumes once its all-reduce is
done (the compute stream waits for an event, the host does not). So each all-reduce hides behind the other
half's block. Causality holds as in chunked prefill: B's attention of layer i reads the K/V that A's
attention of layer i wrote earlier on the same compute stream.

Costs: the halves' GEMMs are half as tall (still compute-bound at the lengths this is for, >= 2 x
`MIN_TOKENS`), and B's attention reads A's keys from the cache (the flash kernel) instead of attending within
one chunk. `EXLPY_TP_PIPELINE=1` turns it on (off by default until a GPU run records its gain:
benchmarks/tp.py times both). The lanes' coroutines are the ordinary block code; only the driver differs.

With NCCL the overlap did not pay on two H100s (27.0 ms against 26.5 ms plain for 2,048 tokens of a 70B-shaped
model): NCCL's kernels need SMs that B's GEMMs hold, and each GPU's waits for the other's to be scheduled. With
the copy collective (`EXLPY_TP_PREFILL_COMM=copy`, exlpy/parallel/tp_copy.py) an all-reduce is begun instead:
A's partials move by the copy engines while B computes, and when A resumes its compute streams wait for the
copies and add the peer's partial (one elementwise pass, on SMs only then).
"""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Sequence
from typing import Any

import torch

from exlpy.engine.lockstep import LockstepGroup, _device, _Op, current_streams
from exlpy.engine.strategy import Strategy, lane_batch
from exlpy.errors import TensorParallelError
from exlpy.model.batch import ForwardBatch
from exlpy.parallel.p2p import safe_move_tensor

MIN_TOKENS = 256  # per half: below this the halves' GEMMs lose more than the overlap gains


def pipeline_applies(strategy: Strategy, n_tokens: int, enabled: bool) -> bool:
    """Whether a prefill chunk of `n_tokens` tokens runs as two overlapped micro-batches."""
    if not enabled or n_tokens < 2 * MIN_TOKENS or strategy.name != "tensor_parallel":
        return False
    st = strategy.stages
    return len(st) == 1 and st[0].group is not None and len(st[0].lanes) > 1


class _Streams:
    """One communication stream per CUDA device of a group (created once, kept on the group)."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.comm = {str(d): torch.cuda.Stream(d) for d in devices if d.type == "cuda"}

    def on_comm(self, devices: Sequence[torch.device]) -> contextlib.AbstractContextManager[None]:
        """Every device's current stream is its communication stream (collectives launch on the current
        streams), after waiting for the work issued so far on its compute stream."""
        return current_streams({str(d): self.comm[str(d)] for d in devices if d.type == "cuda"})


def _streams(group: LockstepGroup, devices: Sequence[torch.device]) -> _Streams:
    s = getattr(group, "_pipeline_streams", None)
    if s is None or set(s.comm) != {str(d) for d in devices if d.type == "cuda"}:
        s = _Streams(devices)
        group._pipeline_streams = s  # type: ignore[attr-defined]
    return s


class _Micro:
    """One micro-batch: its lanes' coroutines, what they receive next, and its collective in flight."""

    def __init__(self, coros: list[Coroutine[Any, Any, Any]]) -> None:
        self.coros = coros
        self.inbox: list[Any] = [None] * len(coros)
        self.events: dict[str, torch.cuda.Event] = {}  # per CUDA device: its all-reduce is done
        self.pending: Any = None  # a begun copy all-reduce (exlpy/parallel/tp_copy.py Pending), finished on resume
        self.done: list[Any] | None = None


def run_overlapped(devices: Sequence[torch.device], micro: list[list[Coroutine[Any, Any, Any]]],
                   group: LockstepGroup) -> list[list[Any]]:
    """Drive each micro-batch's lanes (one coroutine per device, in device order) to their end, in turns: a
    micro-batch runs until all its lanes reach a collective, which is issued on the communication streams,
    then the next micro-batch runs. Returns every micro-batch's lane results."""
    streams = _streams(group, devices)
    ms = [_Micro(c) for c in micro]
    try:
        while any(m.done is None for m in ms):
            for m in ms:
                if m.done is not None:
                    continue
                for d in devices:  # its collective must be complete before its lanes read the sums
                    ev = m.events.pop(str(d), None)
                    if ev is not None:
                        torch.cuda.current_stream(d).wait_event(ev)
                if m.pending is not None:  # the copies' sums (and norms) on the compute streams, lanes receive them
                    m.inbox = m.pending.finish()
                    m.pending = None
                ops: list[_Op] = []
                finished: list[Any] = []
                for i, coro in enumerate(m.coros):
                    with _device(devices[i]):
                        try:
                            ops.append(coro.send(m.inbox[i]))
                        except StopIteration as stop:
                            finished.append(stop.value)
                if finished:
                    if len(finished) != len(m.coros):
                        raise TensorParallelError("tensor-parallel lanes diverged: some finished while others "
                                                  "wait at a collective")
                    m.done = finished
                    continue
                m.inbox = _issue(ops, devices, group, streams, m)
    finally:
        for m in ms:
            for c in m.coros:
                c.close()
    return [m.done for m in ms if m.done is not None]


def _issue(ops: list[_Op], devices: Sequence[torch.device], group: LockstepGroup, streams: _Streams,
           m: _Micro) -> list[Any]:
    """An all-reduce is begun by the copy collective (finished when the micro-batch resumes) where it takes it,
    or goes onto the communication streams (an event per device marks its end); anything else (the head's
    gather) runs in place on the compute streams."""
    m.pending = group.start(ops)  # the copy collective's sums (and next norms), finished when m resumes
    if m.pending is not None:
        return [None] * len(ops)
    if any(op.kind != "all_reduce" for op in ops):
        return group.run(ops)
    with streams.on_comm(devices):
        result = group.run(ops)
        for op, d in zip(ops, devices):
            if d.type == "cuda":
                # The tensor was made on the compute stream and is used on the communication stream: the
                # allocator must not hand its memory out again before the all-reduce is done.
                op.tensor.record_stream(torch.cuda.current_stream(d))
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(d))
                m.events[str(d)] = ev
    return result


def execute_pipelined(strategy: Strategy, ids: list[torch.Tensor], batches: list[ForwardBatch]
                      ) -> list[torch.Tensor | None]:
    """Like `strategy.execute` for a one-stage tensor-parallel strategy, over consecutive micro-batches of one
    chunk (`ids[k]` with `batches[k]`, in token order): what each micro-batch's first lane returned."""
    st = strategy.stages[0]
    assert st.group is not None
    devices = [lane.device for lane in st.lanes]
    micro = [[lane.run(safe_move_tensor(x, lane.device), lane_batch(lane, b)) for lane in st.lanes]
             for x, b in zip(ids, batches)]
    results = run_overlapped(devices, micro, st.group)
    for d in devices:  # later work on the compute streams must see every collective's result
        if d.type == "cuda":
            torch.cuda.current_stream(d).wait_stream(_streams(st.group, devices).comm[str(d)])
    return [r[0] for r in results]
