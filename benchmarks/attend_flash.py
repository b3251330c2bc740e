"""The proposed `exlpy.model.attention.attend` over the new attention ops, installable for benchmarks.

The model code is not wired to the new kernels yet (the engine refactor owns exlpy/model/); this module is
the exact routing proposed for it, so the benchmarks can time the whole model with it today:
- no cache: unchanged (torch SDPA);
- quantized caches (Q4/Q6/Q8, and the FP8 8-bit one): rotate q/k, quantize the new K/V rows straight into
  the cache (`ops.store_kv_quant`), attend over the codes in place (`ops.quant_attention`, any query length),
  the step's own keys taken unquantized from k/v as exllamav2's fp16 working copy would hold them; no fp16
  working copy is touched;
- fp16/bf16 caches: write K/V as today; one query token -> `ops.paged_attention` (the split-K decode kernel),
  longer blocks -> `ops.flash_attention` (contiguous caches as pages of max_seq_len rows, paged ones as they
  are); no SDPA over a cache slice, no [T, L] mask.

`install()` swaps it in (module attribute `exlpy.model.attention.attend`, which `Attention.forward` looks up at
call time) and returns an `uninstall` callable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from exlpy.cache.base import ExLlamaV2CacheBase
from exlpy.kernels import ops


def quant_layer(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                  torch.Tensor | None, int, int] | None:
    """(k_codes, k_scales, v_codes, v_scales, k_bits, v_bits) of a quantized cache's layer; None for others.

    The FP8 cache (`ExLlamaV2Cache_8bit`, k_bits 16 in exllamav2's convention) has no scales and 8-bit codes.
    """
    scales = getattr(cache, "key_scales", None)
    if scales is None:
        return None
    kq, vq = ExLlamaV2CacheBase.layer_kv(cache, layer)  # the codes themselves, not the working copies
    ks, vs = cache.key_scales[layer], cache.value_scales[layer]
    kb = 8 if ks is None else cache.k_bits
    vb = 8 if vs is None else cache.v_bits
    return kq, ks, vq, vs, kb, vb


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Any, layer_idx: int, scale: float,
           rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Same contract as exlpy.model.attention.attend (q and k arrive unrotated)."""
    cache = batch.cache
    if cache is None:
        return _ORIGINAL["attend"](q, k, v, batch, layer_idx, scale, rope)
    assert batch.slots is not None and batch.block_table is not None and batch.seqlens is not None
    args = (batch.block_table, batch.page_size, batch.seqlens, batch.max_seqlen, batch.positions, scale)
    quant = quant_layer(cache, layer_idx)
    if quant is not None:
        kq, ks, vq, vs, kb, vb = quant
        q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
        ops.store_kv_quant(kq, ks, vq, vs, batch.slots, k, v, kb, vb)
        # The step's own keys are read unquantized from k/v (as exllamav2's fresh working-copy rows).
        return ops.quant_attention(q, kq, ks, vq, vs, *args, kb, vb, batch.key_mask, k, v)
    k_cache, v_cache = cache.layer_kv(layer_idx)
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        q, k = ops.rope_store_kv(q, k, v, rope[0], rope[1], batch.rope_pos, k_cache, v_cache, batch.slots)
    else:
        q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
        ops.store_kv(k_cache, v_cache, batch.slots, k, v)
    if batch.q_len == 1:
        return ops.paged_attention(q, k_cache, v_cache, *args, batch.key_mask)
    return ops.flash_attention(q, k_cache, v_cache, *args, batch.key_mask)


_ORIGINAL: dict[str, Callable[..., Any]] = {}


def install() -> Callable[[], None]:
    import exlpy.model.attention as attention

    _ORIGINAL.setdefault("attend", attention.attend)
    attention.attend = attend

    def uninstall() -> None:
        attention.attend = _ORIGINAL["attend"]

    return uninstall
