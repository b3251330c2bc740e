"""Layer streaming (exllamav2's `load(lazy=True)` and test_inference.py's -sl): a model larger than GPU memory
runs with only its KV cache resident. Each module's weights are read from the memory-mapped safetensors files
(which the OS keeps in host memory after the first pass) and copied to the module's device just before it runs,
and freed right after; a loader thread reads the next module while the current one computes.

- `ExLlamaV2.load(lazy=True)` assigns every module a device (`assign_devices`: GPU 0, the devices of a
  `gpu_split` plan, or the CPU) and loads nothing; cache layers are allocated on the attention layers' devices
  as usual.
- Every forward entry (model.forward, forward_batch, the generators) then runs the `streaming` strategy: one
  stage per run of modules on one device, each a `StreamingTransformer` (Transformer.forward with every module
  loaded around its run). An input longer than max_input_len goes through a cache in chunks, run layer-major
  (`execute_layer_major`: each module once for all chunks).
- `stream_rows` is the layer-major pass of exllamav2's -sl perplexity: all rows through one module, then the
  next, so each module is read once for a whole dataset.

Not with CUDA graphs (the weights move), LoRA adapters (their buffers live on loaded modules) or tensor
parallelism: those load normally.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from exlpy.engine.split import segments
from exlpy.engine.strategy import Lane, Stage, Strategy
from exlpy.errors import ModelStateError
from exlpy.model.attention import Attention
from exlpy.model.batch import LOGITS_NONE, ForwardBatch, contiguous_batch
from exlpy.model.module import Module, drive, run_module
from exlpy.model.transformer import Transformer
from exlpy.parallel.p2p import safe_move_tensor
from exlpy.weights.checks import module_checks


class ModuleLoader:
    """Loads modules onto their devices on demand, one ahead in a background thread (`prefetch`), and frees
    them after use. On CUDA the loads are issued on the stream the forward runs on, so freed memory is reused in
    stream order and a module's weights land before its kernels."""

    def __init__(self, modules: Sequence[Module], devices: Sequence[torch.device], prefetch: bool = True) -> None:
        self.modules, self.devices = list(modules), list(devices)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="exlpy-stream") if prefetch else None
        self._pending: dict[int, Future[None]] = {}
        self._lock = threading.Lock()
        self.loads = 0  # module loads so far (each module is read once per pass over it)
        self.peak_resident = 0  # most modules loaded at once

    def _load(self, i: int, stream: Any) -> None:
        m, d = self.modules[i], self.devices[i]
        cuda = d.type == "cuda"
        with torch.cuda.device(d) if cuda else contextlib.nullcontext(), \
                torch.cuda.stream(stream) if cuda and stream is not None else contextlib.nullcontext(), \
                module_checks():
            m.load(d)
        with self._lock:
            self.loads += 1
            self.peak_resident = max(self.peak_resident, sum(x.device is not None for x in self.modules))

    def _stream(self, i: int) -> Any:
        d = self.devices[i]
        return torch.cuda.current_stream(d) if d.type == "cuda" else None

    def prefetch(self, i: int) -> None:
        """Start loading module i in the background (no-op if it is loaded or loading)."""
        if self._pool is None or i in self._pending or self.modules[i].device is not None:
            return
        self._pending[i] = self._pool.submit(self._load, i, self._stream(i))

    def acquire(self, i: int) -> Module:
        """Module i, loaded (waiting for its prefetch, or loading it now)."""
        fut = self._pending.pop(i, None)
        if fut is not None:
            fut.result()  # re-raises a load error (a missing tensor, NaN weights) here, in the forward
        elif self.modules[i].device is None:
            self._load(i, self._stream(i))
        return self.modules[i]

    def release(self, i: int) -> None:
        self.modules[i].unload()

    def release_all(self) -> None:
        """Free every module this loader loaded (after a pass, or when a forward fails midway)."""
        for i, fut in list(self._pending.items()):
            with contextlib.suppress(Exception):  # the forward's own error is the one to report
                fut.result()
            del self._pending[i]
        for m in self.modules:
            if m.device is not None:
                m.unload()

    def close(self) -> None:
        self.release_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class StreamingTransformer(Transformer):
    """Transformer.forward over modules [start, stop) with each module loaded just before it runs (the next
    one prefetched) and freed after."""

    def __init__(self, modules: list[Module], loader: ModuleLoader) -> None:
        super().__init__(modules)
        self.loader = loader
        self._stop = len(modules)

    async def forward(self, x: torch.Tensor, batch: ForwardBatch, start: int = 0, stop: int | None = None
                      ) -> torch.Tensor | None:
        self._stop = len(self.modules) if stop is None else stop
        try:
            return await super().forward(x, batch, start, stop)
        finally:
            self.loader.release_all()  # a prefetch nothing used (a prefill stops early), or after an error

    async def run(self, i: int, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        module = self.loader.acquire(i)
        nxt = i + 1
        if nxt < self._stop and not (batch.logits == LOGITS_NONE and nxt > self.last_attn):
            self.loader.prefetch(nxt)
        try:
            return await module.forward(x, batch)
        finally:
            self.loader.release(i)


def assign_devices(model: Any, devices: Sequence[torch.device]) -> None:
    """`load(lazy=True)`: module i will run on devices[i]; nothing is loaded. Cache layers follow the
    attention layers' devices."""
    for m, d in zip(model.modules, devices):
        if isinstance(m, Attention):
            model.layer_devices.assign(m.layer_idx, d)
    model.stream = ModuleLoader(model.modules, devices)


def streaming_strategy(model: Any) -> Strategy:
    """One stage per run of consecutive modules on one device, each streaming its modules."""
    loader: ModuleLoader = model.stream
    core = StreamingTransformer(model.modules, loader)
    stages = [Stage([Lane(dev, partial(core.forward, start=a, stop=b), modules=core.modules[a:b])])
              for dev, a, b in segments(loader.devices)]
    return Strategy("streaming", stages, graph_safe=False)


def stream_rows(model: Any, ids: torch.Tensor, rows_per_pass: int,
                on_logits: Callable[[int, torch.Tensor], None]) -> None:
    """Layer-major forward without a cache (exllamav2's -sl): every row through module 0, then module 1, ...;
    `rows_per_pass` rows at a time on the device, the hidden states of all rows kept in host memory between
    modules. Calls on_logits(first_row, float32 logits [rows, T, vocab]) for each pass of the head."""
    loader: ModuleLoader | None = getattr(model, "stream", None)
    if loader is None:
        raise ModelStateError("stream_rows needs a model loaded for layer streaming: model.load(lazy=True)")
    if rows_per_pass < 1:
        raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
    n, t = ids.shape
    groups = [(a, min(a + rows_per_pass, n)) for a in range(0, n, rows_per_pass)]
    states: list[torch.Tensor] = [ids[a:b] for a, b in groups]
    side: dict[int, dict[int, torch.Tensor]] = {}  # parallel blocks: the attention's normed input, per pass
    last = len(model.modules) - 1
    try:
        with torch.inference_mode():
            for i in range(len(model.modules)):
                module = loader.acquire(i)
                if i < last:
                    loader.prefetch(i + 1)
                dev = loader.devices[i]
                for g, (a, b) in enumerate(groups):
                    batch = contiguous_batch(b - a, t, 0, None, 0, dev)
                    batch.block_inputs.update({k: v.to(dev) for k, v in side.pop(g, {}).items()})
                    y = run_module(module, states[g].to(dev), batch)
                    if batch.block_inputs:
                        side[g] = {k: v.cpu() for k, v in batch.block_inputs.items()}
                    if i == last:
                        on_logits(a, y)
                    else:
                        states[g] = y.cpu()
                loader.release(i)
    finally:
        loader.release_all()


def execute_layer_major(model: Any, chunks: list[torch.Tensor], batches: list[ForwardBatch]
                        ) -> list[torch.Tensor | None]:
    """The chunks of one long forward through a cache, layer-major: module i runs over every chunk before
    module i + 1 is loaded, so each module is read once. Chunk c of a layer reads the cache rows that chunks
    before it wrote for that layer, as in the usual chunk-by-chunk order. Returns each chunk's output (None
    for chunks that want no logits)."""
    loader: ModuleLoader = model.stream
    core = Transformer(model.modules)  # its step(): the pass's rules around each module
    xs: list[torch.Tensor | None] = list(chunks)
    n = len(model.modules)
    with contextlib.ExitStack() as scopes:
        for b in batches:
            if b.cache is not None:
                scopes.enter_context(b.cache.forward_scope(b))
        try:
            def wanted(i: int) -> list[int]:  # the chunks module i runs on (a prefill's end after the last attention)
                return [k for k, x in enumerate(xs) if x is not None and i < n and
                        not (i > core.last_attn and batches[k].logits == LOGITS_NONE)]

            for i in range(n):
                live = wanted(i)
                xs = [x if k in live else None for k, x in enumerate(xs)]
                if not live:
                    break
                loader.acquire(i)
                if wanted(i + 1):
                    loader.prefetch(i + 1)
                dev = loader.devices[i]
                for k in live:
                    b = batches[k].on(dev)
                    xs[k] = drive(core.step(i, safe_move_tensor(xs[k], dev), b))
                    if b is not batches[k] and b.last_state is not None:
                        batches[k].last_state = b.last_state
                loader.release(i)
        finally:
            loader.release_all()
    return xs
