"""Byte arithmetic for placement: per-module weights, KV cache per layer, activation scratch per device.

Everything here is plain integers computed from shapes, so the planner can be fed from a real model (sizes
read from safetensors headers via `Module.loaded_bytes`) or from a synthetic description of a model nobody
has on disk (`synthetic_costs`), and tested on a machine without GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from exlpy.kernels.reference_moe import MOE_GATHER_BYTES, MOE_GATHER_MAX

MiB = 1024**2
GiB = 1024**3

# What a CUDA context costs on each device it touches (kernels, cuBLAS workspace, allocator bookkeeping).
# Measured figures on recent drivers with CUDA_MODULE_LOADING=LAZY are 300-500 MiB; we take the upper end so
# a plan that fits on paper fits in practice. Devices whose context already exists are not charged again (see
# memory.py).
CUDA_CONTEXT_BYTES = 500 * MiB

KINDS = ("embedding", "attention", "mlp", "norm", "head")


@dataclass(frozen=True)
class CacheSpec:
    """Storage cost of one cache type: bytes per K and V element (spec §5 table)."""

    name: str
    bytes_k: float
    bytes_v: float
    # Quantized caches also keep one K and one V buffer of full shape in the compute dtype per device,
    # dequantized on read (spec §5 "temp tensors").
    temp_per_device: bool = False


def _cache_types() -> dict[str, CacheSpec]:
    """The planner's cache types by name, read from the cache classes themselves (one source of widths)."""
    from exlpy.cache import (
        ExLlamaV2Cache,
        ExLlamaV2Cache_8bit,
        ExLlamaV2Cache_Q4,
        ExLlamaV2Cache_Q6,
        ExLlamaV2Cache_Q8,
    )

    classes = {"fp16": ExLlamaV2Cache, "fp8": ExLlamaV2Cache_8bit, "q4": ExLlamaV2Cache_Q4, "q6": ExLlamaV2Cache_Q6,
               "q8": ExLlamaV2Cache_Q8}
    return {name: replace(cache_spec_of(cls), name=name) for name, cls in classes.items()}




def cache_spec_of(cache: Any, act_bytes: int = 2) -> CacheSpec:
    """CacheSpec of a cache object or class (the one place cache widths are read): its
    `bytes_per_element_k/v`. None means an fp16 cache.

    An unquantized cache stores the compute dtype, which is fp32 on the CPU: `act_bytes` then wins.
    """
    if cache is None:
        return CacheSpec("fp16", float(act_bytes), float(act_bytes))
    name = cache.__name__ if isinstance(cache, type) else type(cache).__name__
    if getattr(cache, "k_bits", None) is not None:  # codes + scales only: attention reads them in place
        return CacheSpec(name, float(cache.bytes_per_element_k), float(cache.bytes_per_element_v))
    k, v = float(getattr(cache, "bytes_per_element_k", 2.0)), float(getattr(cache, "bytes_per_element_v", 2.0))
    if (k, v) == (2.0, 2.0):
        k = v = float(act_bytes)
    return CacheSpec(name, k, v)


CACHE_TYPES: dict[str, CacheSpec] = _cache_types()


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that size activations and the KV cache."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    moe_experts: int = 0  # experts per MoE layer (0: dense model)
    moe_top_k: int = 0  # experts per token
    moe_expert_size: int = 0  # intermediate features of one expert

    @classmethod
    def from_spec(cls, spec: Any) -> ModelShape:
        return cls(
            spec.hidden_size,
            spec.num_hidden_layers,
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
            spec.intermediate_size,
            spec.vocab_size,
            spec.moe.num_experts if spec.moe else 0,
            spec.moe.top_k if spec.moe else 0,
            spec.moe.expert_size if spec.moe else 0,
        )


@dataclass(frozen=True)
class RunShape:
    """Runtime sizes: cache length and batch, the forward chunk, logits rows, activation width."""

    max_seq_len: int
    batch_size: int = 1
    max_input_len: int = 2048
    max_output_len: int | None = None
    last_id_only: bool = False
    max_attention_size: int = 2048**2
    act_bytes: int = 2  # compute dtype width: fp16 on GPUs

    @property
    def chunk(self) -> int:
        """Tokens per row in one forward chunk (the cache length caps it, as in spec §6.3 step 1)."""
        return max(1, min(self.max_input_len, self.max_seq_len))

    def with_(self, **kw: Any) -> RunShape:
        return RunShape(**{**self.__dict__, **kw})

    @classmethod
    def from_config(
        cls, config: Any, max_seq_len: int, batch_size: int, last_id_only: bool, act_bytes: int
    ) -> RunShape:
        return cls(
            max_seq_len=max_seq_len,
            batch_size=batch_size,
            max_input_len=config.max_input_len,
            max_output_len=config.max_output_len,
            last_id_only=last_id_only,
            max_attention_size=config.max_attention_size,
            act_bytes=act_bytes,
        )


@dataclass(frozen=True)
class ModuleCost:
    """One entry of the module list: its kind, loaded weight bytes, and its layer (attention owns a cache
    layer)."""

    name: str
    kind: str
    weight_bytes: int
    layer_idx: int | None = None


def cache_bytes_per_layer(shape: ModelShape, run: RunShape, cache: CacheSpec) -> int:
    """K + V bytes of one layer: batch · max_seq_len · Hkv · D · (bytes_K + bytes_V)."""
    elems = run.batch_size * run.max_seq_len * shape.num_kv_heads * shape.head_dim
    return math.ceil(elems * (cache.bytes_k + cache.bytes_v))


def cache_temp_bytes(shape: ModelShape, run: RunShape, cache: CacheSpec) -> int:
    """Per-device dequantization buffers of a quantized cache (0 for unquantized ones)."""
    if not cache.temp_per_device:
        return 0
    return 2 * run.batch_size * run.max_seq_len * shape.num_kv_heads * shape.head_dim * run.act_bytes


def kv_bytes_per_token(shape: ModelShape, cache: CacheSpec) -> float:
    return shape.num_layers * shape.num_kv_heads * shape.head_dim * (cache.bytes_k + cache.bytes_v)


def scratch_by_kind(shape: ModelShape, run: RunShape) -> dict[str, int]:
    """Peak activation bytes while a module of each kind runs on a device, for one forward chunk.

    T = chunk · batch rows. Every module holds the incoming hidden state, its normed copy and its output
    (3·T·hidden). Attention adds q/k/v/o, the scores and probabilities of the largest attention chunk
    (max_attention_size bounds q_len·k_len per row) and the device's RoPE cos/sin tables; the MLP adds gate,
    up and their product; the head adds the logits rows in the compute dtype plus their fp32 copy.
    """
    a = run.act_bytes
    t = run.chunk * run.batch_size
    h, hq, hkv, d = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    base = 3 * t * h * a
    att_elems = min(run.max_attention_size, run.chunk * run.max_seq_len) * run.batch_size * hq
    attention = base + t * (2 * hq + 2 * hkv) * d * a + 2 * att_elems * a + 2 * run.max_seq_len * d * a
    mlp = base + 3 * t * shape.intermediate_size * a
    if shape.moe_experts:
        # MoE block: router logits (fp32), the routed copies of the tokens (k per token) in, out and re-ordered,
        # gate|up and their product per copy, and the expert weights a few-token step gathers (bounded).
        tk, inter = t * shape.moe_top_k, shape.moe_expert_size
        gathered = min(MOE_GATHER_BYTES, MOE_GATHER_MAX * 3 * h * inter * a)
        mlp = max(mlp, base + t * shape.moe_experts * 4 + 3 * tk * h * a + 3 * tk * inter * a + gathered)
    rows = 1 if run.last_id_only else min(run.max_output_len or run.max_input_len, run.chunk)
    head = base + rows * run.batch_size * shape.vocab_size * (a + 4)
    return {"embedding": base, "attention": attention, "mlp": mlp, "norm": base, "head": head}


def module_costs(modules: Sequence[Any], dtype_bytes: int) -> list[ModuleCost]:
    """Costs of a real model's module list, from safetensors headers only (no tensor data is read).

    An MoE block's cost is all of its experts: every expert stays resident on its device. (What a token reads
    per step is less, its k experts' weights; that matters for speed, not for placement.)"""
    out: list[ModuleCost] = []
    for m in modules:
        kind = type(m).__name__.lower()
        if kind == "rmsnorm":
            kind = "norm"
        if kind not in KINDS:
            kind = "mlp" if "mlp" in kind else "attention" if "attention" in kind else kind
        out.append(
            ModuleCost(
                m.key,
                kind,
                m.loaded_bytes(dtype_bytes),
                getattr(m, "layer_idx", None) if kind == "attention" else None,
            )
        )
    return out


def synthetic_costs(
    shape: ModelShape,
    dtype_bytes: int = 2,
    bits_per_weight: float | None = None,
    head_bits: float | None = None,
) -> list[ModuleCost]:
    """Costs of a Llama-shaped model from its dimensions alone (no files): dense when bits_per_weight is None,
    else quantized linears at that average width (norms and the embedding stay in the compute dtype)."""
    h, d = shape.hidden_size, shape.head_dim

    def linear(k: int, n: int, bits: float | None) -> int:
        return k * n * dtype_bytes if bits is None else math.ceil(k * n * bits / 8)

    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    attn = linear(h, q, bits_per_weight) + 2 * linear(h, kv, bits_per_weight) + linear(q, h, bits_per_weight)
    mlp = 3 * linear(h, shape.intermediate_size, bits_per_weight)
    norm = h * dtype_bytes
    costs = [ModuleCost("model.embed_tokens", "embedding", shape.vocab_size * h * dtype_bytes)]
    for i in range(shape.num_layers):
        costs.append(ModuleCost(f"model.layers.{i}.self_attn", "attention", attn + norm, i))
        costs.append(ModuleCost(f"model.layers.{i}.mlp", "mlp", mlp + norm))
    costs.append(ModuleCost("model.norm", "norm", norm))
    hb = head_bits if head_bits is not None else bits_per_weight
    costs.append(ModuleCost("lm_head", "head", linear(h, shape.vocab_size, hb)))
    return costs


def fmt_mib(n: float) -> str:
    return f"{n / MiB:,.0f} MiB"
