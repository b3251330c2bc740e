"""What a KV cache needs to know about a model, and the protocol every cache offers the forward pass.

A cache never holds the model. It is built from a `CacheLayout`: the attention shapes, the compute dtype per
device, and `LayerDevices`, the live layer -> device map that loading fills in. A lazy cache subscribes to
that map and allocates each layer's K/V when the layer lands on its device (and frees it when the layer
leaves), so `load_autosplit` can account for the cache layer by layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class KVCache(Protocol):
    """What attention reads and writes. `layer_kv` hands out [rows, seq, Hkv, D] tensors addressed as flat
    rows (a contiguous cache is a paged cache whose page is one whole row)."""

    batch_size: int
    max_seq_len: int
    current_seq_len: int
    graph_safe: bool  # K/V are read in place, so a captured step can address them

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_scope(self, batch: Any) -> AbstractContextManager[None]: ...

    def all_tensors(self) -> list[torch.Tensor]: ...


class LayerDevices:
    """layer index -> device, as loading places attention modules; subscribed caches follow every change."""

    def __init__(self) -> None:
        self._map: dict[int, torch.device] = {}
        self._subscribers: list[weakref.ref[Any]] = []

    def subscribe(self, cache: Any) -> None:
        self._subscribers = [r for r in self._subscribers if r() is not None] + [weakref.ref(cache)]

    def _caches(self) -> Iterator[Any]:
        for r in self._subscribers:
            c = r()
            if c is not None:
                yield c

    def assign(self, layer: int, device: torch.device) -> None:
        self._map[layer] = device
        for c in self._caches():
            c.allocate_layer(layer, device)

    def release(self, layer: int) -> None:
        if self._map.pop(layer, None) is not None:
            for c in self._caches():
                c.release_layer(layer)

    def get(self, layer: int) -> torch.device | None:
        return self._map.get(layer)

    def as_dict(self) -> dict[int, torch.device]:
        return dict(self._map)

    def subscribers(self) -> list[Any]:
        return list(self._caches())


@dataclass(frozen=True)
class CacheLayout:
    """Shapes and devices a cache is built from (`model.cache_layout()`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    default_max_seq_len: int
    dtype_for: Callable[[torch.device], torch.dtype]  # the compute dtype K/V are stored or worked in
    devices: LayerDevices
    # Tensor parallelism: per slot, (device, KV heads it holds); None for a model loaded on whole layers.
    tp_slots: tuple[tuple[torch.device, int], ...] | None = None
    tp_cache_base: type | None = None  # the cache class a TP load planned for (expect_cache_base)

    def for_heads(self, num_kv_heads: int) -> CacheLayout:
        """The same layout holding `num_kv_heads` heads (one tensor-parallel slot's part), on no device map."""
        return CacheLayout(self.num_layers, num_kv_heads, self.head_dim, self.default_max_seq_len,
                           self.dtype_for, LayerDevices())
