"""Typed, validated view of a Hugging Face config.json (plus generation_config.json).

Parsed once into a frozen `ModelSpec`; nothing downstream reads the raw dict.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from exlpy.config.arch import ARCHITECTURES, FALLBACK, NOT_YET, ArchParams
from exlpy.config.features import ModelFeatures, parse_features
from exlpy.config.moe import MoESpec, parse_moe
from exlpy.config.rope import RopeScaling, parse_rope_scaling
from exlpy.config.values import (
    MAX_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    as_int,
    as_positive_float,
    as_token_ids,
)
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
    features: ModelFeatures = field(default_factory=ModelFeatures)
    moe: MoESpec | None = None  # mixture-of-experts settings (None: every layer has the dense MLP)
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of sliding-window layers (default scaling)
    mrope_section: tuple[int, ...] = ()  # M-RoPE (Qwen2-VL): rotary frequencies per t / h / w section

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` has an MoE block in place of the dense MLP."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def norm_kind(self) -> str:
        return self.arch.norm


def _read_json(path: str, what: str) -> dict[str, Any]:
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block open() forever
        kind = "a directory" if os.path.isdir(path) else "not a regular file"
        raise ConfigError(f"{what} is {kind}: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what}: {path}: {e.strerror or e}") from e
    except RecursionError:
        raise ConfigError(f"{what} is not valid JSON: {path}: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and integers past Python's digit limit
        raise ConfigError(f"{what} is not valid JSON: {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must hold a JSON object: {path}")
    return data


class _Reader:
    """Typed lookups with alternative key names, also under `text_config` (multimodal configs)."""

    def __init__(self, data: dict[str, Any], path: str) -> None:
        self.data = data
        self.path = path
        text = data.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise ConfigError(f"{path}: 'text_config' should be an object, got {type(text).__name__}")
        self.text: dict[str, Any] = text or {}

    def find(self, keys: str | tuple[str, ...]) -> tuple[str, Any]:
        """(key, value) of the first of `keys` set (not null) in the config or its text_config, else
        (first key, _MISSING)."""
        names = (keys,) if isinstance(keys, str) else keys
        for key in names:
            *outer, leaf = key.split(".")  # "attn_config.kv_n_heads": a key of a nested object (DBRX)
            for source in (self.data, self.text):
                for part in outer:
                    source = source.get(part) if isinstance(source, dict) else None
                if isinstance(source, dict) and source.get(leaf) is not None:
                    return key, source[leaf]
        return names[0], _MISSING

    def get(self, keys: str | tuple[str, ...], typ: type, default: Any = _MISSING) -> Any:
        key, value = self.find(keys)
        if value is _MISSING:
            if default is _MISSING:
                raise ConfigError(f"{self.path}: required key '{key}' is missing")
            return default
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value) if abs(value) < 1e308 else math.inf  # 10**400 is no float
        if typ is int and isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ConfigError(f"{self.path}: '{key}' should be {typ.__name__}, got {value!r:.60}")
        return value

    def size(self, keys: str | tuple[str, ...], hi: int, default: int | None = None) -> int:
        """A positive integer at most `hi`, named by the key actually found."""
        key, value = self.find(keys)
        if value is _MISSING:
            if default is None:
                raise ConfigError(f"{self.path}: required key '{key}' is missing")
            value = default
        return as_int(value, key, self.path, 1, hi)


def _rope_dict(r: _Reader) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters` (theta included; per layer type for Gemma 3: the global layers'
    # set is the model's, the sliding layers' one gives rope_local_theta); older configs write `rope_scaling`.
    rs = r.get("rope_scaling", dict, None) or r.get("rope_parameters", dict, None) or {}
    if isinstance(rs.get("full_attention"), dict):
        rs = rs["full_attention"]
    return rs


def _rope_local_theta(r: _Reader, arch: ArchParams) -> float | None:
    if not arch.rope_local:
        return None
    params = r.get("rope_parameters", dict, None) or {}
    local = params.get("sliding_attention")
    if isinstance(local, dict):
        kind = local.get("rope_type", local.get("type", "default"))
        if kind not in (None, "default"):
            raise UnsupportedArchitectureError(f"{r.path}: rope_parameters.sliding_attention type {kind!r} is not "
                                               "supported (local layers take a plain RoPE base)")
        theta = local.get("rope_theta", 10000.0)
    else:
        theta = r.get("rope_local_base_freq", float, 10000.0)
    return as_positive_float(theta, "rope_local_base_freq", r.path)


def _mrope_section(r: _Reader, arch: ArchParams, head_dim: int) -> tuple[int, ...]:
    """rope_scaling.mrope_section of an M-RoPE architecture: three section sizes summing to head_dim / 2."""
    rs = _rope_dict(r)
    sections = rs.get("mrope_section")
    if not arch.mrope:
        if sections is not None or "mrope" in (rs.get("type"), rs.get("rope_type")):
            raise UnsupportedArchitectureError(f"{r.path}: rope_scaling.mrope_section (M-RoPE) is only supported "
                                               f"for Qwen2-VL / Qwen2.5-VL, not {arch.name}")
        return ()
    if sections is None:
        sections = [16, 24, 24]  # transformers' default
    if (not isinstance(sections, list) or len(sections) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sections)
            or sum(sections) * 2 != head_dim):
        raise ConfigError(f"{r.path}: rope_scaling.mrope_section must be three non-negative integers summing to "
                          f"head_dim / 2 = {head_dim // 2}, got {sections!r:.60}")
    return tuple(sections)


def _rope_scaling(r: _Reader, max_pos: int) -> RopeScaling:
    rs = dict(_rope_dict(r))
    if not rs:
        return RopeScaling()
    # M-RoPE is ordinary RoPE in three position streams (exlpy/vision/mm.py): its type names no scaling.
    for key in ("type", "rope_type"):
        if rs.get(key) == "mrope":
            rs.pop(key)
    rs.pop("mrope_section", None)
    orig = r.get("original_max_position_embeddings", int, max_pos)
    return parse_rope_scaling(rs, r.path, as_int(orig, "original_max_position_embeddings", r.path, 1, MAX_POSITIONS),
                              max_pos)


def _rope_theta(r: _Reader) -> float:
    theta = r.get(("rope_theta", "attn_config.rope_theta"), float, None)
    if theta is None:
        theta = _rope_dict(r).get("rope_theta", 10000.0)
    return as_positive_float(theta, "rope_theta", r.path)


def _norm_eps(r: _Reader, arch: ArchParams) -> float:
    key, value = r.find(arch.norm_eps_keys)
    return as_positive_float(1e-5 if value is _MISSING else value, key, r.path)


def _token_id(r: _Reader, key: str) -> int | None:
    value = r.data.get(key) if r.data.get(key) is not None else r.text.get(key)
    ids = as_token_ids(value, key, r.path)
    return ids[0] if ids else None


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
    if not isinstance(name, str):
        raise ConfigError(f"{path}: 'architectures' should hold a class name string, got {name!r:.60}")
    if name in NOT_YET:
        raise UnsupportedArchitectureError(f"{path}: architecture '{name}' ({NOT_YET[name]}) is not supported yet")
    if name not in ARCHITECTURES:
        # exllamav2 runs an unknown architecture as Llama, with a warning; so do we (the tensor key check and
        # the refusal of unimplemented config keys still apply).
        warnings.warn(f"{path}: unknown architecture '{name}', loading it as {FALLBACK} (known: "
                      f"{', '.join(ARCHITECTURES)})", stacklevel=2)
    arch = ARCHITECTURES.get(name, ARCHITECTURES[FALLBACK])

    hidden = r.size(("hidden_size", "d_model", "n_embd"), MAX_DIM)
    heads = r.size(("num_attention_heads", "n_heads", "n_head"), MAX_HEADS)
    kv_heads = r.size(("num_key_value_heads", "attn_config.kv_n_heads"), MAX_HEADS,
                      1 if r.get("multi_query", bool, False) else heads)
    head_dim = r.size("head_dim", MAX_DIM, max(hidden // heads, 1))
    if heads % kv_heads:
        raise ConfigError(f"{path}: num_attention_heads ({heads}) must be a positive multiple of "
                          f"num_key_value_heads ({kv_heads})")
    if head_dim % 2:
        raise ConfigError(f"{path}: head_dim {head_dim} must be positive and even")
    max_pos = r.size(("max_sequence_length", "model_max_length", "max_position_embeddings", "max_seq_len",
                    "n_positions"), MAX_POSITIONS, 2048)
    sliding = r.get("sliding_window", int, None)
    if sliding is not None and sliding < 0:
        raise ConfigError(f"{path}: sliding_window must be a positive number of tokens or null, got {sliding}")
    layers = r.size(("num_hidden_layers", "n_layers", "n_layer"), MAX_LAYERS)
    features = parse_features(r, arch, hidden, head_dim, layers, max_pos)
    rope_scaling = _rope_scaling(r, max_pos)
    if rope_scaling.kind == "su" and len(rope_scaling.short_factor) != features.rotary_dim // 2:
        raise ConfigError(f"{path}: rope_scaling short_factor / long_factor hold {len(rope_scaling.short_factor)} "
                          f"values; the {features.rotary_dim} rotary dimensions need {features.rotary_dim // 2}")
    qc = r.get("quantization_config", dict, {}) or {}
    quant_method = qc.get("quant_method")
    if quant_method not in (None, "exl2", "gptq"):
        raise UnsupportedArchitectureError(f"{path}: quantization method {quant_method!r:.60} is not supported "
                                           "(supported: EXL2, GPTQ 4-bit)")

    intermediate = r.size(("intermediate_size", "n_inner", "ffn_config.ffn_hidden_size"), MAX_DIM, 4 * hidden)
    moe = parse_moe(r, arch, layers, intermediate)
    gen_eos: list[int] = []
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        gen_eos = as_token_ids(_read_json(gen_path, "generation_config.json").get("eos_token_id"), "eos_token_id",
                               gen_path)
    eos_all = tuple(as_token_ids(r.data.get("eos_token_id"), "eos_token_id", path))
    spec = ModelSpec(
        architecture=name, arch=arch,
        vocab_size=r.size("vocab_size", MAX_VOCAB),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate,
        norm_eps=_norm_eps(r, arch),
        rope_theta=_rope_theta(r),
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=r.get("tie_word_embeddings", bool, False),
        attention_bias=r.get("attention_bias", bool, False),
        mlp_bias=r.get("mlp_bias", bool, False),
        bos_token_id=_token_id(r, "bos_token_id"),
        eos_token_id=eos_all[0] if eos_all else _token_id(r, "eos_token_id"),
        pad_token_id=_token_id(r, "pad_token_id"),
        eos_token_ids=eos_all,
        torch_dtype=r.get(("torch_dtype", "dtype"), str, None),
        gptq_v2=qc.get("checkpoint_format") == "gptq_v2",
        sliding_window=sliding,
        quant_method=quant_method,
        raw_keys=frozenset(r.data),
        features=features,
        moe=moe,
        mrope_section=_mrope_section(r, arch, head_dim),
        rope_local_theta=_rope_local_theta(r, arch),
    )
    _check_token_ids_in_vocab(spec, gen_eos, path, gen_path)
    return spec, gen_eos


def _check_token_ids_in_vocab(spec: ModelSpec, gen_eos: list[int], path: str, gen_path: str) -> None:
    """BOS and EOS ids the model cannot produce or embed: generation would never stop at EOS (or index past
    the embedding), so they are refused naming the key and the file."""
    vocab = spec.vocab_size
    named = [("bos_token_id", spec.bos_token_id, path), ("eos_token_id", spec.eos_token_id, path),
             *(("eos_token_id", t, path) for t in spec.eos_token_ids),
             *(("eos_token_id", t, gen_path) for t in gen_eos)]
    for key, tid, where in named:
        if tid is not None and not 0 <= tid < vocab:
            raise ConfigError(f"{where}: {key} {tid} is outside the vocabulary [0, {vocab}) (vocab_size)")
