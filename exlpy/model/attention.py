"""The attention block: x + o_proj(attention(rope(q), rope(k), v)) with GQA and a KV cache."""

from __future__ import annotations

import math
from typing import Any

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.kernels import ops
from exlpy.model.batch import ForwardBatch
from exlpy.model.fusion import FusedDense, FusedQuant, fuse_linears
from exlpy.model.linear import Linear, load_linear
from exlpy.model.module import Module
from exlpy.model.parallel_linear import ColumnParallel, RowParallel, close_block
from exlpy.model.rotary import RotaryTables
from exlpy.weights.checks import landed


def load_norm(m: Module, key: str, device: torch.device, size: int | None = None) -> torch.Tensor:
    size = size or m.spec.hidden_size
    name = f"{key}.weight"
    return landed(m.index, name, m.index.get(name, shape=(size,)).to(device=device, dtype=m.dtype(device)))


class Attention(Module):
    """Pre-norm attention block. Under tensor parallelism a copy holds this GPU's heads (num_heads and
    num_kv_heads are then its share) and o_proj is a RowParallel / ColumnParallel that sums over GPUs."""

    def __init__(self, config: ExLlamaV2Config, layer_idx: int, rotary: RotaryTables) -> None:
        super().__init__(config, f"model.layers.{layer_idx}.self_attn")
        self.layer_idx = layer_idx
        self.rotary = rotary
        s = self.spec
        self.num_heads = s.num_attention_heads
        self.num_kv_heads = s.num_key_value_heads
        self.head_dim = s.head_dim
        self.scale = 1.0 / math.sqrt(s.head_dim)
        self.norm_key = f"model.layers.{layer_idx}.input_layernorm"
        self.norm_w: torch.Tensor | None = None
        self.q_norm_w: torch.Tensor | None = None
        self.k_norm_w: torch.Tensor | None = None
        self.q_proj: Linear | None = None
        self.k_proj: Linear | None = None
        self.v_proj: Linear | None = None
        self.o_proj: Linear | RowParallel | ColumnParallel | None = None
        self.qkv_proj: FusedDense | FusedQuant | None = None  # q, k and v side by side when they can fuse
        self.lora: Any = None  # LoRA slot buffers and hooks, attached by exlpy/lora/ while adapters are in use

    def tensor_prefixes(self) -> list[str]:
        return [self.key, self.norm_key]

    def load(self, device: torch.device) -> None:
        s, dt, idx = self.spec, self.dtype(device), self.index
        hq, hk, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        qkv_bias = True if s.arch.qkv_bias else None
        kw = {"gptq_v2": s.gptq_v2}
        self.norm_w = load_norm(self, self.norm_key, device)
        kb = {**kw, "bias": qkv_bias}
        self.q_proj = load_linear(idx, f"{self.key}.q_proj", s.hidden_size, hq, device, dt, **kb)
        self.k_proj = load_linear(idx, f"{self.key}.k_proj", s.hidden_size, hk, device, dt, **kb)
        self.v_proj = load_linear(idx, f"{self.key}.v_proj", s.hidden_size, hk, device, dt, **kb)
        self.o_proj = load_linear(idx, f"{self.key}.o_proj", hq, s.hidden_size, device, dt, **kw)
        self.fuse()
        if s.arch.qk_norm:
            self.q_norm_w = load_norm(self, f"{self.key}.q_norm", device, d)
            self.k_norm_w = load_norm(self, f"{self.key}.k_norm", device, d)
        self.device = device

    def fuse(self) -> None:
        assert self.q_proj and self.k_proj and self.v_proj
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def unload(self) -> None:
        self.norm_w = self.q_norm_w = self.k_norm_w = None
        self.q_proj = self.k_proj = self.v_proj = self.o_proj = self.qkv_proj = self.lora = None
        super().unload()

    async def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.q_proj and self.k_proj and self.v_proj and self.o_proj and self.norm_w is not None
        B, T, _ = x.shape
        eps = self.spec.norm_eps
        lora = self.lora if batch.lora else None  # rows with LoRA adapters (exlpy/lora/block.py)
        if lora is not None:
            q, k, v = lora.project_qkv(self, x, batch)
        elif self.qkv_proj is not None:  # pre-norm fused into one q|k|v projection
            q, k, v = self.qkv_proj.forward_normed(x, self.norm_w, eps).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1)
        else:
            h = ops.rms_norm(x, self.norm_w, eps)
            q, k, v = self.q_proj.forward(h), self.k_proj.forward(h), self.v_proj.forward(h)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm_w is not None and self.k_norm_w is not None:
            q = ops.rms_norm(q, self.q_norm_w, eps)
            k = ops.rms_norm(k, self.k_norm_w, eps)
        o = attend(q, k, v, batch, self.layer_idx, self.scale, self.rotary.get(x.device, x.dtype))
        return await close_block(x, self.o_proj, o.reshape(B, T, self.num_heads * self.head_dim),
                                 lora.closing(batch, "o") if lora is not None else None)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, layer_idx: int, scale: float,
           rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Causal attention of q [B,T,Hq,D] after writing k/v to `batch.cache` (when there is one): [B,T,Hq,D].

    q and k arrive unrotated and are rotated here at `batch.rope_pos` (in the kernel that writes the cache,
    where it can). Over a cache the kernels read K/V where they lie, at the cache's own width: the split-K
    decode kernel for one token per row, the flash kernel for longer blocks (chunked prefill, speculative
    verification), the quantized-cache kernels for Q4/Q6/Q8/FP8 caches (no fp16 working copy).
    """
    cache = batch.cache
    if cache is None:
        q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
        mask = None
        if batch.key_mask is not None:
            causal = torch.ones(batch.q_len, batch.q_len, dtype=torch.bool, device=q.device).tril()
            mask = (causal.unsqueeze(0) & batch.key_mask[:, None, :batch.q_len]).unsqueeze(1)
        return ops.sdpa(q, k, v, scale, mask, is_causal=True)
    assert batch.slots is not None and batch.block_table is not None and batch.seqlens is not None
    where = (batch.block_table, batch.page_size, batch.seqlens, batch.max_seqlen, batch.positions, scale)
    codes = getattr(cache, "layer_codes", None)
    if codes is not None:
        kq, ks, vq, vs, kb, vb = codes(layer_idx)
        q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
        ops.store_kv_quant(kq, ks, vq, vs, batch.slots, k, v, kb, vb)
        # The step's own keys come unquantized from k/v, as a working copy would hold them.
        return ops.quant_attention(q, kq, ks, vq, vs, *where, kb, vb, batch.key_mask, k, v)
    k_cache, v_cache = cache.layer_kv(layer_idx)
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        q, k = ops.rope_store_kv(q, k, v, rope[0], rope[1], batch.rope_pos, k_cache, v_cache, batch.slots)
    else:
        q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
        ops.store_kv(k_cache, v_cache, batch.slots, k, v)
    if batch.past_len == 0 and batch.key_mask is None and batch.q_len > 1:
        # A first chunk into a contiguous cache, every row from position 0: torch's own causal SDPA over the
        # slice just written (its flash backend is as fast as any kernel here for this case).
        kc, vc = k_cache[:batch.batch_size, :batch.q_len], v_cache[:batch.batch_size, :batch.q_len]
        return ops.sdpa(q, kc, vc, scale, None, is_causal=True)
    return ops.paged_attention(q, k_cache, v_cache, *where, batch.key_mask)  # longer blocks: the flash kernel
