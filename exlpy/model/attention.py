"""The attention block: x + o_proj(attention(rope(q), rope(k), v)) with GQA and a KV cache (plus, where the
architecture has them, a post-norm, q/k norms, a sliding window and soft-capped scores)."""

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
from exlpy.model.norm import Norm, block_norm, fused_norm_ok, load_norm, load_norm_tensors, reads
from exlpy.model.parallel_linear import ColumnParallel, RowParallel, close_block, project
from exlpy.model.rotary import RotaryTables


class Attention(Module):
    """Pre-norm attention block. Under tensor parallelism a copy holds this GPU's heads (num_heads and
    num_kv_heads are then its share) and o_proj is a RowParallel / ColumnParallel that sums over GPUs.

    What an architecture changes is fixed at load (exlpy/config/arch.py): the pre-norm's kind (`pre_norm`
    below), an optional post-norm of the output (Gemma 2, GLM-4), q/k norms, the RoPE table and head
    permutation of this layer, its sliding window, score soft-capping and scale, and whether the normed input
    is handed to the MLP beside it (parallel blocks)."""

    def __init__(self, config: ExLlamaV2Config, layer_idx: int, rotary: RotaryTables) -> None:
        super().__init__(config, f"model.layers.{layer_idx}.self_attn")
        self.layer_idx = layer_idx
        self.rotary = rotary
        s = self.spec
        f = s.features
        self.num_heads = s.num_attention_heads
        self.num_kv_heads = s.num_key_value_heads
        self.head_dim = s.head_dim
        self.scale = f.attn_scale or 1.0 / math.sqrt(s.head_dim)
        self.window = f.layer_window[layer_idx] if f.layer_window else 0
        self.softcap = f.attn_softcap
        self.use_rope = f.layer_rope[layer_idx] if f.layer_rope else True
        self.rope_local = bool(self.window) and s.rope_local_theta is not None  # Gemma 3's local RoPE base
        self.parallel = s.arch.parallel_blocks
        norms = dict(s.arch.norms)
        self.norm_key = f"model.layers.{layer_idx}.{norms['attn_pre']}"
        self.post_key = f"model.layers.{layer_idx}.{norms['attn_post']}" if "attn_post" in norms else None
        self.norm_w: torch.Tensor | None = None
        self.norm_b: torch.Tensor | None = None  # LayerNorm bias
        self.post_norm: Norm | None = None
        self.q_norm_w: torch.Tensor | None = None
        self.k_norm_w: torch.Tensor | None = None
        self.q_proj: Linear | None = None
        self.k_proj: Linear | None = None
        self.v_proj: Linear | None = None
        self.o_proj: Linear | RowParallel | ColumnParallel | None = None
        self.qkv_proj: FusedDense | FusedQuant | None = None  # q, k and v side by side when they can fuse
        self.lora: Any = None  # LoRA slot buffers and hooks, attached by exlpy/lora/ while adapters are in use

    def tensor_prefixes(self) -> list[str]:
        return [self.key, self.norm_key] + ([self.post_key] if self.post_key else [])

    def load(self, device: torch.device) -> None:
        s, dt, idx = self.spec, self.dtype(device), self.index
        f = s.features
        hq, hk, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        kw: dict[str, Any] = {"gptq_v2": s.gptq_v2}
        self.norm_w, self.norm_b = load_norm_tensors(self, self.norm_key, device)
        kb = {**kw, "bias": True if f.qkv_bias else None}
        self.q_proj = load_linear(idx, f"{self.key}.q_proj", s.hidden_size, hq, device, dt, **kb)
        self.k_proj = load_linear(idx, f"{self.key}.k_proj", s.hidden_size, hk, device, dt, **kb)
        self.v_proj = load_linear(idx, f"{self.key}.v_proj", s.hidden_size, hk, device, dt, **kb)
        # Granite / MiniCPM residual multipliers scale the block's output: folded into o_proj, as exllamav2.
        self.o_proj = load_linear(idx, f"{self.key}.o_proj", hq, s.hidden_size, device, dt,
                                  **{**kw, "bias": True if f.o_bias else None}, prescale=f.residual_scale)
        self.fuse()
        if self.post_key is not None:
            self.post_norm = load_norm(self, self.post_key, device)
        if f.qk_norm:
            shapes = [(d,), (self.num_heads, d)]
            self.q_norm_w = load_norm_tensors(self, f"{self.key}.q_norm", device, shapes)[0]
            self.k_norm_w = load_norm_tensors(self, f"{self.key}.k_norm", device, [(d,), (self.num_kv_heads, d)])[0]
        self.device = device

    def fuse(self) -> None:
        assert self.q_proj and self.k_proj and self.v_proj
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def unload(self) -> None:
        self.norm_w = self.norm_b = self.q_norm_w = self.k_norm_w = self.post_norm = None
        self.q_proj = self.k_proj = self.v_proj = self.o_proj = self.qkv_proj = self.lora = None
        super().unload()

    def pre_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The block's input norm, in the compute dtype (the residual may be fp32)."""
        assert self.norm_w is not None
        return block_norm(x, self.norm_w, self.norm_b, self.spec).to(self.norm_w.dtype)

    async def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.q_proj and self.k_proj and self.v_proj and self.o_proj and self.norm_w is not None
        B, T, _ = x.shape
        s = self.spec
        lora = self.lora if batch.lora else None  # rows with LoRA adapters (exlpy/lora/block.py)
        pre = batch.take_prenormed(x)  # the norm of x, computed by the collective that summed x (TP)
        if lora is not None:
            q, k, v = lora.project_qkv(self, x, batch)
        elif pre is not None and self.qkv_proj is not None and not self.parallel:
            q, k, v = self.qkv_proj.forward(pre).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1)
        elif self.qkv_proj is not None and fused_norm_ok(s) and not self.parallel and reads(self.qkv_proj, x):
            # pre-norm fused into one q|k|v projection
            q, k, v = self.qkv_proj.forward_normed(x, self.norm_w, s.norm_eps).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1)
        else:
            h = self.pre_norm(x)
            if self.parallel:
                batch.block_inputs[self.layer_idx] = h  # the MLP beside this attention reads the same input
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj.forward(h).split(
                    [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1)
            else:
                q, k, v = self.q_proj.forward(h), self.k_proj.forward(h), self.v_proj.forward(h)
        if s.features.clip_qkv:
            c = s.features.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm_w is not None and self.k_norm_w is not None:
            q = block_norm(q, self.q_norm_w, None, s)
            k = block_norm(k, self.k_norm_w, None, s)
        perm = self.rotary.permutation(x.device)
        if perm is not None:  # GPT-J or partial rotary: the dimensions NEOX rotates first (rotary.py)
            q, k = q.index_select(-1, perm), k.index_select(-1, perm)
        if batch.mm is not None and batch.mm.rope is not None:  # M-RoPE rows of this chunk's tokens
            rope = batch.mm.table(x.device, self.rotary.get(x.device, q.dtype, self.use_rope)[0].dtype)
        else:
            rope = self.rotary.get(x.device, q.dtype, self.use_rope, self.rope_local)
        o = attend(q, k, v, batch, self.layer_idx, self.scale, rope, self.window, self.softcap)
        o = o.reshape(B, T, self.num_heads * self.head_dim)
        closing = lora.closing(batch, "o") if lora is not None else None
        if self.post_norm is None:
            return await close_block(x, self.o_proj, o, closing, None if batch.lora else batch)
        return self.post_norm.add_to(x, await project(self.o_proj, o, x, closing))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, layer_idx: int, scale: float,
           rope: tuple[torch.Tensor, torch.Tensor], window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of q [B,T,Hq,D] after writing k/v to `batch.cache` (when there is one): [B,T,Hq,D].

    q and k arrive unrotated and are rotated here at `batch.rope_pos` (in the kernel that writes the cache,
    where it can). Over a cache the kernels read K/V where they lie, at the cache's own width: the split-K
    decode kernel for one token per row, the flash kernel for longer blocks (chunked prefill, speculative
    verification), the quantized-cache kernels for Q4/Q6/Q8/FP8 caches (no fp16 working copy). `window` > 0:
    a query sees only the `window` most recent positions (itself included); `softcap` > 0: scores are
    soft-capped. The cache keeps every position either way (the window is a mask, not a ring buffer).

    A chunk holding Gemma 3 image tokens (`batch.mm.spans`) runs the same kernels with per-query key limits: an
    image token also sees the later tokens of its image (exlpy/vision/attention.py).
    """
    spans = batch.mm.spans if batch.mm is not None else None
    limits = spans.limits(batch.positions) if spans is not None else None
    cache = batch.cache
    feats: dict[str, Any] = {"window": window, "softcap": softcap}
    if limits is not None:
        feats["limits"] = limits
    if cache is None:
        q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
        mask = None
        if spans is not None:  # built once per forward pass and window, shared by the layers
            mask = spans.self_mask(q.device, window, batch.key_mask)
        elif batch.key_mask is not None or window:
            i = torch.arange(batch.q_len, device=q.device)
            keep = i.view(-1, 1) >= i.view(1, -1)
            if window:
                keep = keep & (i.view(-1, 1) - i.view(1, -1) < window)
            mask = keep.unsqueeze(0)
            if batch.key_mask is not None:
                mask = mask & batch.key_mask[:, None, :batch.q_len]
            mask = mask.unsqueeze(1)
        return ops.sdpa(q, k, v, scale, mask, is_causal=True, softcap=softcap)
    if batch.segments is not None:
        return attend_mixed(q, k, v, batch, layer_idx, scale, rope, window, softcap)
    assert batch.slots is not None and batch.block_table is not None and batch.seqlens is not None
    where = (batch.block_table, batch.page_size, batch.seqlens, batch.max_seqlen, batch.positions, scale)
    q, k = rope_store(q, k, v, batch, layer_idx, rope)
    codes = getattr(cache, "layer_codes", None)
    if codes is not None:
        kq, ks, vq, vs, kb, vb = codes(layer_idx)
        # The step's own keys come unquantized from k/v, as a working copy would hold them.
        return ops.quant_attention(q, kq, ks, vq, vs, *where, kb, vb, batch.key_mask, k, v, **feats)
    k_cache, v_cache = cache.layer_kv(layer_idx)
    if batch.past_len == 0 and batch.key_mask is None and batch.q_len > 1 and not (window or softcap or spans):
        # A first chunk into a contiguous cache, every row from position 0: torch's own causal SDPA over the
        # slice just written (its flash backend is as fast as any kernel here for this case).
        kc, vc = k_cache[:batch.batch_size, :batch.q_len], v_cache[:batch.batch_size, :batch.q_len]
        return ops.sdpa(q, kc, vc, scale, None, is_causal=True)
    # longer blocks, windows and soft-caps: the flash kernel
    return ops.paged_attention(q, k_cache, v_cache, *where, batch.key_mask, **feats)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, layer_idx: int,
               rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at `batch.rope_pos` and write k/v to the cache rows `batch.slots` (one kernel where the
    cache allows); returns the rotated (q, k)."""
    cache = batch.cache
    codes = getattr(cache, "layer_codes", None)
    if codes is not None:
        kq, ks, vq, vs, kb, vb = codes(layer_idx)
        q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
        ops.store_kv_quant(kq, ks, vq, vs, batch.slots, k, v, kb, vb)
        return q, k
    k_cache, v_cache = cache.layer_kv(layer_idx)
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        return ops.rope_store_kv(q, k, v, rope[0], rope[1], batch.rope_pos, k_cache, v_cache, batch.slots)
    q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
    ops.store_kv(k_cache, v_cache, batch.slots, k, v)
    return q, k


def attend_mixed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, layer_idx: int,
                 scale: float, rope: tuple[torch.Tensor, torch.Tensor], window: int = 0,
                 softcap: float = 0.0) -> torch.Tensor:
    """`attend` for a mixed pass (model/batch.py `mixed_batch`): q/k/v [1, N, H, D] of several segments. Every
    token's K/V is written first, then each segment's queries attend over their rows' pages with the kernel for
    their q_len (the split-K decode kernel for the decode rows, the flash kernel for a prompt chunk). A decode row
    of a job whose last prompt chunk is in the same pass therefore sees that chunk, as it would one pass later."""
    assert batch.segments is not None and batch.slots is not None
    q, k = rope_store(q, k, v, batch, layer_idx, rope)
    feats = {"window": window, "softcap": softcap}
    codes = getattr(batch.cache, "layer_codes", None)
    outs = []
    for seg in batch.segments:
        s = seg.batch
        assert s.block_table is not None and s.seqlens is not None
        n = s.batch_size * s.q_len
        # this segment's tokens as its rows x q_len
        sq, sk, sv = (t[0, seg.start:seg.start + n].reshape(s.batch_size, s.q_len, *t.shape[2:]) for t in (q, k, v))
        where = (s.block_table, s.page_size, s.seqlens, s.max_seqlen, s.positions, scale)
        if codes is not None:
            kq, ks, vq, vs, kb, vb = codes(layer_idx)
            o = ops.quant_attention(sq, kq, ks, vq, vs, *where, kb, vb, None, sk, sv, **feats)
        else:
            k_cache, v_cache = batch.cache.layer_kv(layer_idx)
            o = ops.paged_attention(sq, k_cache, v_cache, *where, None, **feats)
        outs.append(o.reshape(1, n, *o.shape[2:]))
    return torch.cat(outs, dim=1)
