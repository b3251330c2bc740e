"""The rest of exllamav2's public `ExLlamaV2` methods, as a mixin of the model class.

`ExLlamaV2` itself holds loading and the forward pass; this mixin adds what exllamav2 scripts call beside
them: `forward()` with a list of caches (one per row), `forward_chunk()`, `is_quant()`, `get_modules()`,
the cache-map helpers, and the methods of features exlpy lacks (LoRA, exllamav2's device contexts), which
raise NotSupportedError. It also rejects unknown keyword arguments to `forward()` by name.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from exlpy.errors import CacheError, NotSupportedError, UnknownArgumentError

if TYPE_CHECKING:
    from exlpy.cache.base import ExLlamaV2CacheBase
    from exlpy.config.config import ExLlamaV2Config
    from exlpy.model.module import Module

# forward()'s arguments after (input_ids, cache), in exllamav2's positional order.
FORWARD_ARGS = ("input_mask", "preprocess_only", "last_id_only", "loras", "return_last_state", "position_offsets",
                "abort_event", "cpu_logits")
# Keywords exllamav2's forward passes to its modules, for features exlpy does not have.
UNSUPPORTED_FORWARD_ARGS = {
    "attn_params": "exllamav2's attention parameter objects (attn_params) are internal to exllamav2; exlpy's "
                   "generators build their own batches (ExLlamaV2.forward_batch)",
    "alt_rope_embedding": "alternative RoPE tables per call (alt_rope_embedding) are not supported by exlpy",
}


class ModelCompatMixin:
    """exllamav2 `ExLlamaV2` methods beyond loading and the forward pass itself."""

    FORWARD_KWARGS = frozenset(FORWARD_ARGS) | {"indexed_embeddings"}  # keyword only, as exllamav2 passes it

    config: ExLlamaV2Config
    modules: list[Module]
    cache_map: dict[int, torch.device]
    layer_devices: Any

    if TYPE_CHECKING:
        def forward(self, input_ids: torch.Tensor, cache: Any = None, *args: Any, **kwargs: Any) -> Any: ...

    # `loaded` is a property so that the config learns when its RoPE settings are in use (the tables are built
    # for the load): ExLlamaV2Config refuses RoPE changes while a model built on it is loaded.
    @property
    def loaded(self) -> bool:
        return bool(self.__dict__.get("_loaded", False))

    @loaded.setter
    def loaded(self, value: bool) -> None:
        self.__dict__["_loaded"] = bool(value)
        users = getattr(self.__dict__.get("config"), "_loaded_models", None)
        if users is not None:
            (users.add if value else users.discard)(self)

    # --- forward variants ------------------------------------------------------------------------------------
    def forward_compat(self, input_ids: torch.Tensor, cache: Any, *args: Any, **kwargs: Any) -> Any:
        """forward() for what its fast path does not take: unknown keywords (rejected by name) and a list of
        caches, one per input row (exllamav2's multi-cache batch)."""
        if len(args) > len(FORWARD_ARGS):
            raise UnknownArgumentError(f"ExLlamaV2.forward() takes at most {2 + len(FORWARD_ARGS)} positional "
                                       f"arguments, got {2 + len(args)}")
        for name, value in zip(FORWARD_ARGS, args):
            if name in kwargs:
                raise UnknownArgumentError(f"ExLlamaV2.forward() got multiple values for argument '{name}'")
            kwargs[name] = value
        for name in kwargs:
            if name in UNSUPPORTED_FORWARD_ARGS:
                raise NotSupportedError(f"ExLlamaV2.forward(): {UNSUPPORTED_FORWARD_ARGS[name]}")
            if name not in self.FORWARD_KWARGS:
                raise UnknownArgumentError(f"ExLlamaV2.forward() got an unexpected keyword argument '{name}' "
                                           f"(it takes: {', '.join(FORWARD_ARGS)})")
        if isinstance(cache, (list, tuple)):
            return self._forward_per_cache(input_ids, list(cache), **kwargs)
        return self.forward(input_ids, cache, **kwargs)

    def _forward_per_cache(self, input_ids: torch.Tensor, caches: list[ExLlamaV2CacheBase], input_mask: Any = None,
                           preprocess_only: bool = False, last_id_only: bool = False, loras: Any = None,
                           return_last_state: bool = False, position_offsets: torch.Tensor | None = None,
                           abort_event: threading.Event | None = None, cpu_logits: bool = False) -> Any:
        """Row b continues caches[b] (at that cache's own current_seq_len). Each row runs through the model on
        its own: the caches are separate tensors, so one batched pass would first have to copy them together."""
        from exlpy.cache.base import ExLlamaV2CacheBase

        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if len(caches) != input_ids.shape[0]:
            raise CacheError(f"ExLlamaV2.forward() got {len(caches)} caches for {input_ids.shape[0]} input rows: a "
                             "list of caches needs exactly one cache per row")
        for i, c in enumerate(caches):
            if not isinstance(c, ExLlamaV2CacheBase):
                raise CacheError(f"ExLlamaV2.forward(): cache list item {i} is a {type(c).__name__}, not an "
                                 "ExLlamaV2 cache")
        if len({id(c) for c in caches}) != len(caches):
            raise CacheError("ExLlamaV2.forward(): the same cache appears twice in the cache list; each row needs "
                             "its own cache")
        logits, states = [], []
        for b, c in enumerate(caches):
            if abort_event is not None and abort_event.is_set():
                return None  # as exllamav2: an aborted forward returns None
            r = self.forward(input_ids[b:b + 1], c, input_mask=_row(input_mask, b), preprocess_only=preprocess_only,
                             last_id_only=last_id_only, loras=loras, return_last_state=return_last_state,
                             position_offsets=_row(position_offsets, b), abort_event=abort_event,
                             cpu_logits=cpu_logits)
            if return_last_state and r is not None:
                r, state = r
                states.append(state)
            logits.append(r)
        if preprocess_only:
            return None
        out = torch.cat(logits, dim=0)
        return (out, torch.cat(states, dim=0)) if return_last_state else out

    def forward_chunk(self, input_ids: torch.Tensor, cache: Any = None, input_mask: Any = None,
                      preprocess_only: bool = False, last_id_only: bool = False, loras: Any = None,
                      return_last_state: bool = False, position_offsets: torch.Tensor | None = None,
                      abort_event: threading.Event | None = None, attn_params: Any = None,
                      extract_state_indices: list[int] | None = None) -> dict[str, Any] | None:
        """One forward pass returning exllamav2's result dict: {"logits"} (absent with preprocess_only), plus
        {"last_state"} with return_last_state."""
        if attn_params is not None:
            raise NotSupportedError(f"ExLlamaV2.forward_chunk(): {UNSUPPORTED_FORWARD_ARGS['attn_params']}")
        if extract_state_indices:
            raise NotSupportedError("ExLlamaV2.forward_chunk(extract_state_indices=...) is not supported by exlpy; "
                                    "return_last_state=True gives the state before the head")
        r = self.forward(input_ids, cache, input_mask=input_mask, preprocess_only=preprocess_only,
                         last_id_only=last_id_only, loras=loras, return_last_state=return_last_state,
                         position_offsets=position_offsets, abort_event=abort_event)
        if abort_event is not None and abort_event.is_set():
            return None
        out: dict[str, Any] = {}
        if return_last_state and r is not None:
            r, out["last_state"] = r
        if r is not None:
            out["logits"] = r
        return out

    # --- inspection ------------------------------------------------------------------------------------------
    def get_modules(self) -> list[Module]:
        """The module list (embedding, attention and MLP per layer, final norm, head), as a new list."""
        return list(self.modules)

    def is_quant(self) -> bool:
        """Whether the attention layers are quantized (EXL2 or GPTQ); read from the weight files, so it also
        answers before loading."""
        from exlpy.model.linear import linear_format

        cfg = self.config
        assert cfg.index is not None
        return any(linear_format(cfg.index, f"model.layers.{i}.self_attn.q_proj") != "dense"
                   for i in range(cfg.num_hidden_layers))

    def set_cache_map(self) -> None:
        """Rebuild `cache_map` (layer -> device of its attention module) from where the modules are loaded."""
        for m in self.modules:
            layer, device = getattr(m, "layer_idx", None), m.device
            if layer is not None and device is not None and hasattr(m, "num_kv_heads"):
                self.layer_devices.assign(layer, device)

    def get_cache_devices(self) -> list[torch.device]:
        """The devices holding attention layers (where cache tensors live)."""
        return list(dict.fromkeys(self.cache_map.values()))

    def update_loras(self) -> None:
        """Nothing to do: adapters are applied per call (per row) from their slots (exlpy/lora/)."""

    # --- features exlpy does not have ------------------------------------------------------------------------
    def set_device_map(self, allocation: list[float], embed_cpu: bool = True) -> list[float]:
        """exllamav2's placement by GB budgets, without loading: plans every module as `load(gpu_split=
        allocation)` would (weights from the safetensors headers, cache and scratch for config.max_seq_len and
        max_batch_size), keeps the plan in `self.device_map_plan`, and returns the unused GB per device. An
        allocation too small raises InsufficientVRAMError. Works without a GPU (planning reads no tensor data);
        `embed_cpu` is accepted: exlpy's planner places the embedding as load() will."""
        import torch

        from exlpy.engine.placement import parse_gpu_split, plan_for_model
        from exlpy.parallel.costs import CacheSpec
        from exlpy.parallel.plan import DeviceBudget

        count = torch.cuda.device_count() if torch.cuda.is_available() else len(allocation)
        budgets = parse_gpu_split(allocation, count)
        plan = plan_for_model(self, [DeviceBudget(b) for b in budgets], torch.device("cuda", 0),
                              max_seq_len=self.config.max_seq_len, batch_size=self.config.max_batch_size,
                              cache=CacheSpec("none", 0.0, 0.0), layer_cache=None, policy="greedy")
        self.device_map_plan = plan
        return [max(0, u.free - u.total) / 1024**3 for u in plan.usage]

    def create_device_context(self, scratch_bytes: list[int]) -> None:
        raise NotSupportedError(_NO_DEVICE_CONTEXT)

    def drop_device_context(self) -> None:
        raise NotSupportedError(_NO_DEVICE_CONTEXT)

    def free_device_context(self) -> None:
        raise NotSupportedError(_NO_DEVICE_CONTEXT)

    def get_device_context(self, device_idx: int, scratch: bool = True) -> None:
        raise NotSupportedError(_NO_DEVICE_CONTEXT)


_NO_DEVICE_CONTEXT = ("exllamav2's per-device contexts (scratch buffers, RoPE tables, streams) do not exist in exlpy: "
                      "its kernels take scratch from torch's allocator per call")


def _row(t: Any, b: int) -> Any:
    """Row b of a per-row tensor argument (mask, offsets), kept 2-D or more; None stays None."""
    return None if t is None else t[b:b + 1]
