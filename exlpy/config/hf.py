"""Typed, validated view of a Hugging Face config.json (plus generation_config.json).

Parsed once into a frozen `ModelSpec`; nothing downstream reads the raw dict.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from exlpy.config.arch import ARCHITECTURES, ArchParams
from exlpy.config.rope import RopeScaling
from exlpy.errors import ConfigError, UnsupportedArchitectureError

_MISSING = object()


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    arch: ArchParams
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    gptq_v2: bool = False
    sliding_window: int | None = None
    quant_method: str | None = None
    raw_keys: frozenset[str] = field(default_factory=frozenset)


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} is not valid JSON: {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must hold a JSON object: {path}")
    return data


class _Reader:
    """Typed lookups with alternative key names, also under `text_config` (multimodal configs)."""

    def __init__(self, data: dict[str, Any], path: str) -> None:
        self.data = data
        self.path = path

    def get(self, keys: str | tuple[str, ...], typ: type, default: Any = _MISSING) -> Any:
        for key in (keys,) if isinstance(keys, str) else keys:
            for source in (self.data, self.data.get("text_config") or {}):
                if key in source and source[key] is not None:
                    value = source[key]
                    if typ is float and isinstance(value, int) and not isinstance(value, bool):
                        value = float(value)
                    if typ is int and isinstance(value, float) and value.is_integer():
                        value = int(value)
                    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                        raise ConfigError(f"{self.path}: '{key}' should be {typ.__name__}, got {value!r}")
                    return value
        if default is _MISSING:
            raise ConfigError(f"{self.path}: required key '{keys}' is missing")
        return default


def _first(v: Any) -> int | None:
    if isinstance(v, list):
        return int(v[0]) if v else None
    return None if v is None else int(v)


def _rope_scaling(r: _Reader, max_pos: int) -> RopeScaling:
    # transformers >= 5 writes `rope_parameters` (theta included); older configs write `rope_scaling`.
    rs = r.get("rope_scaling", dict, None) or r.get("rope_parameters", dict, None)
    if not rs:
        return RopeScaling()
    if "type" in rs and "rope_type" in rs and rs["type"] != rs["rope_type"]:
        raise ConfigError(f"{r.path}: rope_scaling has both 'type' and 'rope_type'")
    kind = rs.get("rope_type", rs.get("type"))
    factor = float(rs.get("factor", 1.0))
    orig = int(rs.get("original_max_position_embeddings") or r.get("original_max_position_embeddings", int, max_pos))
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "llama3":
        return RopeScaling("llama3", factor=factor, low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                           original_max_position_embeddings=orig)
    if kind == "yarn":
        for unsupported in ("mscale", "mscale_all_dim", "attention_factor"):
            if rs.get(unsupported) not in (None, 1, 1.0, 0):
                raise UnsupportedArchitectureError(f"{r.path}: rope_scaling.{unsupported} is not supported")
        return RopeScaling("yarn", factor=factor, original_max_position_embeddings=orig,
                           beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0))
    raise UnsupportedArchitectureError(
        f"{r.path}: rope_scaling type '{kind}' is not supported (supported: linear, llama3, yarn)")


def load_spec(model_dir: str) -> tuple[ModelSpec, list[int]]:
    """Parse config.json (+ generation_config.json). Returns the spec and generation EOS ids."""
    if not os.path.isdir(model_dir):
        raise ConfigError(f"model directory not found: {model_dir}")
    path = os.path.join(model_dir, "config.json")
    r = _Reader(_read_json(path, "config.json"), path)
    archs = r.get("architectures", list, None)
    if not archs:
        raise ConfigError(f"{path}: 'architectures' is missing or empty")
    if len(archs) != 1:
        raise ConfigError(f"{path}: Multiple architectures defined in config.json: {archs}")
    name = archs[0]
    if name not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: architecture '{name}' is not supported (supported: {', '.join(ARCHITECTURES)})")
    arch = ARCHITECTURES[name]

    hidden = r.get(("hidden_size", "d_model", "n_embd"), int)
    heads = r.get(("num_attention_heads", "n_heads", "n_head"), int)
    kv_heads = r.get("num_key_value_heads", int, heads)
    head_dim = r.get("head_dim", int, hidden // heads if heads else 0)
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ConfigError(f"{path}: num_attention_heads ({heads}) must be a positive multiple of "
                          f"num_key_value_heads ({kv_heads})")
    if head_dim <= 0 or head_dim % 2:
        raise ConfigError(f"{path}: head_dim {head_dim} must be positive and even")
    act = r.get(("hidden_act", "hidden_activation"), str, "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"{path}: hidden_act '{act}' is not supported (only 'silu')")
    if r.get("partial_rotary_factor", float, 1.0) != 1.0:
        raise UnsupportedArchitectureError(f"{path}: partial_rotary_factor != 1 is not supported")
    max_pos = r.get(("max_sequence_length", "model_max_length", "max_position_embeddings", "max_seq_len",
                     "n_positions"), int, 2048)
    sliding = r.get("sliding_window", int, None)
    if r.get("use_sliding_window", bool, False):
        raise UnsupportedArchitectureError(f"{path}: use_sliding_window=true is not supported")
    if sliding is not None and arch.ignores_sliding_window and sliding < max_pos:
        warnings.warn(f"{name}: sliding_window={sliding} is ignored (full attention is used), as exllamav2 does",
                      stacklevel=3)
    qc = r.get("quantization_config", dict, {}) or {}
    quant_method = qc.get("quant_method")
    if quant_method not in (None, "exl2", "gptq"):
        raise UnsupportedArchitectureError(f"{path}: quantization method '{quant_method}' is not supported "
                                           "(supported: EXL2, GPTQ 4-bit)")

    gen_eos: list[int] = []
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        g = _read_json(gen_path, "generation_config.json").get("eos_token_id")
        gen_eos = [int(x) for x in (g if isinstance(g, list) else [g] if g is not None else [])]
    eos_raw = r.data.get("eos_token_id")
    eos_all = tuple(int(x) for x in (eos_raw if isinstance(eos_raw, list) else [eos_raw] if eos_raw is not None
                                     else []))
    spec = ModelSpec(
        architecture=name, arch=arch,
        vocab_size=r.get("vocab_size", int),
        hidden_size=hidden,
        num_hidden_layers=r.get(("num_hidden_layers", "n_layers", "n_layer"), int),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=r.get(("intermediate_size", "n_inner"), int),
        norm_eps=r.get("rms_norm_eps", float, 1e-5),
        rope_theta=float(r.get("rope_theta", float, None) or (r.get("rope_parameters", dict, None) or {}).get(
            "rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(r, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=r.get("tie_word_embeddings", bool, False),
        attention_bias=r.get("attention_bias", bool, False),
        mlp_bias=r.get("mlp_bias", bool, False),
        bos_token_id=_first(r.data.get("bos_token_id")),
        eos_token_id=_first(eos_raw),
        pad_token_id=_first(r.data.get("pad_token_id")),
        eos_token_ids=eos_all,
        torch_dtype=r.get(("torch_dtype", "dtype"), str, None),
        gptq_v2=qc.get("checkpoint_format") == "gptq_v2",
        sliding_window=sliding,
        quant_method=quant_method,
        raw_keys=frozenset(r.data),
    )
    if spec.vocab_size <= 0 or spec.num_hidden_layers <= 0 or spec.intermediate_size <= 0:
        raise ConfigError(f"{path}: vocab_size, num_hidden_layers and intermediate_size must be positive")
    return spec, gen_eos
