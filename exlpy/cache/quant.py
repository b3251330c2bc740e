"""Quantized caches (Q4, Q6, Q8, 8-bit): compact storage, fp16 working copies per device.

Attention reads plain K/V tensors. A quantized cache keeps one full-size working K and V per device (as
exllamav2 does), dequantizes the rows a forward pass reads into it when a layer asks for its K/V, and
requantizes the rows that layer wrote when the next layer asks (or when the forward ends).
"""

from __future__ import annotations

from typing import Any

import torch

from exlpy.cache import qcodec
from exlpy.cache.base import ExLlamaV2CacheBase, layout_of
from exlpy.errors import ConfigError


class _QuantizedCache(ExLlamaV2CacheBase):
    k_bits: int = 4
    v_bits: int = 4
    has_scales = True
    graph_safe = False  # reads depend on host-side lengths; the decode graph path uses fp16 caches

    def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
        layout = layout_of(model)
        heads = kwargs.get("num_key_value_heads") or layout.num_kv_heads
        if (heads * layout.head_dim) % qcodec.GROUP:
            raise ConfigError(f"{type(self).__name__}: num_key_value_heads*head_dim "
                              f"({heads * layout.head_dim}) must be a multiple of {qcodec.GROUP}")
        self.key_scales: list[torch.Tensor | None] = []
        self.value_scales: list[torch.Tensor | None] = []
        self._temps: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._batch: Any = None
        self._pending: int | None = None
        super().__init__(model, *args, **kwargs)

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
        if str(dev) not in self._temps:
            full = (self.batch_size, self.max_seq_len, self.num_key_value_heads, self.head_dim)
            dt = self.layout.dtype_for(dev)
            self._temps[str(dev)] = (torch.zeros(full, dtype=dt, device=dev), torch.zeros(full, dtype=dt,
                                                                                          device=dev))

    def free_layer(self, layer: int) -> None:
        freed = self.key_states[layer]
        super().free_layer(layer)
        if self.key_scales:
            self.key_scales[layer] = self.value_scales[layer] = None
        # The fp16 working copies are the largest part of a quantized cache: they go with the device's last layer
        # (model.unload(), or a module moved elsewhere by a failed autosplit try).
        if freed is not None and not any(t is not None and t.device == freed.device for t in self.key_states):
            self._temps.pop(str(freed.device), None)

    def all_tensors(self) -> list[torch.Tensor]:
        extra = [t for t in self.key_scales + self.value_scales if t is not None]
        return super().all_tensors() + extra + [t for pair in self._temps.values() for t in pair]

    # --- codec per kind -----------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return qcodec.quantize(x, bits)

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor | None, bits: int, dtype: torch.dtype
                ) -> torch.Tensor:
        assert scales is not None
        return qcodec.dequantize(codes, scales, bits, dtype)

    # --- the forward-pass protocol --------------------------------------------------------------------------
    def begin_forward(self, batch: Any) -> None:
        self._batch = batch
        self._pending = None

    def end_forward(self) -> None:
        self._flush()
        self._batch = None

    def _rows(self, layer: int) -> torch.Tensor:
        """Flat rows this forward reads for `layer` (all valid keys of every sequence in the batch)."""
        b = self._batch.on(self.key_states[layer].device)
        t = torch.arange(b.max_seqlen, device=b.block_table.device)
        rows = b.block_table[:, t // b.page_size].long() * b.page_size + t % b.page_size
        return rows.reshape(-1).unique()

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._flush()
        kq, vq = super().layer_kv(layer)
        kt, vt = self._temps[str(kq.device)]
        if self._batch is not None:
            rows = self._rows(layer)
            e = self.num_key_value_heads * self.head_dim
            for q, s, tmp, bits in ((kq, self.key_scales[layer], kt, self.k_bits),
                                    (vq, self.value_scales[layer], vt, self.v_bits)):
                flat_q = q.view(-1, q.shape[-1])
                flat_s = s.view(-1, s.shape[-1]) if s is not None else None
                vals = self._decode(flat_q[rows], flat_s[rows] if flat_s is not None else None, bits, tmp.dtype)
                tmp.view(-1, e)[rows] = vals
            self._pending = layer
        return kt, vt

    def _flush(self) -> None:
        """Requantize the rows the pending layer wrote into its working copy."""
        if self._pending is None or self._batch is None:
            return
        layer, self._pending = self._pending, None
        kq, vq = self.key_states[layer], self.value_states[layer]
        assert kq is not None and vq is not None
        b = self._batch.on(kq.device)
        rows = b.slots.reshape(-1)
        e = self.num_key_value_heads * self.head_dim
        kt, vt = self._temps[str(kq.device)]
        for q, s, tmp, bits in ((kq, self.key_scales[layer], kt, self.k_bits),
                                (vq, self.value_scales[layer], vt, self.v_bits)):
            codes, scales = self._encode(tmp.view(-1, e)[rows], bits)
            q.view(-1, q.shape[-1])[rows] = codes
            if s is not None and scales is not None:
                s.view(-1, s.shape[-1])[rows] = scales

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

    def copy_states(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("copy_states is only implemented for ExLlamaV2Cache")


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
