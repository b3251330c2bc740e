"""`ExLlamaV2`: the module list, loading entry points and the forward pass."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Generator
from typing import Any

import torch

from exlpy.cache.base import ExLlamaV2CacheBase
from exlpy.config.config import ExLlamaV2Config
from exlpy.env import oom_guard
from exlpy.errors import CacheTooSmallError, ModelStateError, SequenceLengthError
from exlpy.model.batch import ForwardBatch, contiguous_batch
from exlpy.model.layers import MLP, Attention, Embedding, Head, RMSNorm, RotaryTables
from exlpy.model.module import Module
from exlpy.model.validate import check_forward, check_load_device
from exlpy.parallel.p2p import safe_move_tensor
from exlpy.weights.checks import module_checks


class ExLlamaV2:
    """The model: its module list (embedding, attention/MLP per layer, final norm, head), where each module
    is loaded, and the forward pass. Nothing is loaded until one of the load methods runs."""

    def __init__(self, config: ExLlamaV2Config, lazy_load: bool = False) -> None:
        config.prepare()
        config.check_settings()
        self.config = config
        self.rotary = RotaryTables(config)
        self.modules: list[Module] = [Embedding(config)]
        for i in range(config.num_hidden_layers):
            self.modules += [Attention(config, i, self.rotary), MLP(config, i)]
        self.modules += [RMSNorm(config), Head(config)]
        self.modules_dict = {m.key: m for m in self.modules}
        self.last_kv_layer_idx = len(self.modules) - 4  # the last attention module
        self.head_layer_idx = len(self.modules) - 1
        self.cache_map: dict[int, torch.device] = {}
        self.loaded = False
        self.tp_context: Any = None
        self._caches: list[weakref.ref[ExLlamaV2CacheBase]] = []
        self._graphs: Any = None
        self.placement_plan: Any = None  # the exlpy.parallel.plan.Plan the last load() / load_autosplit() followed

    # --- caches ---------------------------------------------------------------------------------------------
    def attach_cache(self, cache: ExLlamaV2CacheBase) -> None:
        self._caches = [r for r in self._caches if r() is not None] + [weakref.ref(cache)]

    def attention_modules(self) -> list[Attention]:
        return [m for m in self.modules if isinstance(m, Attention)]

    # --- loading --------------------------------------------------------------------------------------------
    def _check_not_loaded(self) -> None:
        if self.loaded:
            raise ModelStateError("model is already loaded; call model.unload() before loading again")
        self.config.check_settings()

    def load(self, gpu_split: list[float] | None = None, lazy: bool = False, stats: bool = False,
             callback: Callable[[int, int], None] | None = None,
             callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False,
             device: str | torch.device | None = None) -> None:
        """Load by explicit GB budgets per GPU (None: everything on GPU 0, or the CPU without a GPU).

        `device` (an exlpy extension) puts every module on that one device, e.g. "cpu" for a reference run.
        """
        for _ in self.load_gen(gpu_split, lazy, stats, callback, callback_gen, progress, device):
            pass

    def load_gen(self, gpu_split: list[float] | None = None, lazy: bool = False, stats: bool = False,
                 callback: Callable[[int, int], None] | None = None,
                 callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False,
                 device: str | torch.device | None = None) -> Generator[Any, None, None]:
        from exlpy.parallel.placement import load_split_gen

        self._check_not_loaded()
        if device is not None:
            for i in range(len(self.modules)):
                self.place_module(i, check_load_device(device))
            self.loaded = True
            return
        yield from load_split_gen(self, gpu_split, callback, callback_gen, progress, lazy=lazy)

    def load_autosplit(self, cache: ExLlamaV2CacheBase, reserve_vram: int | list[int] | None = None,
                       last_id_only: bool = False, callback: Callable[[int, int], None] | None = None,
                       callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False) -> None:
        for _ in self.load_autosplit_gen(cache, reserve_vram, last_id_only, callback, callback_gen, progress):
            pass

    def load_autosplit_gen(self, cache: ExLlamaV2CacheBase, reserve_vram: int | list[int] | None = None,
                           last_id_only: bool = False, callback: Callable[[int, int], None] | None = None,
                           callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False
                           ) -> Generator[Any, None, None]:
        from exlpy.parallel.placement import load_autosplit_gen

        self._check_not_loaded()
        yield from load_autosplit_gen(self, cache, reserve_vram, last_id_only, callback, callback_gen, progress)

    def load_tp(self, gpu_split: list[float] | None = None, callback: Callable[[int, int], None] | None = None,
                callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False,
                expect_cache_tokens: int = 0, expect_cache_base: type | None = None) -> None:
        for _ in self.load_tp_gen(gpu_split, callback, callback_gen, progress, expect_cache_tokens,
                                  expect_cache_base):
            pass

    def load_tp_gen(self, gpu_split: list[float] | None = None, callback: Callable[[int, int], None] | None = None,
                    callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False,
                    expect_cache_tokens: int = 0, expect_cache_base: type | None = None
                    ) -> Generator[Any, None, None]:
        from exlpy.parallel.tp_load import load_tp_gen

        self._check_not_loaded()
        yield from load_tp_gen(self, gpu_split, callback, callback_gen, progress, expect_cache_tokens,
                               expect_cache_base)

    def place_module(self, idx: int, device: torch.device) -> None:
        """Load module `idx` on `device`; attention layers also get their cache tensors there."""
        m = self.modules[idx]
        self._graphs = None  # captured graphs hold weight and cache addresses
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(), module_checks():
            m.load(device)
        if isinstance(m, Attention):
            self.cache_map[m.layer_idx] = device
            for ref in self._caches:
                c = ref()
                if c is not None:
                    c.update_cache_tensors()

    def unplace_module(self, idx: int) -> None:
        m = self.modules[idx]
        self._graphs = None
        m.unload()
        if isinstance(m, Attention):
            self.cache_map.pop(m.layer_idx, None)
            for ref in self._caches:
                c = ref()
                if c is not None and c.fixed_device is None:
                    c.free_layer(m.layer_idx)

    def unload(self) -> None:
        for i in range(len(self.modules)):
            self.unplace_module(i)
        if self.tp_context is not None:
            self.tp_context.unload()
            self.config.no_graphs = self.tp_context.saved_no_graphs
            self.tp_context = None
        self.rotary.clear()
        self._graphs = None
        self.placement_plan = None  # it described devices the modules no longer occupy
        self.loaded = False

    def devices(self) -> list[torch.device]:
        seen: list[torch.device] = []
        for m in self.modules:
            if m.device is not None and m.device not in seen:
                seen.append(m.device)
        return seen

    # --- forward --------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: ExLlamaV2CacheBase | None = None, *args: Any,
                **kwargs: Any) -> Any:
        """Logits [batch, seq, vocab] (float32) for `input_ids` [batch, seq], continuing `cache` if given.

        Same arguments as exllamav2: input_mask, preprocess_only, last_id_only, loras, return_last_state,
        position_offsets, abort_event, cpu_logits. An out-of-memory becomes InsufficientVRAMError saying what to
        reduce.
        """
        with oom_guard("the forward pass"):
            return self._forward(input_ids, cache, *args, **kwargs)

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, cache: ExLlamaV2CacheBase | None = None,
                input_mask: torch.Tensor | None = None, preprocess_only: bool = False, last_id_only: bool = False,
                loras: Any = None, return_last_state: bool = False, position_offsets: torch.Tensor | None = None,
                abort_event: Any = None, cpu_logits: bool = False, **kwargs: Any) -> Any:
        if not self.loaded:
            raise ModelStateError("model is not loaded: call load(), load_autosplit() or load_tp() first")
        if loras:
            raise ModelStateError("LoRA adapters are not supported by exlpy yet")
        input_ids = check_forward(self, input_ids, cache)
        B, T = input_ids.shape
        cfg = self.config
        dev = self.modules[0].device
        assert dev is not None
        if cache is not None:
            past = cache.current_seq_len
            if B > cache.batch_size:
                raise CacheTooSmallError(f"batch size {B} exceeds the cache's batch_size {cache.batch_size}")
            if past + T > cache.max_seq_len:
                raise CacheTooSmallError(f"Total sequence length exceeds cache size in model.forward: {past} "
                                         f"cached + {T} new tokens > cache max_seq_len {cache.max_seq_len}")
            if (T == 1 and input_mask is None and position_offsets is None
                    and not (preprocess_only or return_last_state)):
                tp_graphs = getattr(self.tp_context, "graphs", None)
                if tp_graphs is not None:
                    logits = tp_graphs.decode(input_ids, cache, past)
                    if logits is not None:
                        cache.current_seq_len = past + 1
                        return logits.cpu() if cpu_logits else logits
                graphs = self._graph_runner(cache)
                if graphs is not None:
                    # The decode step as one CUDA-graph replay: it copies the ids straight into its static
                    # input and derives positions and slots on the device, so none of the per-step tensors
                    # below are built.
                    logits = graphs.decode_contiguous(input_ids, cache, past)
                    cache.current_seq_len = past + 1
                    return logits.cpu() if cpu_logits else logits
        ids = input_ids.to(dev, dtype=torch.long)
        key_mask = _key_mask(input_mask, dev)
        offsets = position_offsets.to(dev).view(-1, 1) if position_offsets is not None else None

        if cache is None:
            limit = cfg.max_input_len * cfg.max_batch_size // B
            if T > limit:
                raise SequenceLengthError(f"Maximum input length exceeded in model.forward: {T} tokens > "
                                          f"{limit} (max_input_len * max_batch_size // batch); pass a cache "
                                          "to process long inputs in chunks")
            batch = contiguous_batch(B, T, 0, None, 0, dev, key_mask)
            batch.rope_positions = _offset(batch.positions, offsets)
            return self._run(ids, batch, preprocess_only, last_id_only, return_last_state, cpu_logits)

        outputs: list[torch.Tensor] = []
        last_state = None
        pos = 0
        while pos < T:
            # Chunks bound activation memory: max_input_len tokens, and past*q within max_attention_size.
            cur = past + pos
            att = int((math.sqrt(cur * cur + 4 * cfg.max_attention_size) - cur) / 2)
            n = max(1, min(T - pos, cfg.max_input_len, att))
            last = pos + n >= T
            batch = contiguous_batch(B, n, cur, cache, cache.max_seq_len, dev, key_mask)
            batch.rope_positions = _offset(batch.positions, offsets)
            r = self._run(ids[:, pos:pos + n], batch, preprocess_only or not last and last_id_only,
                          last_id_only, return_last_state, cpu_logits)
            if return_last_state and r is not None:
                r, last_state = r
            if r is not None:
                outputs.append(r)
            pos += n
        cache.current_seq_len = past + T  # only once every chunk ran: a failed forward leaves the cache as it was
        if preprocess_only:
            return None
        logits = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return (logits, last_state) if return_last_state else logits

    def forward_batch(self, input_ids: torch.Tensor, batch: ForwardBatch, last_id_only: bool = False,
                      preprocess_only: bool = False) -> torch.Tensor | None:
        """Forward with caller-built metadata (paged caches, per-row positions): the generators' entry."""
        dev = self.modules[0].device
        ids, batch = input_ids.to(dev), batch.on(dev)
        if batch.q_len == 1 and batch.key_mask is None and batch.cache is not None and not preprocess_only:
            graphs = self._graph_runner(batch.cache)
            logits = graphs.decode_paged(ids, batch) if graphs is not None else None
            if logits is not None:
                return logits
        return self._run(ids, batch, preprocess_only, last_id_only, False, False)

    def _graph_runner(self, cache: Any = None) -> Any:
        """The CUDA-graph decode runner, or None where graphs do not apply (CPU, split models, no_graphs,
        quantized caches)."""
        from exlpy.model.graphs import DecodeGraphs, cache_is_direct, graphs_supported

        if cache is not None and not cache_is_direct(cache):
            return None
        if self._graphs is None and graphs_supported(self):
            self._graphs = DecodeGraphs(self)
        return self._graphs if self._graphs is not None and not self.config.no_graphs else None

    def _run(self, ids: torch.Tensor, batch: ForwardBatch, preprocess_only: bool, last_id_only: bool,
             return_last_state: bool, cpu_logits: bool) -> Any:
        if self.tp_context is not None:
            from exlpy.parallel.tp_load import tp_run

            return tp_run(self, ids, batch, preprocess_only, last_id_only, return_last_state, cpu_logits)
        cache = batch.cache
        if cache is None:
            return self._run_modules(ids, batch, preprocess_only, last_id_only, return_last_state, cpu_logits)
        cache.begin_forward(batch)  # type: ignore[attr-defined]
        try:
            return self._run_modules(ids, batch, preprocess_only, last_id_only, return_last_state, cpu_logits)
        finally:
            cache.end_forward()  # type: ignore[attr-defined]

    def _run_modules(self, ids: torch.Tensor, batch: ForwardBatch, preprocess_only: bool, last_id_only: bool,
                     return_last_state: bool, cpu_logits: bool) -> Any:
        x = ids
        last_state = None
        with contextlib.ExitStack() as device_scope:
            current: torch.device | None = None
            for i, m in enumerate(self.modules):
                if preprocess_only and i > self.last_kv_layer_idx:
                    return None
                assert m.device is not None
                if m.device != current:
                    # Kernels (Triton's above all) launch on the *current* CUDA device and its stream: make it
                    # the module's own, or a split model's layers would run on GPU 0 reading peer memory.
                    current = m.device
                    if current.type == "cuda":
                        device_scope.enter_context(torch.cuda.device(current))
                if x.device != m.device:
                    x = safe_move_tensor(x, m.device)  # the one place where the hidden state hops between devices
                if i == self.head_layer_idx - 1 and last_id_only:
                    x = x[:, -1:]
                if i == self.head_layer_idx and return_last_state:
                    last_state = x
                if i == self.head_layer_idx:
                    x = self._run_head(m, x, batch.on(m.device))
                else:
                    x = m.forward(x, batch.on(m.device))
        logits = x.float()
        if cpu_logits:
            logits = logits.cpu()
        return (logits, last_state) if return_last_state else logits


    def _run_segment(self, x: torch.Tensor, batch: ForwardBatch, start: int, stop: int) -> torch.Tensor:
        """Modules [start, stop), all on one device that is already current (the decode graphs' unit): no
        hops, no slicing; the caller hands over ids or the previous segment's hidden state."""
        for i in range(start, stop):
            m = self.modules[i]
            x = self._run_head(m, x, batch) if i == self.head_layer_idx else m.forward(x, batch)
        return x

    def _run_head(self, head: Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The head over at most `config.max_output_len` positions at a time (exllamav2's bound on the head's
        working memory), joined into the logits of every position."""
        n = self.config.max_output_len
        if not n or x.shape[1] <= n:
            return head.forward(x, batch)
        # Each slice leaves as float32 (what the caller gets anyway), so no full-width half-precision copy.
        return torch.cat([head.forward(x[:, a:a + n], batch).float() for a in range(0, x.shape[1], n)], dim=1)


def _key_mask(input_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Accept a bool mask (True = real token) or an additive one (0 = keep, -inf = pad), [B, L]."""
    if input_mask is None:
        return None
    m = input_mask.to(device)
    if m.dim() > 2:
        m = m.reshape(m.shape[0], -1)[:, -m.shape[-1]:]
    return m if m.dtype == torch.bool else m > -1.0


def _offset(positions: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor | None:
    return None if offsets is None else (positions + offsets).clamp(min=0)
