"""Rotary embedding frequencies for every supported scaling method (spec §2, "RoPE tables")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from exlpy.config.values import MAX_POSITIONS, as_int, as_positive_float
from exlpy.errors import ConfigError, UnsupportedArchitectureError


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"  # default | linear | llama3 | yarn | su | invalid (an incomplete runtime setting)
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    problem: str = ""  # kind "invalid": what is missing, raised when tables are built from it
    # su / longrope (Phi-3): per-frequency divisors for short and long contexts, and the attention factor
    # transformers applies (from max_position_embeddings / original length, or the config's own value).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


def parse_rope_scaling(rs: dict[str, Any], where: str, orig_default: int, max_pos: int = 0) -> RopeScaling:
    """`rope_scaling` / `rope_parameters` of config.json as a checked RopeScaling.

    Every factor must be a finite number > 0 (a factor of 0 divides the frequencies by zero), llama3's high
    frequency factor must exceed its low one (their difference is a divisor), and original lengths must be
    positive: garbage here would otherwise become NaN RoPE tables and silently wrong logits.
    """
    if "type" in rs and "rope_type" in rs and rs["type"] != rs["rope_type"]:
        raise ConfigError(f"{where}: rope_scaling has both 'type' and 'rope_type'")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return RopeScaling()
    if kind not in ("linear", "llama3", "yarn", "su", "longrope"):
        raise UnsupportedArchitectureError(
            f"{where}: rope_scaling type {kind!r} is not supported (supported: linear, llama3, yarn, su/longrope)")

    def num(key: str, default: float) -> float:
        value = rs.get(key)
        return default if value is None else as_positive_float(value, f"rope_scaling.{key}", where)

    # As transformers requires: without it the scaling would silently be 1 (su / longrope have per-frequency
    # factors instead).
    if rs.get("factor") is None and kind not in ("su", "longrope"):
        raise ConfigError(f"{where}: rope_scaling type {kind!r} needs a 'factor'")
    factor = num("factor", 1.0)
    orig = rs.get("original_max_position_embeddings")
    orig = orig_default if orig is None else as_int(orig, "rope_scaling.original_max_position_embeddings", where,
                                                    1, MAX_POSITIONS)
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind in ("su", "longrope"):
        return _parse_longrope(rs, where, orig, max_pos)
    if kind == "llama3":
        low, high = num("low_freq_factor", 1.0), num("high_freq_factor", 4.0)
        if high <= low:
            raise ConfigError(f"{where}: rope_scaling.high_freq_factor ({high}) must exceed low_freq_factor ({low})")
        return RopeScaling("llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                           original_max_position_embeddings=orig)
    for unsupported in ("mscale", "mscale_all_dim", "attention_factor"):
        if rs.get(unsupported) not in (None, 1, 1.0, 0):
            raise UnsupportedArchitectureError(f"{where}: rope_scaling.{unsupported} is not supported")
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=orig,
                       beta_fast=num("beta_fast", 32.0), beta_slow=num("beta_slow", 1.0))


def _parse_longrope(rs: dict[str, Any], where: str, orig: int, max_pos: int) -> RopeScaling:
    factors = []
    for key in ("short_factor", "long_factor"):
        value = rs.get(key)
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{where}: rope_scaling.{key} must be a non-empty list of numbers")
        factors.append(tuple(as_positive_float(v, f"rope_scaling.{key}", where) for v in value))
    if len(factors[0]) != len(factors[1]):
        raise ConfigError(f"{where}: rope_scaling.short_factor and long_factor differ in length")
    attn = rs.get("attention_factor")
    if attn is None:
        # transformers: from the ratio of the configured length to the original one, whatever the sequence.
        ratio = max_pos / orig if max_pos else 1.0
        attn = math.sqrt(1 + math.log(ratio) / math.log(orig)) if ratio > 1 and orig > 1 else 1.0
    else:
        attn = as_positive_float(attn, "rope_scaling.attention_factor", where)
    return RopeScaling("su", original_max_position_embeddings=orig, short_factor=factors[0],
                       long_factor=factors[1], attention_factor=attn)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling, alpha: float, max_seq_len: int
             ) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2] fp32, attention factor) for the configured method."""
    if scaling.kind == "invalid":
        raise ConfigError(scaling.problem)
    d = head_dim
    base = theta
    # fp32 arithmetic, as transformers does, so that tables agree bit for bit with the reference.
    idx = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    if scaling.kind in ("default", "linear"):
        # NTK-aware alpha scaling stretches the base.
        if alpha != 1.0:
            base = base * alpha ** (d / (d - 2))
        return 1.0 / base**idx, 1.0
    if alpha != 1.0:
        base = base * alpha ** (head_dim / (head_dim - 2))
    freqs = 1.0 / base**idx
    if scaling.kind == "su":
        # exllamav2's rule, fixed when the tables are built: long factors when the context may exceed the
        # original length. (transformers switches per forward on the current length.)
        orig = scaling.original_max_position_embeddings
        ext = scaling.long_factor if max_seq_len > orig else scaling.short_factor
        if len(ext) != d // 2:
            raise ConfigError(f"rope_scaling: su/longrope factors hold {len(ext)} values, the rotary dimension "
                              f"{d} needs {d // 2}")
        return (freqs / torch.tensor(ext, dtype=torch.float32)).float(), scaling.attention_factor
    if scaling.kind == "llama3":
        orig = scaling.original_max_position_embeddings
        low_wl = orig / scaling.low_freq_factor
        high_wl = orig / scaling.high_freq_factor
        wl = 2 * math.pi / freqs
        smooth = (orig / wl - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
        out = torch.where(wl < high_wl, freqs, torch.where(wl > low_wl, freqs / scaling.factor, blended))
        return out.float(), 1.0
    if scaling.kind == "yarn":
        # Applied whatever max_seq_len is, as in transformers (exllamav2 skips it below the original
        # length, which changes logits relative to the model's own reference).
        orig = scaling.original_max_position_embeddings
        factor = scaling.factor
        attn_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

        def corr_dim(n_rot: float) -> float:
            # The spec notes exllamav2 plugs max_seq_len in here where HF uses the original length;
            # we follow HF so logits match transformers.
            return d * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(scaling.beta_fast)), 0)
        high = min(math.ceil(corr_dim(scaling.beta_slow)), d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrap_factor = 1 - ramp
        interp = freqs / factor
        out = interp * (1 - extrap_factor) + freqs * extrap_factor
        return out.float(), attn_factor
    raise ValueError(f"unknown rope kind {scaling.kind}")


def cos_sin_table(head_dim: int, theta: float, scaling: RopeScaling, alpha: float, scale_pos_emb: float,
                  max_seq_len: int, device: torch.device | str, dtype: torch.dtype, rotary_dim: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_seq_len, head_dim] cos and sin in NEOX layout (frequencies repeated over both halves).

    With `rotary_dim` < head_dim (partial rotary, or 0: no rotary at all) the table rotates the pairs
    (i, i + head_dim/2) for i < rotary_dim/2 only: cos 1 and sin 0 elsewhere. exlpy.model.rotary permutes
    q and k so that the dimensions a model rotates sit at exactly those places."""
    rot = head_dim if rotary_dim is None else rotary_dim
    # Runtime knobs a user may have set after the config was read; checked before the table is allocated.
    as_positive_float(scale_pos_emb, "scale_pos_emb", "ExLlamaV2Config")
    as_positive_float(alpha, "scale_alpha_value", "ExLlamaV2Config")
    as_int(max_seq_len, "max_seq_len", "ExLlamaV2Config", 1, MAX_POSITIONS, strict=True)
    if rot == 0:
        ones = torch.ones(max_seq_len, head_dim)
        return ones.to(device=device, dtype=dtype), torch.zeros_like(ones).to(device=device, dtype=dtype)
    if alpha != 1.0 and rot <= 2:
        raise ConfigError(f"ExLlamaV2Config: scale_alpha_value {alpha} needs head_dim > 2 (NTK scaling divides by "
                          f"head_dim - 2), got head_dim {head_dim}")
    f, attn_factor = inv_freq(rot, theta, scaling, alpha, max_seq_len)
    # Values that each pass their own check can still combine into overflow (rope_theta 1e-300: frequencies of
    # 1e300, beyond fp32): refuse NaN/inf tables instead of producing NaN logits.
    top = (max_seq_len - 1) / scale_pos_emb * float(f.abs().max())
    if not (bool(torch.isfinite(f).all()) and math.isfinite(attn_factor) and math.isfinite(top) and top < 3e38):
        raise ConfigError(f"RoPE settings give non-finite rotary angles (rope_theta {theta}, {scaling}, "
                          f"scale_alpha_value {alpha}, scale_pos_emb {scale_pos_emb}, max_seq_len {max_seq_len})")
    t = torch.arange(max_seq_len, dtype=torch.float32) / scale_pos_emb
    freqs = torch.outer(t, f)
    cos, sin = freqs.cos() * attn_factor, freqs.sin() * attn_factor
    if rot < head_dim:  # unrotated dimensions: identity
        pad = head_dim // 2 - rot // 2
        cos = torch.cat((cos, torch.ones(max_seq_len, pad)), dim=-1)
        sin = torch.cat((sin, torch.zeros(max_seq_len, pad)), dim=-1)
    return (torch.cat((cos, cos), dim=-1).to(device=device, dtype=dtype),
            torch.cat((sin, sin), dim=-1).to(device=device, dtype=dtype))
