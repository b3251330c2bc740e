"""The modules of a Llama-family decoder: embedding, attention block, MLP block, final norm, head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from exlpy.config.config import ExLlamaV2Config
from exlpy.config.rope import cos_sin_table
from exlpy.kernels import ops
from exlpy.model.batch import ForwardBatch
from exlpy.model.fusion import FusedDense, FusedQuant, add_linear, fuse_linears
from exlpy.model.linear import Linear, load_linear
from exlpy.model.module import Module
from exlpy.weights.checks import landed


class RotaryTables:
    """cos/sin tables, built once per device and dtype from the config's current RoPE settings."""

    def __init__(self, config: ExLlamaV2Config) -> None:
        self.config = config
        self._tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(device), dtype)
        if key not in self._tables:
            c, s = self.config, self.config.spec
            assert s is not None
            # fp32 tables on the CPU reference path; the compute dtype on GPUs.
            self._tables[key] = cos_sin_table(s.head_dim, s.rope_theta, s.rope_scaling, c.scale_alpha_value,
                                              c.scale_pos_emb, c.max_seq_len, device, dtype)
        return self._tables[key]

    def clear(self) -> None:
        self._tables.clear()


class Embedding(Module):
    def __init__(self, config: ExLlamaV2Config) -> None:
        super().__init__(config, "model.embed_tokens")
        self.weight: torch.Tensor | None = None

    def load(self, device: torch.device) -> None:
        s = self.spec
        self.weight = landed(self.index, "model.embed_tokens.weight", self.index.get(
            "model.embed_tokens.weight", shape=(s.vocab_size, s.hidden_size)).to(device=device,
                                                                                 dtype=self.dtype(device)))
        self.device = device

    def unload(self) -> None:
        self.weight = None
        super().unload()

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.weight is not None
        return F.embedding(x, self.weight)


class RMSNorm(Module):
    """The final norm (the per-block norms live inside the blocks that use them)."""

    def __init__(self, config: ExLlamaV2Config, key: str = "model.norm") -> None:
        super().__init__(config, key)
        self.weight: torch.Tensor | None = None

    def load(self, device: torch.device) -> None:
        self.weight = load_norm(self, self.key, device)
        self.device = device

    def unload(self) -> None:
        self.weight = None
        super().unload()

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.weight is not None
        return ops.rms_norm(x, self.weight, self.spec.norm_eps)


def load_norm(m: Module, key: str, device: torch.device, size: int | None = None) -> torch.Tensor:
    size = size or m.spec.hidden_size
    return landed(m.index, f"{key}.weight", m.index.get(f"{key}.weight", shape=(size,)).to(device=device,
                                                                                         dtype=m.dtype(device)))


class Attention(Module):
    """Pre-norm attention block: x + o_proj(attn(rope(q), rope(k), v)) with GQA and a KV cache."""

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
        self.o_proj: Linear | None = None
        self.qkv_proj: FusedDense | FusedQuant | None = None  # q, k and v side by side when they can fuse

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
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if s.arch.qk_norm:
            self.q_norm_w = load_norm(self, f"{self.key}.q_norm", device, d)
            self.k_norm_w = load_norm(self, f"{self.key}.k_norm", device, d)
        self.device = device

    def unload(self) -> None:
        self.norm_w = self.q_norm_w = self.k_norm_w = None
        self.q_proj = self.k_proj = self.v_proj = self.o_proj = self.qkv_proj = None
        super().unload()

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.q_proj and self.k_proj and self.v_proj and self.o_proj and self.norm_w is not None
        B, T, _ = x.shape
        eps = self.spec.norm_eps
        if self.qkv_proj is not None:  # pre-norm fused into one q|k|v projection
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
        rope = self.rotary.get(x.device, x.dtype)
        o = self.attend(q, k, v, batch, rope)  # [B, T, Hq, D]
        return add_linear(x, self.o_proj, o.reshape(B, T, self.num_heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return attend(q, k, v, batch, batch.cache, self.layer_idx, self.scale, rope=rope)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, cache: object | None,
           layer_idx: int, scale: float, static: bool = False,
           rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of q [B,T,Hq,D] after writing k/v to `cache` (when there is one): [B,T,Hq,D].

    `static` forces the paged kernel, whose shapes do not depend on host-side lengths (CUDA graphs).
    `rope` = (cos, sin) tables: q and k arrive unrotated and are rotated here at `batch.rope_pos`, in the same
    kernel that writes the cache (one launch fewer per layer); without it q and k arrive rotated.
    """
    if cache is None:
        if rope is not None:
            q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
        mask = None
        if batch.key_mask is not None:
            causal = torch.ones(batch.q_len, batch.q_len, dtype=torch.bool, device=q.device).tril()
            mask = (causal.unsqueeze(0) & batch.key_mask[:, None, :batch.q_len]).unsqueeze(1)
        return ops.sdpa(q, k, v, scale, mask, is_causal=True)
    k_cache, v_cache = cache.layer_kv(layer_idx)  # type: ignore[attr-defined]
    assert batch.slots is not None and batch.block_table is not None and batch.seqlens is not None
    if rope is None:
        ops.store_kv(k_cache, v_cache, batch.slots, k, v)
    elif k_cache.is_contiguous() and v_cache.is_contiguous():
        # Quantized caches land here too: layer_kv hands out their contiguous fp16 working copies, the same
        # tensors store_kv would write.
        q, k = ops.rope_store_kv(q, k, v, rope[0], rope[1], batch.rope_pos, k_cache, v_cache, batch.slots)
    else:
        q, k = ops.apply_rope(q, k, rope[0], rope[1], batch.rope_pos)
        ops.store_kv(k_cache, v_cache, batch.slots, k, v)
    if not static and batch.past_len is not None and batch.key_mask is None and batch.q_len > 1:
        # Prefill into a contiguous cache, same past for every row: SDPA over a slice, no gather.
        # (Decode steps take the paged kernel below, as inside CUDA graphs: one path, same numerics.)
        end = batch.past_len + batch.q_len
        kc, vc = k_cache[:batch.batch_size, :end], v_cache[:batch.batch_size, :end]
        if batch.past_len == 0:
            return ops.sdpa(q, kc, vc, scale, None, is_causal=True)
        t = torch.arange(end, device=q.device)
        mask = t.view(1, -1) <= batch.positions[0].view(-1, 1)
        return ops.sdpa(q, kc, vc, scale, mask.view(1, 1, batch.q_len, end))
    return ops.paged_attention(q, k_cache, v_cache, batch.block_table, batch.page_size, batch.seqlens,
                               batch.max_seqlen, batch.positions, scale, batch.key_mask)


class MLP(Module):
    """Pre-norm SwiGLU block: x + down(silu(gate(h)) * up(h))."""

    def __init__(self, config: ExLlamaV2Config, layer_idx: int) -> None:
        super().__init__(config, f"model.layers.{layer_idx}.mlp")
        self.layer_idx = layer_idx
        self.norm_key = f"model.layers.{layer_idx}.post_attention_layernorm"
        self.norm_w: torch.Tensor | None = None
        self.gate_proj: Linear | None = None
        self.up_proj: Linear | None = None
        self.down_proj: Linear | None = None
        self.gate_up_proj: FusedDense | FusedQuant | None = None  # gate and up side by side when they can fuse

    def tensor_prefixes(self) -> list[str]:
        return [self.key, self.norm_key]

    def load(self, device: torch.device) -> None:
        s, dt, idx = self.spec, self.dtype(device), self.index
        kw = {"gptq_v2": s.gptq_v2, "bias": True if s.mlp_bias else None}
        self.norm_w = load_norm(self, self.norm_key, device)
        hid, inter = s.hidden_size, s.intermediate_size
        self.gate_proj = load_linear(idx, f"{self.key}.gate_proj", hid, inter, device, dt, **kw)
        self.up_proj = load_linear(idx, f"{self.key}.up_proj", hid, inter, device, dt, **kw)
        self.down_proj = load_linear(idx, f"{self.key}.down_proj", inter, hid, device, dt, **kw)
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        self.device = device

    def unload(self) -> None:
        self.norm_w = None
        self.gate_proj = self.up_proj = self.down_proj = self.gate_up_proj = None
        super().unload()

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.gate_proj and self.up_proj and self.down_proj and self.norm_w is not None
        eps = self.spec.norm_eps
        if self.gate_up_proj is not None:  # pre-norm and activation fused into one gate|up projection
            act = self.gate_up_proj.forward_normed_swiglu(x, self.norm_w, eps)
        else:
            h = ops.rms_norm(x, self.norm_w, eps)
            act = ops.silu_mul(self.gate_proj.forward(h), self.up_proj.forward(h))
        return add_linear(x, self.down_proj, act)


class Head(Module):
    """Output projection to the vocabulary; tied models fall back to the embedding table."""

    def __init__(self, config: ExLlamaV2Config) -> None:
        super().__init__(config, "lm_head")
        self.linear: Linear | None = None

    def tensor_prefixes(self) -> list[str]:
        if any(n.startswith("lm_head.") for n in self.index.tensors):
            return ["lm_head"]
        return ["model.embed_tokens"]

    def load(self, device: torch.device) -> None:
        s = self.spec
        dt = self.dtype(device)
        self.linear = load_linear(self.index, "lm_head", s.hidden_size, s.vocab_size, device, dt,
                                  fallback_prefix="model.embed_tokens" if s.tie_word_embeddings else None)
        self.device = device

    def unload(self) -> None:
        self.linear = None
        super().unload()

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.linear is not None
        return self.linear.forward(x)
