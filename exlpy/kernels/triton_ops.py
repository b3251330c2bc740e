"""CUDA implementations of the fused ops, registered into `ops` on first CUDA use (when triton imports).

Attention over the cache: single-token decode uses the Triton split-K decode kernel; longer query blocks
(prefill chunks, verify steps) the flash kernel, which reads K/V from the cache in place (no gather, no
[T, L] mask); both take lengths from device memory. `EXLPY_FLASH_ATTN=0` sends the longer blocks back to
gather + torch SDPA (for A/B runs). Prefill without a cache stays on torch SDPA (flash backend, native GQA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from exlpy.kernels import ops, reference
from exlpy.kernels.act_order import act_order, rms_norm_act_order
from exlpy.kernels.activation import act_mul, silu_mul
from exlpy.kernels.embed_slice import embed_slice
from exlpy.kernels.exl2_matmul import quant_matmul_cuda
from exlpy.kernels.flash_attention import flash_attention, quant_attention
from exlpy.kernels.gemv import linear_add, norm_linear, norm_linear_swiglu
from exlpy.kernels.gptq_block import gptq_block
from exlpy.kernels.host_allreduce import host_all_reduce, host_all_reduce_norm
from exlpy.kernels.kv_store import store_kv
from exlpy.kernels.lora import lora_expand, lora_expand_swiglu, lora_shrink
from exlpy.kernels.moe import moe_combine, moe_down, moe_gate_up, moe_route, moe_sort
from exlpy.kernels.moe_exl2 import moe_down_exl2, moe_gate_up_exl2
from exlpy.kernels.paged_attention import paged_decode_attention
from exlpy.kernels.quant_kv_store import store_kv_quant
from exlpy.kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_add
from exlpy.kernels.rope import apply_rope, rope_store_kv
from exlpy.kernels.sample_top import sample_top, sample_top_candidates
from exlpy.kernels.token_bitmask import apply_token_bitmask
from exlpy.runtime import options

_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_MAX_DECODE_Q = 1  # the decode kernel re-reads K/V per query token; the flash kernel reads it once per tile


def sdpa_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
              is_causal: bool = False) -> torch.Tensor:
    """`reference.sdpa` without materialising repeated K/V heads: SDPA's native GQA."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]
    if mask is None:
        # Flash first: the cuDNN backend re-plans for every new sequence length (~1 ms per call).
        with sdpa_kernel(_NO_CUDNN):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        return o.transpose(1, 2)
    mask = mask | ~mask.any(-1, keepdim=True)  # fully masked padding queries see key 0, as the reference
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)


def paged_attention_cuda(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table: torch.Tensor, page_size: int, seqlens: torch.Tensor, max_seqlen: int,
                         positions: torch.Tensor, scale: float, key_mask: torch.Tensor | None = None,
                         window: int = 0, softcap: float = 0.0, limits: torch.Tensor | None = None) -> torch.Tensor:
    flash = options().flash_attn
    if limits is not None:  # keys past a query's position (Gemma 3's images): the flash kernel alone reads limits
        if flash:
            return flash_attention(q, k_cache, v_cache, block_table, page_size, seqlens, max_seqlen, positions,
                                   scale, key_mask, window, softcap, limits)
        return reference.paged_attention(q, k_cache, v_cache, block_table, page_size, seqlens, max_seqlen,
                                         positions, scale, key_mask, window, softcap, limits)
    # Both kernels serve sliding windows and soft-capped scores; the gather + SDPA path below does not.
    if q.shape[1] <= _MAX_DECODE_Q or (not flash and q.shape[1] <= 16):
        return paged_decode_attention(q, k_cache, v_cache, block_table, page_size, seqlens, max_seqlen,
                                      positions, scale, key_mask, window, softcap)
    if flash:
        return flash_attention(q, k_cache, v_cache, block_table, page_size, seqlens, max_seqlen, positions, scale,
                               key_mask, window, softcap)
    if window or softcap:
        return reference.paged_attention(q, k_cache, v_cache, block_table, page_size, seqlens, max_seqlen,
                                         positions, scale, key_mask, window, softcap)
    k = reference.gather_kv(k_cache, block_table, page_size, max_seqlen)
    v = reference.gather_kv(v_cache, block_table, page_size, max_seqlen)
    t = torch.arange(max_seqlen, device=q.device)
    mask = (t.view(1, 1, -1) <= positions.unsqueeze(-1)) & (t.view(1, 1, -1) < seqlens.view(-1, 1, 1))
    if key_mask is not None:
        mask = mask & key_mask[:, None, :max_seqlen]
    return sdpa_cuda(q, k, v, scale, mask.unsqueeze(1))


def quant_attention_cuda(q: torch.Tensor, *args: object, limits: torch.Tensor | None = None) -> torch.Tensor:
    """The quantized-cache kernel rotates q per head in 32-element groups: head_dim must be a power of two
    >= 32. Other head sizes (rare: test models) take the torch reference, which dequantizes whole rows."""
    D = q.shape[-1]
    if D < 32 or D & (D - 1):
        return reference.quant_attention(q, *args, limits=limits)  # type: ignore[arg-type]
    return quant_attention(q, *args, limits=limits)  # type: ignore[arg-type]


def layer_norm_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`reference.layer_norm` as torch's fused LayerNorm kernel (fp32 statistics, as nn.LayerNorm and Cohere's
    norm); per-head [H, D] weights (Cohere's q/k norm) and mixed dtypes (an fp32 residual) take the reference."""
    if weight.dim() != 1 or x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        return reference.layer_norm(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def register_all() -> None:
    ops.register("rms_norm", rms_norm)
    ops.register("layer_norm", layer_norm_cuda)
    ops.register("rms_norm_add", rms_norm_add)
    ops.register("add_rms_norm", add_rms_norm)
    ops.register("act_mul", act_mul)
    ops.register("apply_rope", apply_rope)
    ops.register("silu_mul", silu_mul)
    ops.register("linear_add", linear_add)
    ops.register("norm_linear", norm_linear)
    ops.register("store_kv", store_kv)
    ops.register("rope_store_kv", rope_store_kv)
    ops.register("norm_linear_swiglu", norm_linear_swiglu)
    ops.register("act_order", act_order)
    ops.register("rms_norm_act_order", rms_norm_act_order)
    ops.register("quant_matmul", quant_matmul_cuda)
    ops.register("paged_attention", paged_attention_cuda)
    ops.register_features("paged_attention", frozenset({"window", "softcap", "limits"}))
    ops.register("sdpa", sdpa_cuda)
    ops.register("flash_attention", flash_attention)
    ops.register_features("flash_attention", frozenset({"window", "softcap", "limits"}))
    ops.register("quant_attention", quant_attention_cuda)
    ops.register_features("quant_attention", frozenset({"limits"}))
    ops.register("store_kv_quant", store_kv_quant)
    ops.register("apply_token_bitmask", apply_token_bitmask)
    ops.register("host_all_reduce", host_all_reduce)
    ops.register("host_all_reduce_norm", host_all_reduce_norm)
    ops.register("embed_slice", embed_slice)
    ops.register("sample_top", sample_top)
    ops.register("sample_top_candidates", sample_top_candidates)
    ops.register("lora_shrink", lora_shrink)
    ops.register("lora_expand", lora_expand)
    ops.register("lora_expand_swiglu", lora_expand_swiglu)
    ops.register("moe_route", moe_route)
    ops.register("moe_sort", moe_sort)
    ops.register("moe_gate_up", moe_gate_up)
    ops.register_features("moe_gate_up", frozenset({"silu", "gelu_tanh"}))
    ops.register("moe_down", moe_down)
    ops.register("moe_combine", moe_combine)
    ops.register("moe_gate_up_exl2", moe_gate_up_exl2)
    ops.register_features("moe_gate_up_exl2", frozenset({"silu", "gelu_tanh"}))
    ops.register("moe_down_exl2", moe_down_exl2)
    ops.register("gptq_block", gptq_block)


register_all()
