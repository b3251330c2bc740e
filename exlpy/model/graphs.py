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
    """Graphs need every module on one CUDA device, no tensor parallelism and the Triton kernels."""
    if model.config.no_graphs or model.tp_context is not None or not torch.cuda.is_available():
        return False
    devices = {m.device for m in model.modules}
    if len(devices) != 1:
        return False
    dev = next(iter(devices))
    return dev is not None and dev.type == "cuda" and ops.has_cuda_kernels()


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
class _Step:
    """Static inputs, the captured graph (or None: eager) and its output for one (cache, shape) key."""

    inputs: dict[str, torch.Tensor]
    body: Callable[[], torch.Tensor]
    cache_ref: weakref.ref[Any]
    signature: tuple[int, ...]
    graph: Any = None
    output: torch.Tensor | None = None
    live: int = -1  # live rows at the last call; padding rows are reset when it changes
    meta: dict[str, int] = field(default_factory=dict)

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self.body()
        self.graph.replay()
        assert self.output is not None
        return self.output


class DecodeGraphs:
    """Decode-step runner owned by one model; see the module docstring."""

    def __init__(self, model: ExLlamaV2, capture: bool = True) -> None:
        self.model = model
        self.capture = capture
        self.device = model.modules[0].device
        self.layers = [m.layer_idx for m in model.attention_modules()]
        self._steps: dict[tuple[Any, ...], _Step] = {}
        self._pool: Any = None

    def clear(self) -> None:
        self._steps.clear()

    # --- entry points ---------------------------------------------------------------------------------------
    def decode_contiguous(self, ids: torch.Tensor, cache: Any, past: int) -> torch.Tensor:
        """Logits [B, 1, vocab] for one new token per row of a contiguous cache holding `past` tokens."""
        B = ids.shape[0]
        step = self._get(("contiguous", id(cache), B), cache, lambda: self._contiguous_step(cache, B))
        step.inputs["ids"].copy_(ids.view(B, 1))
        step.inputs["past"].fill_(past)
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
        # Capture and replay happen on the *current* device's streams: make it the model's, or a model placed
        # on cuda:1 would be captured on (and replayed into) a stream of cuda:0.
        on_device = (torch.cuda.device(self.device) if self.capture and self.device is not None
                     and self.device.type == "cuda" else contextlib.nullcontext())
        with on_device:
            if self.capture and step.graph is None:
                self._capture(step)  # the warm-up inside runs this very step; the replay below repeats it exactly
            return step.run()[:B].clone()  # the static output is overwritten by the next replay

    def _capture(self, step: _Step) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles Triton kernels and sets up cuBLAS workspaces outside the capture
                step.body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # An explicit capture stream: torch.cuda.graph's default one is created once per process, on whichever
        # device was current at its first use.
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            step.output = step.body()
        step.graph = graph

    def _run_model(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model._run(ids, batch, False, False, False, False)

    def _contiguous_step(self, cache: Any, B: int) -> _Step:
        dev = self.device
        S = cache.max_seq_len
        ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        past = torch.zeros(1, dtype=torch.long, device=dev)
        rows = torch.arange(B, device=dev)
        block_table = rows.int().unsqueeze(1)

        def body() -> torch.Tensor:
            positions = past.expand(B).unsqueeze(1)
            batch = ForwardBatch(B, 1, positions, cache=cache, slots=rows.unsqueeze(1) * S + positions,
                                 block_table=block_table, page_size=S, seqlens=(positions[:, 0] + 1).int(),
                                 max_seqlen=S)
            return self._run_model(ids, batch)

        return _Step({"ids": ids, "past": past}, body, weakref.ref(cache), cache_signature(cache, self.layers))

    def _paged_step(self, cache: Any, bucket: int, width: int, page_size: int) -> _Step:
        dev = self.device
        inp = {
            "ids": torch.zeros(bucket, 1, dtype=torch.long, device=dev),
            "positions": torch.zeros(bucket, 1, dtype=torch.long, device=dev),
            "slots": torch.full((bucket, 1), -1, dtype=torch.long, device=dev),
            "block_table": torch.zeros(bucket, width, dtype=torch.int32, device=dev),
            "seqlens": torch.zeros(bucket, dtype=torch.int32, device=dev),
        }

        def body() -> torch.Tensor:
            batch = ForwardBatch(bucket, 1, inp["positions"], cache=cache, slots=inp["slots"],
                                 block_table=inp["block_table"], page_size=page_size, seqlens=inp["seqlens"],
                                 max_seqlen=width * page_size)
            return self._run_model(inp["ids"], batch)

        return _Step(inp, body, weakref.ref(cache), cache_signature(cache, self.layers))
