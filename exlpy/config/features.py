"""The output-changing features of a config.json beyond the Llama shape, parsed once into `ModelFeatures`.

Every key here changes the model's logits. Keys exlpy knows to change outputs but does not implement are
refused by name (`UNSUPPORTED`): a model must never run silently wrong.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from exlpy.config.arch import ArchParams
from exlpy.config.values import MAX_POSITIONS, as_int, as_positive_float
from exlpy.errors import ConfigError, UnsupportedArchitectureError

# Activation names of config.json -> the function exlpy runs (kernels/reference.py `act`).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu", "gelu_python": "gelu", "relu": "relu"}

# key -> (value that is harmless, why it is refused otherwise)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "use_sliding_window": (False, "sliding windows on this architecture"),
    "qk_layernorm": (False, "q/k LayerNorm on this architecture"),
    "use_bidirectional_attention": (False, "bidirectional attention"),
    "alibi": (False, "ALiBi position biases"),
    "scale_attn_by_inverse_layer_idx": (False, "attention scaled by the inverse layer index"),
    "scale_attn_weights": (True, "unscaled attention scores"),
    "use_parallel_residual": (None, "parallel residual blocks on this architecture"),
    "mup_width_multiplier": (None, "muP width scaling"),
    "add_cross_attention": (False, "cross-attention layers"),
    "rotary_pct": (1.0, "partial rotary embeddings given as rotary_pct (GPT-NeoX)"),
}


class Reader(Protocol):
    path: str

    def get(self, keys: str | tuple[str, ...], typ: type, default: Any = ...) -> Any: ...


@dataclass(frozen=True)
class ModelFeatures:
    act: str = "silu"  # silu | gelu_tanh | gelu | relu
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tied_head: bool = False  # the head may fall back to the embedding table
    rotary_dim: int = 0  # dimensions of a head that RoPE rotates (0: none, learned positions)
    layer_window: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = full attention
    layer_rope: tuple[bool, ...] = ()  # per layer: RoPE applied (Cohere 2's global layers have none)
    clip_qkv: float = 0.0  # q, k and v clamped to [-c, c] after their projection (DBRX), 0: not clamped
    attn_scale: float = 0.0  # softmax scale of q.k
    attn_softcap: float = 0.0  # cap * tanh(score / cap) when > 0
    final_softcap: float = 0.0
    logit_scale: float = 1.0  # logits multiplied by it
    embed_scale: float = 1.0  # embeddings multiplied by it
    residual_scale: float = 1.0  # block outputs multiplied by it before the residual add
    norm_head: bool = False  # head rows L2-normalized at load
    learned_positions: int = 0  # rows of the learned position table (GPT-2), 0 without one


def _float(r: Reader, key: str | tuple[str, ...], default: float, *, allow_zero: bool = False) -> float:
    value = r.get(key, float, None)
    if value is None:
        return default
    return as_positive_float(value, key if isinstance(key, str) else key[0], r.path, allow_zero=allow_zero)


def _rotary_dim(r: Reader, arch: ArchParams, head_dim: int) -> int:
    if arch.rope_style == "none":
        return 0
    factor = r.get("partial_rotary_factor", float, None)
    if factor is None:
        factor = (r.get("rope_parameters", dict, None) or {}).get("partial_rotary_factor", 1.0)
    factor = as_positive_float(factor, "partial_rotary_factor", r.path)
    rot = int(head_dim * factor)
    if factor > 1 or rot % 2 or rot == 0:
        raise ConfigError(f"{r.path}: partial_rotary_factor {factor} gives {rot} rotary dimensions of head_dim "
                          f"{head_dim} (must be even, in [2, head_dim])")
    return rot


def _windows(r: Reader, arch: ArchParams, layers: int, max_pos: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    key, window = "sliding_window", r.get("sliding_window", int, None)
    if window is None:
        key, window = "sliding_window_size", r.get("sliding_window_size", int, None)
    types = r.get("layer_types", list, None)
    if types is not None and (len(types) != layers or any(t not in ("full_attention", "sliding_attention")
                                                          for t in types)):
        raise ConfigError(f"{r.path}: 'layer_types' must list 'full_attention' or 'sliding_attention' for each of "
                          f"the {layers} layers")
    full = (0,) * layers, (True,) * layers
    if arch.ignores_sliding_window:
        if window is not None and window < max_pos:
            warnings.warn(f"{arch.name}: sliding_window={window} is ignored (full attention is used), as exllamav2 "
                          "does", stacklevel=4)
        return full
    if not arch.sliding_window:
        if types is not None and "sliding_attention" in types:
            raise UnsupportedArchitectureError(f"{r.path}: 'layer_types' asks for sliding-window layers, which "
                                               f"{arch.name} does not have in exllamav2")
        return full
    if window is None or window == 0:
        return full
    window = as_int(window, key, r.path, 1, MAX_POSITIONS)
    if types is not None:
        local = [t == "sliding_attention" for t in types]
    elif arch.swa_pattern:
        n = as_int(r.get("sliding_window_pattern", int, arch.swa_pattern), "sliding_window_pattern", r.path, 1,
                   layers + 1)
        local = [(i % n == 0) if arch.swa_first_local else ((i + 1) % n != 0) for i in range(layers)]
    else:
        local = [True] * layers
    rope = tuple(is_local or arch.rope_on_global for is_local in local)
    return tuple(window if is_local else 0 for is_local in local), rope


def _refuse_unimplemented(r: Reader, arch: ArchParams) -> None:
    if not arch.rope_local and r.get("rope_local_base_freq", object, None) is not None:
        raise UnsupportedArchitectureError(f"{r.path}: 'rope_local_base_freq' asks for a separate RoPE base for "
                                           f"local layers (Gemma 3), which {arch.name} does not have")
    for key, (harmless, what) in UNSUPPORTED.items():
        value = r.get(key, object, None)
        if value is not None and value != harmless:
            raise UnsupportedArchitectureError(f"{r.path}: '{key}' = {value!r:.60} asks for {what}, which exlpy "
                                               "does not implement")


def parse_features(r: Reader, arch: ArchParams, hidden: int, head_dim: int, layers: int, max_pos: int
                   ) -> ModelFeatures:
    _refuse_unimplemented(r, arch)
    act_key, act = "hidden_act", r.get(("hidden_act", "hidden_activation", "activation_function",
                                        "ffn_config.ffn_act_fn.name"), str, arch.default_act)
    if act not in ACTIVATIONS:
        raise UnsupportedArchitectureError(f"{r.path}: {act_key} '{act}' is not supported (supported: "
                                           f"{', '.join(ACTIVATIONS)})")
    attn_bias = r.get("attention_bias", bool, False)
    use_bias = r.get("use_bias", bool, None)  # Starcoder2: every linear
    mlp_bias = r.get("mlp_bias", bool, False)
    # Attention scale: attention_multiplier (Granite) wins over query_pre_attn_scalar (Gemma 2).
    scale = 1.0 / math.sqrt(head_dim)
    qpas = r.get("query_pre_attn_scalar", float, None)
    if qpas is not None:
        scale = as_positive_float(qpas, "query_pre_attn_scalar", r.path) ** -0.5
    scale = _float(r, "attention_multiplier", scale)
    # Logit scale: Cohere multiplies, Granite divides, MiniCPM divides by hidden / dim_model_base.
    logit_scale = _float(r, "logit_scale", 1.0)
    logit_scale /= _float(r, "logits_scaling", 1.0)
    base = r.get("dim_model_base", float, None)
    if base is not None:
        logit_scale /= hidden / as_positive_float(base, "dim_model_base", r.path)
    residual = r.get("residual_multiplier", float, None)
    if residual is None and r.get("scale_depth", float, None) is not None:
        residual = _float(r, "scale_depth", 1.0) / math.sqrt(layers)
    embed_scale = _float(r, ("scale_emb", "embedding_multiplier"), 1.0)
    if arch.normalize_embeddings:
        embed_scale *= math.sqrt(hidden)
    windows, rope = _windows(r, arch, layers, max_pos)
    return ModelFeatures(
        act=ACTIVATIONS[act],
        qk_norm=arch.qk_norm or r.get("use_qk_norm", bool, False),
        qkv_bias=arch.qkv_bias or attn_bias or bool(use_bias),
        o_bias=arch.o_bias or bool(use_bias),  # attention_bias: o_proj.bias is loaded when stored (not GLM-4)
        mlp_bias=arch.mlp_bias or mlp_bias or bool(use_bias),
        tied_head=arch.tied_head or r.get("tie_word_embeddings", bool, False),
        rotary_dim=_rotary_dim(r, arch, head_dim),
        layer_window=windows, layer_rope=rope,
        clip_qkv=_float(r, ("clip_qkv", "attn_config.clip_qkv"), 0.0),
        attn_scale=scale,
        attn_softcap=_float(r, "attn_logit_softcapping", 0.0, allow_zero=True),
        final_softcap=_float(r, "final_logit_softcapping", 0.0, allow_zero=True),
        logit_scale=logit_scale,
        embed_scale=embed_scale,
        residual_scale=1.0 if residual is None else as_positive_float(residual, "residual_multiplier", r.path),
        norm_head=r.get("norm_head", bool, False),
        learned_positions=max_pos if arch.rope_style == "none" else 0,
    )
