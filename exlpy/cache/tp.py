"""`ExLlamaV2Cache_TP`: one `base` cache per tensor-parallel slot, each holding that slot's KV heads."""

from __future__ import annotations

from typing import Any

import torch

from exlpy.cache.base import ExLlamaV2Cache, ExLlamaV2CacheBase, layout_of
from exlpy.cache.quant import _QuantizedCache, kernel_attends
from exlpy.errors import TensorParallelError


class ExLlamaV2Cache_TP(ExLlamaV2CacheBase):  # noqa: N801 - exllamav2's public name
    """A cache for a model loaded with `load_tp()`: `caches[slot]` is a `base` cache on that slot's device with
    the slot's share of the KV heads. Sequence state (`current_seq_len`) is shared by all of them."""

    def __init__(self, model: Any, base: type[ExLlamaV2CacheBase] = ExLlamaV2Cache, batch_size: int = 1,
                 max_seq_len: int = -1, copy_from: ExLlamaV2Cache_TP | None = None) -> None:
        layout = layout_of(model)
        if layout.tp_slots is None:
            raise TensorParallelError("Cannot create TP cache unless model is loaded with load_tp()")
        if not (isinstance(base, type) and issubclass(base, ExLlamaV2CacheBase)) or base is ExLlamaV2Cache_TP:
            raise TensorParallelError(f"ExLlamaV2Cache_TP base must be a cache class such as ExLlamaV2Cache, "
                                      f"got {base!r}")
        expected = layout.tp_cache_base
        if expected is not None and base is not expected:
            raise TensorParallelError(
                f"cache type mismatch: the model was loaded with expect_cache_base={expected.__name__} "
                f"(its memory plan assumes that cache) but ExLlamaV2Cache_TP got base={base.__name__}")
        self.base = base
        self.bytes_per_element_k = base.bytes_per_element_k
        self.bytes_per_element_v = base.bytes_per_element_v
        self.graph_safe = base.graph_safe
        self.caches: dict[int, ExLlamaV2CacheBase] = {
            slot: base(layout.for_heads(heads), batch_size, max_seq_len, fixed_device=dev)
            for slot, (dev, heads) in enumerate(layout.tp_slots)}
        # Graph-safe only where every slot's attention runs in a kernel (a quantized slot cache of a model with
        # windows or soft-caps, or odd head sizes, attends through the torch reference: eager steps).
        self.graph_safe = all(c.graph_safe for c in self.caches.values()) and (
            not issubclass(base, _QuantizedCache) or kernel_attends(layout.head_dim, model))
        self._seq_len = 0
        super().__init__(layout, batch_size, max_seq_len, lazy=True)
        if copy_from is not None:
            self.copy_from(copy_from)

    # current_seq_len is one number for all slots; the sub-caches mirror it for code that reads them directly.
    @property  # type: ignore[override]
    def current_seq_len(self) -> int:
        return self._seq_len

    @current_seq_len.setter
    def current_seq_len(self, value: int) -> None:
        self._seq_len = value
        for c in self.caches.values():
            c.current_seq_len = value

    def slot_cache(self, slot: int) -> ExLlamaV2CacheBase:
        if slot not in self.caches:
            raise TensorParallelError(f"TP cache has no part on device slot {slot} (kv split slots: "
                                      f"{sorted(self.caches)})")
        return self.caches[slot]

    def update_cache_tensors(self) -> None:
        pass  # every part is allocated on its fixed device at construction

    def allocate_layer(self, layer: int, device: torch.device) -> None:
        pass

    def free_layer(self, layer: int) -> None:
        pass

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise TensorParallelError("ExLlamaV2Cache_TP holds one cache per device: use slot_cache(slot).layer_kv()")

    def all_tensors(self) -> list[torch.Tensor]:
        return [t for c in self.caches.values() for t in c.all_tensors()]

    def reset(self) -> None:
        self.current_seq_len = 0

    def _primary(self) -> torch.device:
        return next(iter(self.caches.values())).all_tensors()[0].device

    def get_kv_state(self, layer: int, batch: int = 0, offset: int = 0, width: int = -1
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """All heads, joined on the first slot's device."""
        dev = self._primary()
        parts = [c.get_kv_state(layer, batch, offset, width) for c in self.caches.values()]
        return (torch.cat([k.to(dev) for k, _ in parts], dim=-2), torch.cat([v.to(dev) for _, v in parts], dim=-2))

    def store_kv_state(self, layer: int, batch: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        h = 0
        for c in self.caches.values():
            n = c.num_key_value_heads
            c.store_kv_state(layer, batch, offset, k[..., h:h + n, :], v[..., h:h + n, :])
            h += n

    def copy_states(self, target: ExLlamaV2CacheBase, from_column: int, from_columns: int, to_column: int,
                    to_columns: int, from_row: int, from_rows: int, to_row: int, to_rows: int) -> None:
        if not isinstance(target, ExLlamaV2Cache_TP) or target.caches.keys() != self.caches.keys():
            raise TensorParallelError("copy_states between TP caches needs a target ExLlamaV2Cache_TP of the same "
                                      "model")
        for slot, c in self.caches.items():
            c.copy_states(target.caches[slot], from_column, from_columns, to_column, to_columns, from_row,
                          from_rows, to_row, to_rows)

    def copy_from(self, other: ExLlamaV2CacheBase) -> None:
        if not isinstance(other, ExLlamaV2Cache_TP) or other.caches.keys() != self.caches.keys():
            raise TensorParallelError("a TP cache can only copy from a TP cache of the same model")
        for slot, c in self.caches.items():
            c.copy_from(other.caches[slot])
        self.current_seq_len = other.current_seq_len

    def clone(self) -> ExLlamaV2Cache_TP:
        return ExLlamaV2Cache_TP(self.layout, self.base, self.batch_size, self.max_seq_len, copy_from=self)

    def roll_left(self) -> None:
        for c in self.caches.values():
            c.roll_left()
        self.current_seq_len = max(0, self.current_seq_len - 1)
