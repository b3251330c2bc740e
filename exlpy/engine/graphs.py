"""CUDA graphs of a strategy's step: one wrapper for one GPU, a layer split and tensor parallelism.

At batch 1 a decode step is ~300 small kernels; launched from Python each costs ~12 µs of host time, about
as long as the GPU needs to read the weights. A captured graph replays them all with one launch.

A graph bakes in every tensor address it touches, so a step is captured over *static* inputs: token ids
[rows, T] on the first stage's devices and the packed metadata (positions, cache slots, lengths, block
table, adapter slot per row; exlpy/model/batch.py) on every device, shaped by (row bucket, T, table-width
bucket). A step whose rows use LoRA adapters is captured apart (its key holds the adapter registry's
generation, exlpy/lora/): the adapter kernels read the slot buffers and the per-row slots from device memory,
so loading or unloading an adapter rewrites buffers and recaptures nothing; steps without adapters keep their
plain graphs. A step is
uploaded as host integers straight into those buffers; padding rows write nowhere (slot -1) and read
nothing (length 0). Attention inside the graph takes key ranges from device memory, never host values, so
one graph serves every step of its shape. T may be 1 (decode) up to `MAX_Q_LEN` (speculative verification).

Prompt chunks of one sequence are captured too (`run_chunk`): T one of `CHUNK_BUCKETS`, one row, no logits (the
pass stops after the last attention). A chunk of n tokens runs in the smallest bucket >= n, padded with tokens
that write nowhere and that no real token sees (exlpy/model/batch.py `pack`, `lengths`). An eager chunk costs
the host its kernel launches (~20 ms on an 8B whatever its length), and the decode step launched after it waits
for them; a replay costs what a decode step's does. A chunk graph that fails to capture warns and turns chunk
graphs off for this runner: the caller runs the chunk eagerly.

Each stage of the strategy is captured with one graph per lane: a single lane for one GPU, one per segment
of a layer split (the host copies the hidden state between replays: the one hop per device boundary of the
eager path), and one per GPU for tensor parallelism, whose lanes are captured together with every GPU's
capture stream open, the collectives (NCCL or the peer all-reduce) recorded inside. A graph is rebuilt when
the cache tensors behind it change; the whole runner goes with the strategy when modules are reloaded.

With `capture=False` the same buffer logic runs the step eagerly: the debugging path, and what CPU tests run.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from exlpy.capture import gc_paused
from exlpy.engine.lockstep import current_streams, run_lanes
from exlpy.engine.strategy import Lane, Stage, Strategy
from exlpy.errors import InsufficientVRAMError
from exlpy.model.batch import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, ForwardBatch, pack, packed_size, staging, unpack
from exlpy.parallel.p2p import peer_copy_ok

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_Q_LEN = 8
# Token counts of captured prompt chunks (one sequence each). Few sizes: each is captured once per table-width
# bucket. The smallest is above the decode kernel's query length (the flash kernel runs every bucket).
CHUNK_BUCKETS = (32, 64, 128, 256)
# Failed captures of one decode shape before it stays eager (each failure costs the step a warm-up run).
CAPTURE_TRIES = 3


def bucket_for(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


def chunk_bucket(n: int) -> int | None:
    """The captured chunk size that holds n prompt tokens (None: more than the largest)."""
    return next((b for b in CHUNK_BUCKETS if b >= n), None) if n >= 1 else None


def cache_signature(cache: Any) -> tuple[int, ...]:
    """Addresses of every K/V tensor a step touches: a graph is valid only while these stay the same."""
    return tuple(t.data_ptr() for t in cache.all_tensors())


def _scope(dev: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


@dataclass
class _LaneStep:
    lane: Lane
    batch: ForwardBatch  # static, over this device's metadata buffer and this lane's cache part
    x_in: torch.Tensor | None = None  # static input: token ids (first stage) or the previous stage's output
    graph: Any = None
    output: Any = None


@dataclass
class _Step:
    """The captured form of one (cache, row bucket, T, width bucket) shape."""

    rows: int
    q_len: int
    width: int
    page_size: int
    cache_ref: weakref.ref[Any]
    signature: tuple[int, ...]
    meta: dict[str, torch.Tensor]  # per device: the packed metadata buffer
    stages: list[tuple[Stage, list[_LaneStep]]] = field(default_factory=list)
    captured: bool = False
    chunk: bool = False  # a prompt chunk: no logits, the pass ends after the last attention
    failures: int = 0  # captures of this shape that failed (CAPTURE_TRIES of them: it runs eagerly for good)


class StepGraphs:
    """The graph runner of one strategy (see the module docstring)."""

    def __init__(self, strategy: Strategy, capture: bool = True) -> None:
        self.strategy = strategy
        self.capture = capture
        self.steps: dict[tuple[Any, ...], _Step] = {}
        self._pools: dict[str, Any] = {}
        self.chunks_failed = False  # a chunk graph failed to capture: chunks run eagerly from then on
        self.chunks_run = 0  # prompt chunks run through `run_chunk` (benchmarks count them)
        self.capture_failures = 0  # decode-step captures that failed (those steps ran eagerly)

    def clear(self) -> None:
        self.steps.clear()

    # --- entry points ---------------------------------------------------------------------------------------
    def run_rows(self, ids: torch.Tensor, cache: Any, starts: list[int], tables: list[list[int]] | None,
                 page_size: int, logits: str = LOGITS_ALL, adapters: list[int] | None = None, lora: int = 0
                 ) -> torch.Tensor | None:
        """Logits [B, T, vocab] for rows continuing at `starts` (cache pages `tables`, LoRA slots `adapters`
        when `lora` is nonzero); None when no graph shape fits (the caller runs the step eagerly)."""
        B, T = ids.shape
        width = 1 if tables is None else max(len(t) for t in tables)
        step = self._step(cache, B, T, width, page_size, lora if adapters is not None else 0)
        if step is None:
            return None
        if tables is None:  # contiguous cache: row b is page b
            tables = [[b] for b in range(B)]
        values = pack(starts, T, tables, page_size, step.rows, step.width, adapters)
        host_ids = ids.device.type == "cpu"
        if host_ids:  # the token ids ride in the same upload, into the static input behind the metadata
            values += ids.reshape(-1).tolist()
        for meta in step.meta.values():
            staging.upload(values, meta)
        return self._finish(step, ids, B, logits, ids_uploaded=host_ids)

    def run_batch(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits for a caller-built batch, or None where graphs do not apply."""
        if (batch.cache is None or batch.key_mask is not None or batch.rope_positions is not None
                or batch.mm is not None or batch.keep_last_state or batch.logits not in (LOGITS_ALL, LOGITS_LAST)
                or batch.block_table is None):
            return None
        B = ids.shape[0]
        if batch.host is not None and batch.batch_size == B:
            starts, tables, adapters = batch.host
            return self.run_rows(ids, batch.cache, starts, tables, batch.page_size, batch.logits, adapters,
                                 batch.lora)
        lora = batch.lora if batch.adapters is not None else 0
        step = self._step(batch.cache, B, batch.q_len, batch.block_table.shape[1], batch.page_size, lora)
        if step is None:
            return None
        for dev, meta in step.meta.items():  # a hand-built batch: copy its tensors, padding written anew
            pos, slots, seqlens, table, adapter, _ = unpack(meta, step.rows, step.q_len, step.width)
            src = batch.on(torch.device(dev))
            assert src.slots is not None and src.seqlens is not None and src.block_table is not None
            pos[:B].copy_(src.positions)
            slots[:B].copy_(src.slots)
            slots[B:].fill_(-1)
            seqlens[:B].copy_(src.seqlens)
            seqlens[B:].zero_()
            table[:B, :src.block_table.shape[1]].copy_(src.block_table)
            if src.adapters is not None:
                adapter[:B].copy_(src.adapters)
            else:
                adapter[:B].fill_(-1)
            adapter[B:].fill_(-1)
        return self._finish(step, ids, B, batch.logits)

    def run_chunk(self, ids: torch.Tensor, batch: ForwardBatch) -> bool:
        """Run a prompt chunk ([1, n] host ids; `batch` from `build_batch` with one row, no logits) as the
        captured chunk of the smallest bucket >= n. False when no captured chunk applies (the caller runs it
        eagerly): n above the largest bucket, a batch graphs cannot take, or a capture that failed."""
        n = ids.shape[-1]
        T = chunk_bucket(n)
        if (T is None or self.chunks_failed or ids.shape[0] != 1 or batch.batch_size != 1 or batch.host is None
                or batch.cache is None or batch.host[1] is None or batch.logits != LOGITS_NONE
                or batch.key_mask is not None or batch.rope_positions is not None or batch.mm is not None
                or batch.keep_last_state):
            return False
        starts, tables, adapters = batch.host
        lora = batch.lora if adapters is not None else 0
        step = self._step(batch.cache, 1, T, len(tables[0]), batch.page_size, lora, chunk=True)
        if step is None:
            return False
        values = pack(starts, T, tables, batch.page_size, 1, step.width, adapters, lengths=[n])
        host = ids.reshape(-1).tolist()
        values += host + [host[-1]] * (T - n)  # the ids behind the metadata; padding tokens: any valid id
        for meta in step.meta.values():
            staging.upload(values, meta)
        try:
            self._finish(step, ids, 1, LOGITS_NONE, ids_uploaded=True)
        except Exception as e:
            if not self.capture or step.captured:
                raise  # a failing chunk, not a failing capture: the caller's error
            warnings.warn(f"capturing a prompt chunk of {T} tokens failed ({type(e).__name__}: {e}); prompt chunks "
                          "run eagerly from now on", stacklevel=2)
            self.chunks_failed = True
            for key in [k for k, st in self.steps.items() if st.chunk]:
                del self.steps[key]
            return False
        self.chunks_run += 1
        return True

    # --- shapes -----------------------------------------------------------------------------------------------
    def _step(self, cache: Any, B: int, T: int, width: int, page_size: int, lora: int = 0,
              chunk: bool = False) -> _Step | None:
        rows = bucket_for(B)
        if chunk:
            if B != 1 or T not in CHUNK_BUCKETS:
                return None
        elif rows is None or T > MAX_Q_LEN:
            return None
        if not getattr(cache, "graph_safe", False):
            return None
        width = bucket_for(width) or width
        key = (id(cache), rows, T, width, page_size, chunk, lora)
        step = self.steps.get(key)
        if step is not None and (step.cache_ref() is not cache or step.signature != cache_signature(cache)):
            step = None  # the cache object or its tensors changed: the captured addresses are stale
        if step is None:
            if lora:  # steps of an older adapter generation read slot buffers that were reallocated since
                for k in [k for k in self.steps if k[-1] not in (0, lora)]:
                    del self.steps[k]
            step = self._build(cache, rows, T, width, page_size, lora, chunk)
            self.steps[key] = step
        return step

    def _build(self, cache: Any, rows: int, T: int, width: int, page_size: int, lora: int = 0,
               chunk: bool = False) -> _Step:
        meta: dict[str, torch.Tensor] = {}
        size = packed_size(rows, T, width)
        for dev in self.strategy.devices:
            # the packed metadata, then the step's token ids (the first stage's static input): one upload a step
            meta[str(dev)] = torch.zeros(size + rows * T, dtype=torch.int64, device=dev)
        step = _Step(rows, T, width, page_size, weakref.ref(cache), cache_signature(cache), meta, chunk=chunk)
        for k, stage in enumerate(self.strategy.stages):
            lanes = []
            for lane in stage.lanes:
                pos, slots, seqlens, table, adapter, m = unpack(meta[str(lane.device)], rows, T, width)
                batch = ForwardBatch(rows, T, pos, cache=lane.cache_part(cache), slots=slots, block_table=table,
                                     page_size=page_size, seqlens=seqlens, max_seqlen=width * page_size, meta=m,
                                     adapters=adapter, lora=lora, logits=LOGITS_NONE if chunk else LOGITS_ALL)
                ids = meta[str(lane.device)][size:].view(rows, T) if k == 0 else None
                lanes.append(_LaneStep(lane, batch, ids))
            step.stages.append((stage, lanes))
        return step

    # --- running --------------------------------------------------------------------------------------------
    def _finish(self, step: _Step, ids: torch.Tensor, B: int, logits: str, ids_uploaded: bool = False
                ) -> torch.Tensor | None:
        host_ids = ids.reshape(-1).tolist() if ids.device.type == "cpu" and not ids_uploaded else None
        for ls in step.stages[0][1]:
            assert ls.x_in is not None
            if ids_uploaded:
                continue  # came with the metadata (run_rows)
            if host_ids is not None:  # through pinned memory: no wait for the device
                staging.upload(host_ids, ls.x_in.view(-1))
            else:  # ids already on a device (a sampled token fed straight back): a device copy
                ls.x_in[:B].copy_(ids.view(B, step.q_len))
        if self.capture and not step.captured and step.failures < CAPTURE_TRIES:
            try:
                self._capture(step)  # the warm-up inside runs this very step; the replay below repeats it exactly
            except (torch.cuda.OutOfMemoryError, InsufficientVRAMError):
                raise  # the caller's to handle (the warm-up stops capturing larger shapes there)
            except Exception as e:
                if step.chunk:
                    raise  # run_chunk turns captured prompt chunks off
                self._capture_failed(step, e)
        out = self._run(step, replay=self.capture and step.captured)
        if out is None:  # a prompt chunk: the cache is written, nothing else is wanted
            return None
        with _scope(out.device):
            out = out[:B].clone()  # the static output is overwritten by the next replay
        return out[:, -1:] if logits == LOGITS_LAST and out.shape[1] > 1 else out

    def _capture_failed(self, step: _Step, e: Exception) -> None:
        """A decode step's capture failed: the step runs eagerly this time (the pass is repeatable: it writes the
        same cache rows again), so the jobs in it go on; after CAPTURE_TRIES failures this shape stays eager."""
        step.failures += 1
        self.capture_failures += 1
        warnings.warn(f"capturing a decode step of {step.rows} rows x {step.q_len} tokens failed ({type(e).__name__}: "
                      f"{e}); it runs eagerly" + (" from now on" if step.failures >= CAPTURE_TRIES else " this time"),
                      stacklevel=3)
        for _, lanes in step.stages:
            for ls in lanes:
                ls.graph = None

    def _run(self, step: _Step, replay: bool) -> torch.Tensor | None:
        """The step's output (None for a prompt chunk, whose pass ends after the last attention: the stages
        after it are not run, and a layer split's later segments have no graph)."""
        out: torch.Tensor | None = None
        for k, (stage, lanes) in enumerate(step.stages):
            if k and out is None:
                break
            if out is not None:
                self._hop(out, lanes)
            if replay:
                for ls in lanes:
                    with _scope(ls.lane.device):
                        ls.graph.replay()
            else:
                self._eager(stage, lanes)
            out = lanes[0].output
        return out

    @staticmethod
    def _hop(out: torch.Tensor, lanes: list[_LaneStep]) -> None:
        for ls in lanes:
            if ls.x_in is None:  # allocated by the first (warm-up or eager) run, never under capture
                ls.x_in = torch.empty_like(out, device=ls.lane.device)
            direct = out.device.type != "cuda" or peer_copy_ok(out.device, ls.lane.device)
            ls.x_in.copy_(out if direct else out.cpu())

    @staticmethod
    def _eager(stage: Stage, lanes: list[_LaneStep]) -> None:
        outs = run_lanes([(ls.lane.device, ls.lane.run(ls.x_in, ls.batch)) for ls in lanes], stage.group)
        for ls, o in zip(lanes, outs):
            ls.output = o

    def _capture(self, step: _Step) -> None:
        streams = {str(d): torch.cuda.Stream(d) for d in self.strategy.devices}
        # each device's current stream is its capture stream: the warm-up runs there too, so per-stream set-up
        # such as cuBLAS workspaces happens on the stream the graph is captured on
        with self._capturing(step), current_streams(streams, join=True):
            for _ in range(2):  # compiles Triton kernels, sets up cuBLAS workspaces and NCCL outside the capture
                self._run(step, replay=False)
            for d in self.strategy.devices:
                torch.cuda.synchronize(d)
            out: torch.Tensor | None = None
            for k, (stage, lanes) in enumerate(step.stages):
                if k and out is None:
                    break  # a prompt chunk ended in an earlier stage
                if out is not None:
                    self._hop(out, lanes)  # allocation only; replays copy again
                self._capture_stage(stage, lanes)
                out = lanes[0].output
        for d in self.strategy.devices:
            torch.cuda.synchronize(d)
        step.captured = True

    def _capture_stage(self, stage: Stage, lanes: list[_LaneStep]) -> None:
        """One graph per lane. The lanes of a tensor-parallel stage are captured together: every capture is
        open while the lock-step driver issues their kernels and collectives."""
        graphs = [torch.cuda.CUDAGraph() for _ in lanes]
        # "relaxed": under "global" a second capture_begin is refused while the first lane's capture is open
        # (benchmarks/capture_probe.py; H200, torch 2.11, CUDA 13). "thread_local" for one lane: a server's other
        # threads (the event loop, grammar workers) may use CUDA meanwhile, which "global" turns into a failed capture.
        mode = "thread_local" if len(lanes) == 1 else "relaxed"
        with gc_paused():  # no earlier graph is destroyed mid-capture (exlpy/capture.py)
            self._capture_lanes(stage, lanes, graphs, mode)
        for ls, g in zip(lanes, graphs):
            ls.graph = g

    def _capture_lanes(self, stage: Stage, lanes: list[_LaneStep], graphs: list[Any], mode: str) -> None:
        begun: list[int] = []
        failed = True
        try:
            for k, ls in enumerate(lanes):
                key = str(ls.lane.device)
                with _scope(ls.lane.device):
                    if key not in self._pools:
                        self._pools[key] = torch.cuda.graph_pool_handle()
                    graphs[k].capture_begin(pool=self._pools[key], capture_error_mode=mode)
                    begun.append(k)
            self._eager(stage, lanes)
            failed = False
        finally:
            end_error: RuntimeError | None = None
            for k in begun:  # every open capture is closed, whatever happened
                with _scope(lanes[k].lane.device):
                    try:
                        graphs[k].capture_end()
                    except RuntimeError as e:  # after a failure above, the invalidated captures say so again
                        end_error = end_error or e
            if failed or end_error is not None:
                # A capture that failed can leave its memory pool marked as recording ("beginAllocateToPool:
                # already recording to mempool_id" on the next capture): later captures take a fresh pool.
                for k in begun:
                    self._pools.pop(str(lanes[k].lane.device), None)
            if end_error is not None and not failed:
                raise end_error

    @contextlib.contextmanager
    def _capturing(self, step: _Step) -> Iterator[None]:
        groups = [st.group for st, _ in step.stages if st.group is not None]
        for g in groups:
            g.capturing = True  # collectives avoid cross-device copies (warm-up runs the same kernels)
        try:
            yield
        finally:
            for g in groups:
                g.capturing = False
