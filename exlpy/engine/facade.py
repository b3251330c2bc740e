"""`ExLlamaV2`: exllamav2's model object. It owns the module list and the layer -> device map caches follow,
and holds whichever execution strategy the last load produced (one GPU, a layer split, tensor parallel)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch

from exlpy.cache.layout import CacheLayout, LayerDevices
from exlpy.config.config import ExLlamaV2Config
from exlpy.engine import forward as fwd
from exlpy.engine.compat_api import ModelCompatMixin
from exlpy.engine.split import layer_split
from exlpy.engine.strategy import Strategy
from exlpy.env import oom_guard
from exlpy.errors import ModelStateError
from exlpy.model.attention import Attention
from exlpy.model.batch import ForwardBatch
from exlpy.model.rotary import RotaryTables
from exlpy.model.transformer import Transformer, build_modules
from exlpy.model.validate import check_load_device
from exlpy.runtime import RuntimeOptions, options
from exlpy.weights.checks import module_checks


class ExLlamaV2(ModelCompatMixin):
    """The model: its module list (embedding, attention/MLP per layer, final norm, head), where each module
    is loaded, and the forward pass. Nothing is loaded until one of the load methods runs."""

    def __init__(self, config: ExLlamaV2Config, lazy_load: bool = False) -> None:
        config.prepare()
        config.check_settings()
        self.config = config
        self.options: RuntimeOptions = options()
        self.rotary = RotaryTables(config)
        self.modules = build_modules(config, self.rotary)
        self.modules_dict = {m.key: m for m in self.modules}
        self.last_kv_layer_idx = len(self.modules) - 4  # the last attention module
        self.head_layer_idx = len(self.modules) - 1
        self.layer_devices = LayerDevices()  # what lazy caches allocate by
        self.loaded = False
        self.tp_context: Any = None  # the TPContext of a load_tp() model (exllamav2 exposes it)
        self.placement_plan: Any = None  # the exlpy.parallel.plan.Plan the last load() / load_autosplit() followed
        self.strategy: Strategy | None = None
        self.stream: Any = None  # load(lazy=True): the ModuleLoader of layer streaming (engine/streaming.py)

    # --- what caches are built from ---------------------------------------------------------------------------
    def cache_layout(self) -> CacheLayout:
        c = self.config
        ctx = self.tp_context
        slots = None if ctx is None else tuple((ctx.all_devs[s], b - a) for s, a, b in ctx.kv_split)
        return CacheLayout(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.max_seq_len, c.compute_dtype,
                           self.layer_devices, slots, None if ctx is None else ctx.expect_cache_base)

    @property
    def cache_map(self) -> dict[int, torch.device]:
        return self.layer_devices.as_dict()

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
        `lazy=True` (layer streaming) only assigns the devices: each module is then loaded just before it runs
        and freed after, so a model larger than GPU memory runs (engine/streaming.py).
        """
        for _ in self.load_gen(gpu_split, lazy, stats, callback, callback_gen, progress, device):
            pass

    def load_gen(self, gpu_split: list[float] | None = None, lazy: bool = False, stats: bool = False,
                 callback: Callable[[int, int], None] | None = None,
                 callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False,
                 device: str | torch.device | None = None) -> Generator[Any, None, None]:
        from exlpy.engine.placement import load_split_gen

        self._check_not_loaded()
        if device is not None:
            dev = check_load_device(device)
            if lazy:
                from exlpy.engine.streaming import assign_devices

                assign_devices(self, [dev] * len(self.modules))
            else:
                for i in range(len(self.modules)):
                    self.place_module(i, dev)
            self.finish_load(None)
            return
        yield from load_split_gen(self, gpu_split, callback, callback_gen, progress, lazy=lazy)

    def load_autosplit(self, cache: Any, reserve_vram: int | list[int] | None = None,
                       last_id_only: bool = False, callback: Callable[[int, int], None] | None = None,
                       callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False) -> None:
        for _ in self.load_autosplit_gen(cache, reserve_vram, last_id_only, callback, callback_gen, progress):
            pass

    def load_autosplit_gen(self, cache: Any, reserve_vram: int | list[int] | None = None,
                           last_id_only: bool = False, callback: Callable[[int, int], None] | None = None,
                           callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False
                           ) -> Generator[Any, None, None]:
        from exlpy.engine.placement import load_autosplit_gen

        self._check_not_loaded()
        yield from load_autosplit_gen(self, cache, reserve_vram, last_id_only, callback, callback_gen, progress)

    def load_tp(self, gpu_split: list[float] | None = None, callback: Callable[[int, int], None] | None = None,
                callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False,
                expect_cache_tokens: int = 0, expect_cache_base: type | None = None,
                devices: list[torch.device | str] | None = None, options: RuntimeOptions | None = None) -> None:
        """exllamav2's tensor-parallel load. exlpy extensions: `devices` (explicit slot devices; several may be
        the same CPU device, as the tests do) and `options` (runtime options for this model)."""
        for _ in self.load_tp_gen(gpu_split, callback, callback_gen, progress, expect_cache_tokens,
                                  expect_cache_base, devices, options):
            pass

    def load_tp_gen(self, gpu_split: list[float] | None = None, callback: Callable[[int, int], None] | None = None,
                    callback_gen: Callable[[int, int], Any] | None = None, progress: bool = False,
                    expect_cache_tokens: int = 0, expect_cache_base: type | None = None,
                    devices: list[torch.device | str] | None = None, options: RuntimeOptions | None = None
                    ) -> Generator[Any, None, None]:
        from exlpy.engine.tensor_parallel import load_tp_gen

        self._check_not_loaded()
        ctx, strategy = yield from load_tp_gen(self, gpu_split, callback, callback_gen, progress,
                                               expect_cache_tokens, expect_cache_base, devices, options)
        self.tp_context, self.strategy, self.loaded = ctx, strategy, True

    def place_module(self, idx: int, device: torch.device) -> None:
        """Load module `idx` on `device`; attention layers also get their cache layers there."""
        if self.tp_context is not None:
            raise ModelStateError("place_module: the model is loaded tensor-parallel; unload() it first")
        m = self.modules[idx]
        self.strategy = None  # its captured graphs hold weight and cache addresses
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(), module_checks():
            m.load(device)
        if isinstance(m, Attention):
            self.layer_devices.assign(m.layer_idx, device)

    def unplace_module(self, idx: int) -> None:
        m = self.modules[idx]
        self.strategy = None
        m.unload()
        if isinstance(m, Attention):
            self.layer_devices.release(m.layer_idx)

    def finish_load(self, plan: Any) -> None:
        self.loaded = True
        self.placement_plan = plan

    def unload(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        for i in range(len(self.modules)):
            self.unplace_module(i)
        if self.tp_context is not None:
            self.tp_context.unload()
            self.tp_context = None
        self.rotary.clear()
        self.strategy = None
        self.placement_plan = None  # it described devices the modules no longer occupy
        self.loaded = False

    def devices(self) -> list[torch.device]:
        if self.tp_context is not None and self.strategy is not None:
            return self.strategy.devices
        seen: list[torch.device] = []
        for d in self.stream.devices if self.stream is not None else [m.device for m in self.modules]:
            if d is not None and d not in seen:
                seen.append(d)
        return seen

    def strategy_for_forward(self) -> Strategy:
        """The loaded strategy (built on first use after modules were placed)."""
        if not self.loaded:
            raise ModelStateError("model is not loaded: call load(), load_autosplit() or load_tp() first")
        if self.strategy is None and self.stream is not None:
            from exlpy.engine.streaming import streaming_strategy

            self.strategy = streaming_strategy(self)
        if self.strategy is None:
            if any(m.device is None for m in self.modules):
                raise ModelStateError("model is marked loaded but some modules are not placed on a device")
            self.strategy = layer_split(Transformer(self.modules))
        return self.strategy

    # --- forward --------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Logits [batch, seq, vocab] (float32) for `input_ids` [batch, seq], continuing `cache` if given.

        exllamav2's arguments, in its order: input_mask, preprocess_only, last_id_only, loras, return_last_state,
        position_offsets, abort_event, cpu_logits (engine/forward.py). An out-of-memory becomes
        InsufficientVRAMError saying what to reduce.
        """
        if args or isinstance(cache, (list, tuple)) or not self.FORWARD_KWARGS.issuperset(kwargs):
            # positional options, one cache per row, or keywords to reject by name (compat_api.py)
            return self.forward_compat(input_ids, cache, *args, **kwargs)
        with oom_guard("the forward pass"), torch.inference_mode():
            return fwd.forward(self, input_ids, cache, **kwargs)

    def forward_batch(self, input_ids: torch.Tensor, batch: ForwardBatch, last_id_only: bool = False,
                      preprocess_only: bool = False) -> torch.Tensor | None:
        """Forward with caller-built metadata (exlpy.model.batch.build_batch): the generators' entry."""
        with oom_guard("the forward pass"), torch.inference_mode():
            return fwd.forward_batch(self, input_ids, batch, last_id_only, preprocess_only)

    def chunk_buckets(self) -> tuple[int, ...]:
        """Token counts of the prompt chunks `prefill_chunk` runs captured (empty: none; see engine/graphs.py)."""
        return fwd.chunk_buckets(self)

    def prefill_chunk(self, input_ids: torch.Tensor, batch: ForwardBatch) -> None:
        """A prompt chunk of one sequence (no logits) as a captured chunk where one applies, else eagerly."""
        with oom_guard("the forward pass"), torch.inference_mode():
            if not fwd.prefill_chunk(self, input_ids, batch):
                fwd.forward_batch(self, input_ids, batch, preprocess_only=True)
