"""Quantized caches (Q4, Q6, Q8, 8-bit): K/V kept only as codes (+ fp16 group scales).

Attention reads the codes where they lie, at the cache's own width (exlpy/kernels: `store_kv_quant` writes a
step's rows, `quant_attention` attends over them, dequantizing in registers), so there is no full-size fp16
working copy (exllamav2 keeps one per device) and a decode step over a quantized cache can be captured in a
CUDA graph like any other. `get_kv_state` / `store_kv_state` go through the torch codec (qcodec.py).
"""

from __future__ import annotations

from typing import Any

import torch

from exlpy.cache import qcodec
from exlpy.cache.base import ExLlamaV2CacheBase, layout_of
from exlpy.errors import ConfigError


def kernel_attends(head_dim: int, model: Any) -> bool:
    """Whether the quantized-cache attention kernel serves this model (else the torch reference does, eagerly):
    head_dim a power of two >= 32, no sliding window and no soft-capped scores. `model` may be a model or a
    cache layout (which has no modules: only head_dim counts then)."""
    features = any(getattr(m, "window", 0) or getattr(m, "softcap", 0.0) for m in getattr(model, "modules", ()))
    return head_dim >= 32 and not head_dim & (head_dim - 1) and not features


class _QuantizedCache(ExLlamaV2CacheBase):
    k_bits: int = 4
    v_bits: int = 4
    has_scales = True
    graph_safe = True  # codes are read in place by kernels whose bounds come from device memory

    def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
        layout = layout_of(model)
        heads = kwargs.get("num_key_value_heads") or layout.num_kv_heads
        if (heads * layout.head_dim) % qcodec.GROUP:
            raise ConfigError(f"{type(self).__name__}: num_key_value_heads*head_dim "
                              f"({heads * layout.head_dim}) must be a multiple of {qcodec.GROUP}")
        self.key_scales: list[torch.Tensor | None] = []
        self.value_scales: list[torch.Tensor | None] = []
        super().__init__(model, *args, **kwargs)
        # The quantized-cache kernel takes head_dim a power of two >= 32 and no sliding window or soft-cap; other
        # models attend through the torch reference, which selects rows with host-side masks: their steps run
        # eagerly (a capture would fail with "operation not permitted when stream is capturing").
        self.graph_safe = kernel_attends(self.head_dim, model)

    @staticmethod
    def _width(bits: int, e: int) -> int:
        return e * bits // 8 if bits != 16 else e

    def allocate_layer(self, layer: int, device: torch.device) -> None:
        n, e = self.num_hidden_layers, self.num_key_value_heads * self.head_dim
        if not self.key_scales:
            self.key_scales, self.value_scales = [None] * n, [None] * n
        if self.key_states[layer] is not None:
            return
        i, dev = layer, device
        shape = (self.batch_size, self.max_seq_len)
        self.key_states[i] = torch.zeros(*shape, self._width(self.k_bits, e), dtype=torch.uint8, device=dev)
        self.value_states[i] = torch.zeros(*shape, self._width(self.v_bits, e), dtype=torch.uint8, device=dev)
        if self.has_scales:
            self.key_scales[i] = torch.zeros(*shape, e // qcodec.GROUP, dtype=torch.float16, device=dev)
            self.value_scales[i] = torch.zeros(*shape, e // qcodec.GROUP, dtype=torch.float16, device=dev)

    def free_layer(self, layer: int) -> None:
        super().free_layer(layer)
        if self.key_scales:
            self.key_scales[layer] = self.value_scales[layer] = None

    def all_tensors(self) -> list[torch.Tensor]:
        return super().all_tensors() + [t for t in self.key_scales + self.value_scales if t is not None]

    # --- what attention reads ------------------------------------------------------------------------------
    def layer_codes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                               torch.Tensor | None, int, int]:
        """(k_codes, k_scales, v_codes, v_scales, k_bits, v_bits) of a layer, for ops.quant_attention."""
        kq, vq = super().layer_kv(layer)
        ks, vs = self.key_scales[layer], self.value_scales[layer]
        return kq, ks, vq, vs, (8 if ks is None else self.k_bits), (8 if vs is None else self.v_bits)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise ConfigError(f"{type(self).__name__} holds codes, not fp16 K/V: attention reads layer_codes(); "
                          "get_kv_state() dequantizes a range")

    # --- codec per kind -----------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return qcodec.quantize(x, bits)

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor | None, bits: int, dtype: torch.dtype
                ) -> torch.Tensor:
        assert scales is not None
        return qcodec.dequantize(codes, scales, bits, dtype)

    def get_kv_state(self, layer: int, batch: int = 0, offset: int = 0, width: int = -1
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.max_seq_len if width == -1 else offset + width
        out = []
        for q, s, bits in ((self.key_states[layer], self.key_scales[layer], self.k_bits),
                           (self.value_states[layer], self.value_scales[layer], self.v_bits)):
            assert q is not None
            dec = self._decode(q[batch, offset:end], None if s is None else s[batch, offset:end], bits,
                               self.layout.dtype_for(q.device))
            out.append(dec.view(end - offset, self.num_key_value_heads, self.head_dim))
        return out[0], out[1]

    def store_kv_state(self, layer: int, batch: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for q, s, x, bits in ((self.key_states[layer], self.key_scales[layer], k, self.k_bits),
                              (self.value_states[layer], self.value_scales[layer], v, self.v_bits)):
            assert q is not None
            codes, scales = self._encode(x.reshape(x.shape[0], -1), bits)
            q[batch, offset:offset + x.shape[0]] = codes
            if s is not None and scales is not None:
                s[batch, offset:offset + x.shape[0]] = scales

    def copy_states(self, target: ExLlamaV2CacheBase, from_column: int, from_columns: int, to_column: int,
                    to_columns: int, from_row: int, from_rows: int, to_row: int, to_rows: int) -> None:
        """Copy codes and scales (a partial-page copy in the dynamic generator): same type of cache only."""
        if type(target) is not type(self):
            raise ConfigError(f"copy_states from {type(self).__name__} needs a target of the same type, got "
                              f"{type(target).__name__}")
        super().copy_states(target, from_column, from_columns, to_column, to_columns, from_row, from_rows, to_row,
                            to_rows)
        if not self.has_scales:
            return
        for i in range(self.num_hidden_layers):
            for src, dst in ((self.key_scales[i], target.key_scales[i]), (self.value_scales[i],  # type: ignore
                                                                          target.value_scales[i])):  # type: ignore
                assert src is not None and dst is not None
                dst[to_row:to_row + to_rows, to_column:to_column + to_columns].copy_(
                    src[from_row:from_row + from_rows, from_column:from_column + from_columns])


class ExLlamaV2Cache_Q(_QuantizedCache):  # noqa: N801 - exllamav2's public name: base of the Q4/Q6/Q8 caches
    def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
        if type(self) is ExLlamaV2Cache_Q:
            raise ConfigError("ExLlamaV2Cache_Q is the base class of the quantized caches: create an "
                              "ExLlamaV2Cache_Q4, ExLlamaV2Cache_Q6 or ExLlamaV2Cache_Q8")
        super().__init__(model, *args, **kwargs)


class ExLlamaV2Cache_Q4(ExLlamaV2Cache_Q):  # noqa: N801 - exllamav2's public name
    k_bits = v_bits = 4
    bytes_per_element_k = bytes_per_element_v = 4.5 / 8


class ExLlamaV2Cache_Q6(ExLlamaV2Cache_Q):  # noqa: N801
    k_bits, v_bits = 8, 4  # exllamav2's Q6 stores K at 8 bits and V at 4
    bytes_per_element_k, bytes_per_element_v = 8.5 / 8, 4.5 / 8


class ExLlamaV2Cache_Q8(ExLlamaV2Cache_Q):  # noqa: N801
    k_bits = v_bits = 8
    bytes_per_element_k = bytes_per_element_v = 8.5 / 8


class ExLlamaV2Cache_8bit(_QuantizedCache):  # noqa: N801
    """FP8 (E5M2 by truncating fp16), no scales."""

    k_bits = v_bits = 16  # one code byte per element; see _width/_encode
    has_scales = False
    bytes_per_element_k = bytes_per_element_v = 1.0

    @staticmethod
    def _width(bits: int, e: int) -> int:
        return e

    def _encode(self, x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return qcodec.fp8_encode(x), None

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor | None, bits: int, dtype: torch.dtype
                ) -> torch.Tensor:
        return qcodec.fp8_decode(codes, dtype)
