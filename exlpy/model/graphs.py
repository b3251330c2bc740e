"""CUDA-graph capture and replay of the q_len == 1 decode step.

At batch 1 a decode step is ~300 small kernels; launched from Python each costs ~12 µs of host time, about
as long as the GPU needs to read the weights. A captured graph replays them all with one launch.

A graph bakes in every tensor address it touches, so each step is captured over *static* buffers that the
caller's inputs are copied into: token ids plus either
- contiguous caches (`model.forward`): the shared past length, a one-element device tensor; positions,
  slots and lengths are derived from it inside the graph, one graph per batch size;
- paged caches (`model.forward_batch`): positions, slots, block table and lengths, one graph per batch-size
  bucket (rows past the live batch are padding: slot -1 writes nothing, length 0 reads nothing).
Attention inside the graph takes its key ranges from device memory (the Triton split-K decode kernel), never
from host values. A graph is rebuilt when the cache tensors behind it change; the model drops all graphs
when modules are unloaded or moved.

A model split over several GPUs is captured as one graph per *segment* (a run of modules on one device): each
segment has its own static step inputs on its device, and between replays the host copies the hidden state
into the next segment's static input: the same one hop per device boundary as the eager path, and one
launch per GPU per step instead of one per kernel.

With `capture=False` the same buffer logic runs the step eagerly: that is the debugging path
(`EXLLAMA_NO_GRAPHS` keeps the model off this module entirely) and what the CPU tests exercise.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from exlpy.kernels import ops
from exlpy.model.batch import ForwardBatch

if TYPE_CHECKING:
    from exlpy.model.model import ExLlamaV2

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graphs_supported(model: ExLlamaV2) -> bool:
    """Graphs need every module on a CUDA device, no tensor parallelism and the Triton kernels."""
    if model.config.no_graphs or model.tp_context is not None or not torch.cuda.is_available():
        return False
    devices = {m.device for m in model.modules}
    return all(d is not None and d.type == "cuda" for d in devices) and ops.has_cuda_kernels()


def cache_is_direct(cache: Any) -> bool:
    """Graphs need a cache that hands out its K/V tensors as they are (no per-forward dequantization, whose
    row selection syncs with the host)."""
    from exlpy.cache.base import ExLlamaV2CacheBase

    return isinstance(cache, ExLlamaV2CacheBase) and type(cache).layer_kv is ExLlamaV2CacheBase.layer_kv


def bucket_for(batch_size: int) -> int | None:
    return next((b for b in BUCKETS if b >= batch_size), None)


def cache_signature(cache: Any, layers: list[int]) -> tuple[int, ...]:
    """Addresses of every K/V tensor a step touches: a graph is valid only while these stay the same."""
    if hasattr(cache, "all_tensors"):
        return tuple(t.data_ptr() for t in cache.all_tensors())
    return tuple(t.data_ptr() for i in layers for t in cache.layer_kv(i))


@dataclass
class _Segment:
    """Modules [start, stop) on one device: static inputs there, a body that runs them, its graph and output."""

    device: torch.device
    start: int
    stop: int
    inputs: dict[str, torch.Tensor]
    body: Callable[[], torch.Tensor] | None = None
    x_in: torch.Tensor | None = None  # static hidden state fed by the previous segment (the first reads ids)
    stream: Any = None
    graph: Any = None
    output: torch.Tensor | None = None

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        # Capture, replay and Triton launches all use the *current* device: make it this segment's.
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()


@dataclass
class _Step:
    """The segments of one (cache, shape) key. `inputs` are the first segment's static inputs; per-step
    metadata written there is mirrored to the later segments' copies (`mirrored` names them)."""

    segments: list[_Segment]
    cache_ref: weakref.ref[Any]
    signature: tuple[int, ...]
    mirrored: tuple[str, ...] = ()
    live: int = -1  # live rows at the last call; padding rows are reset when it changes
    meta: dict[str, int] = field(default_factory=dict)

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return self.segments[0].inputs

    def mirror(self) -> None:
        for seg in self.segments[1:]:
            for name in self.mirrored:
                seg.inputs[name].copy_(self.inputs[name])

    def run(self, warm: bool = False) -> torch.Tensor:
        """One step: every segment in order, the hidden state copied across each device boundary. `warm`
        runs the bodies eagerly on the segments' own streams (the warm-up before capture)."""
        from exlpy.parallel.p2p import peer_copy_ok

        out: torch.Tensor | None = None
        for seg in self.segments:
            if out is not None:
                if seg.x_in is None:  # allocated by the first (warm-up or eager) run, never under capture
                    seg.x_in = torch.empty_like(out, device=seg.device)
                direct = out.device.type != "cuda" or peer_copy_ok(out.device, seg.device)
                seg.x_in.copy_(out if direct else out.cpu())
            with seg.scope():
                if seg.graph is not None:
                    seg.graph.replay()
                elif warm:
                    cur = torch.cuda.current_stream(seg.device)
                    seg.stream.wait_stream(cur)
                    with torch.cuda.stream(seg.stream):
                        seg.output = seg.body()
                    cur.wait_stream(seg.stream)
                else:
                    seg.output = seg.body()
            out = seg.output
        assert out is not None
        return out


class DecodeGraphs:
    """Decode-step runner owned by one model; see the module docstring.

    `cuts`: extra segment boundaries (module indices) on top of the device changes; the CPU tests use them to
    exercise the cross-segment hop without GPUs."""

    def __init__(self, model: ExLlamaV2, capture: bool = True, cuts: tuple[int, ...] = ()) -> None:
        self.model = model
        self.capture = capture
        self.device = model.modules[0].device
        self.layers = [m.layer_idx for m in model.attention_modules()]
        self._steps: dict[tuple[Any, ...], _Step] = {}
        self._pools: dict[str, Any] = {}
        self.ranges: list[tuple[torch.device, int, int]] = []
        start = 0
        for i in range(1, len(model.modules) + 1):
            if i == len(model.modules) or model.modules[i].device != model.modules[start].device or i in cuts:
                dev = model.modules[start].device
                assert dev is not None
                self.ranges.append((dev, start, i))
                start = i

    def clear(self) -> None:
        self._steps.clear()

    # --- entry points ---------------------------------------------------------------------------------------
    def decode_contiguous(self, ids: torch.Tensor, cache: Any, past: int) -> torch.Tensor:
        """Logits [B, 1, vocab] for one new token per row of a contiguous cache holding `past` tokens."""
        B = ids.shape[0]
        step = self._get(("contiguous", id(cache), B), cache, lambda: self._contiguous_step(cache, B))
        step.inputs["ids"].copy_(ids.view(B, 1))
        for seg in step.segments:
            seg.inputs["past"].fill_(past)
        return self._finish(step, ids, B)

    def decode_paged(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [B, 1, vocab] for a caller-built paged batch; None when no bucket fits (run eagerly)."""
        B = batch.batch_size
        bucket = bucket_for(B)
        assert batch.block_table is not None and batch.slots is not None and batch.seqlens is not None
        pages = batch.block_table.shape[1]
        width = bucket_for(pages) or pages
        if bucket is None:
            return None
        key = ("paged", id(batch.cache), bucket, width, batch.page_size)
        step = self._get(key, batch.cache, lambda: self._paged_step(batch.cache, bucket, width, batch.page_size))
        inp = step.inputs
        if step.live != B:
            # Padding rows: write nowhere, read nothing, and never a stale slot of a finished sequence.
            inp["slots"][B:].fill_(-1)
            inp["seqlens"][B:].zero_()
            step.live = B
        inp["ids"][:B].copy_(ids.view(B, 1))
        inp["positions"][:B].copy_(batch.positions.view(B, 1))
        inp["slots"][:B].copy_(batch.slots.view(B, 1))
        inp["block_table"][:B, :pages].copy_(batch.block_table)
        inp["seqlens"][:B].copy_(batch.seqlens)
        step.mirror()
        return self._finish(step, ids, B)

    # --- capture ----------------------------------------------------------------------------------------------
    def _get(self, key: tuple[Any, ...], cache: Any, build: Callable[[], _Step]) -> _Step:
        step = self._steps.get(key)
        if step is not None and (step.cache_ref() is not cache
                                 or step.signature != cache_signature(cache, self.layers)):
            step = None  # the cache object or its tensors changed: the captured addresses are stale
        if step is None:
            step = build()
            self._steps[key] = step
        return step

    def _finish(self, step: _Step, ids: torch.Tensor, B: int) -> torch.Tensor:
        if self.capture and step.segments[0].graph is None:
            self._capture(step)  # the warm-up inside runs this very step; the replay below repeats it exactly
        with step.segments[-1].scope():
            return step.run()[:B].clone()  # the static output is overwritten by the next replay

    def _capture(self, step: _Step) -> None:
        for seg in step.segments:
            seg.stream = torch.cuda.Stream(seg.device)
        for _ in range(2):  # compiles Triton kernels and sets up cuBLAS workspaces outside the capture
            step.run(warm=True)
        for seg in step.segments:
            key = str(seg.device)
            with seg.scope():
                if key not in self._pools:
                    self._pools[key] = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                # An explicit capture stream: torch.cuda.graph's default one is created once per process, on
                # whichever device was current at its first use.
                assert seg.body is not None
                with torch.cuda.graph(graph, pool=self._pools[key], stream=seg.stream):
                    seg.output = seg.body()
            seg.graph = graph

    def _segment_body(self, seg: _Segment, batch: Callable[[], ForwardBatch]) -> Callable[[], torch.Tensor]:
        """Run the segment's modules on its static input; the last segment returns float32 logits."""
        model = self.model
        last = seg.stop == len(model.modules)

        def body() -> torch.Tensor:
            x = seg.inputs["ids"] if seg.start == 0 else seg.x_in
            assert x is not None
            out = model._run_segment(x, batch(), seg.start, seg.stop)
            return out.float() if last else out

        return body

    def _segments(self, make_inputs: Callable[[torch.device], dict[str, torch.Tensor]],
                  make_batch: Callable[[dict[str, torch.Tensor]], ForwardBatch]) -> list[_Segment]:
        segs = []
        for dev, a, b in self.ranges:
            seg = _Segment(dev, a, b, make_inputs(dev))
            seg.body = self._segment_body(seg, lambda s=seg: make_batch(s.inputs))
            segs.append(seg)
        return segs

    def _contiguous_step(self, cache: Any, B: int) -> _Step:
        S = cache.max_seq_len

        def inputs(dev: torch.device) -> dict[str, torch.Tensor]:
            rows = torch.arange(B, device=dev)
            return {"ids": torch.zeros(B, 1, dtype=torch.long, device=dev),
                    "past": torch.zeros(1, dtype=torch.long, device=dev),
                    "rows": rows, "block_table": rows.int().unsqueeze(1)}

        def batch(inp: dict[str, torch.Tensor]) -> ForwardBatch:
            positions = inp["past"].expand(B).unsqueeze(1)
            return ForwardBatch(B, 1, positions, cache=cache, slots=inp["rows"].unsqueeze(1) * S + positions,
                                block_table=inp["block_table"], page_size=S,
                                seqlens=(positions[:, 0] + 1).int(), max_seqlen=S)

        return _Step(self._segments(inputs, batch), weakref.ref(cache), cache_signature(cache, self.layers))

    def _paged_step(self, cache: Any, bucket: int, width: int, page_size: int) -> _Step:
        def inputs(dev: torch.device) -> dict[str, torch.Tensor]:
            return {
                "ids": torch.zeros(bucket, 1, dtype=torch.long, device=dev),
                "positions": torch.zeros(bucket, 1, dtype=torch.long, device=dev),
                "slots": torch.full((bucket, 1), -1, dtype=torch.long, device=dev),
                "block_table": torch.zeros(bucket, width, dtype=torch.int32, device=dev),
                "seqlens": torch.zeros(bucket, dtype=torch.int32, device=dev),
            }

        def batch(inp: dict[str, torch.Tensor]) -> ForwardBatch:
            return ForwardBatch(bucket, 1, inp["positions"], cache=cache, slots=inp["slots"],
                                block_table=inp["block_table"], page_size=page_size, seqlens=inp["seqlens"],
                                max_seqlen=width * page_size)

        return _Step(self._segments(inputs, batch), weakref.ref(cache), cache_signature(cache, self.layers),
                     mirrored=("positions", "slots", "block_table", "seqlens"))
