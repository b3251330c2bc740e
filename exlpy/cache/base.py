"""KV caches with exllamav2's interface: per-layer K/V tensors [batch, max_seq_len, Hkv, D], lazy allocation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from exlpy.cache.checks import check_cache_args
from exlpy.cache.layout import CacheLayout
from exlpy.errors import ModelStateError


def layout_of(model_or_layout: Any) -> CacheLayout:
    """exllamav2 builds caches from the model; exlpy only asks it for the layout (shapes and devices)."""
    if isinstance(model_or_layout, CacheLayout):
        return model_or_layout
    get = getattr(model_or_layout, "cache_layout", None)
    if get is None:
        raise ModelStateError(f"a cache is built from an ExLlamaV2 model (or a CacheLayout), got "
                              f"{type(model_or_layout).__name__}")
    return get()


class ExLlamaV2CacheBase:
    """Common machinery. Subclasses choose the storage (bytes per element)."""

    bytes_per_element_k: float = 2.0
    bytes_per_element_v: float = 2.0
    graph_safe = True  # K/V are read in place, so a captured decode step can address them

    def __init__(self, model: Any, batch_size: int = 1, max_seq_len: int = -1,
                 copy_from: ExLlamaV2CacheBase | None = None, lazy: bool = False,
                 num_key_value_heads: int | None = None, fixed_device: str | torch.device | None = None) -> None:
        batch_size, max_seq_len, num_key_value_heads = check_cache_args(model, batch_size, max_seq_len,
                                                                        num_key_value_heads)
        layout = layout_of(model)
        self.layout = layout
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len if max_seq_len != -1 else layout.default_max_seq_len
        self.num_key_value_heads = num_key_value_heads or layout.num_kv_heads
        self.head_dim = layout.head_dim
        self.num_hidden_layers = layout.num_layers
        self.fixed_device = torch.device(fixed_device) if fixed_device is not None else None
        self.lazy = lazy
        self.current_seq_len = 0
        self.key_states: list[torch.Tensor | None] = [None] * self.num_hidden_layers
        self.value_states: list[torch.Tensor | None] = [None] * self.num_hidden_layers
        if self.fixed_device is None:
            layout.devices.subscribe(self)
        if not lazy:
            self.update_cache_tensors()
        if copy_from is not None:
            self.copy_from(copy_from)

    # --- allocation (LayerDevices calls allocate_layer / release_layer as layers are placed) -----------------
    def storage_dtype(self, device: torch.device) -> torch.dtype:
        return self.layout.dtype_for(device)

    def layer_device(self, layer: int) -> torch.device | None:
        return self.fixed_device if self.fixed_device is not None else self.layout.devices.get(layer)

    def update_cache_tensors(self) -> None:
        """Allocate K/V for every layer whose device is known and that has none yet."""
        for i in range(self.num_hidden_layers):
            dev = self.layer_device(i)
            if dev is not None:
                self.allocate_layer(i, dev)

    def allocate_layer(self, layer: int, device: torch.device) -> None:
        if self.key_states[layer] is not None:
            return
        shape = (self.batch_size, self.max_seq_len, self.num_key_value_heads, self.head_dim)
        dt = self.storage_dtype(device)
        self.key_states[layer] = torch.zeros(shape, dtype=dt, device=device)
        self.value_states[layer] = torch.zeros(shape, dtype=dt, device=device)

    def release_layer(self, layer: int) -> None:
        if self.fixed_device is None:
            self.free_layer(layer)

    def free_layer(self, layer: int) -> None:
        self.key_states[layer] = None
        self.value_states[layer] = None

    # --- the forward-pass protocol (KVCache) -----------------------------------------------------------------
    @contextlib.contextmanager
    def forward_scope(self, batch: Any) -> Iterator[None]:
        """Around a forward pass that uses this cache (quantized caches track what it touches)."""
        self.begin_forward(batch)
        try:
            yield
        finally:
            self.end_forward()

    def begin_forward(self, batch: object) -> None:
        """Called before a forward pass that uses this cache."""

    def end_forward(self) -> None:
        """Called after the forward pass."""

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.key_states[layer], self.value_states[layer]
        if k is None or v is None:
            raise ModelStateError(f"cache layer {layer} is not allocated: load the model (lazy caches are "
                                  "allocated by load_autosplit / load) before the forward pass")
        return k, v

    # --- exllamav2 API --------------------------------------------------------------------------------------
    def bytes_per_token(self) -> float:
        return self.num_hidden_layers * self.num_key_value_heads * self.head_dim * (
            self.bytes_per_element_k + self.bytes_per_element_v)

    def footprint(self) -> dict[str, int]:
        """Allocated bytes per device."""
        out: dict[str, int] = {}
        for t in self.all_tensors():
            out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
        return out

    def all_tensors(self) -> list[torch.Tensor]:
        return [t for t in self.key_states + self.value_states if t is not None]

    def reset(self) -> None:
        self.current_seq_len = 0

    def get_kv_state(self, layer: int, batch: int = 0, offset: int = 0, width: int = -1
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.layer_kv(layer)
        end = self.max_seq_len if width == -1 else offset + width
        return k[batch, offset:end], v[batch, offset:end]

    def store_kv_state(self, layer: int, batch: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kc, vc = self.layer_kv(layer)
        kc[batch, offset:offset + k.shape[0]] = k
        vc[batch, offset:offset + v.shape[0]] = v

    def copy_states(self, target: ExLlamaV2CacheBase, from_column: int, from_columns: int, to_column: int,
                    to_columns: int, from_row: int, from_rows: int, to_row: int, to_rows: int) -> None:
        assert from_rows == to_rows and from_columns == to_columns
        for i in range(self.num_hidden_layers):
            for src, dst in ((self.key_states[i], target.key_states[i]),
                             (self.value_states[i], target.value_states[i])):
                assert src is not None and dst is not None
                dst[to_row:to_row + to_rows, to_column:to_column + to_columns].copy_(
                    src[from_row:from_row + from_rows, from_column:from_column + from_columns])

    def copy_from(self, other: ExLlamaV2CacheBase) -> None:
        for i in range(self.num_hidden_layers):
            for dst, src in ((self.key_states, other.key_states), (self.value_states, other.value_states)):
                if dst[i] is not None and src[i] is not None:
                    dst[i].copy_(src[i])  # type: ignore[union-attr]
        self.current_seq_len = other.current_seq_len

    def clone(self) -> ExLlamaV2CacheBase:
        return type(self)(self.layout, self.batch_size, self.max_seq_len, copy_from=self,
                          num_key_value_heads=self.num_key_value_heads, fixed_device=self.fixed_device)

    def roll_left(self) -> None:
        for t in self.all_tensors():
            t[:, :-1] = t[:, 1:].clone()
        self.current_seq_len = max(0, self.current_seq_len - 1)


class ExLlamaV2Cache(ExLlamaV2CacheBase):
    """Unquantized cache in the model's compute dtype (fp16 on GPUs; fp32 for CPU reference runs)."""
