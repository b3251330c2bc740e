"""Checked reads of config values: garbage in config.json (or in a runtime setting) is a ConfigError naming the
key and the limit, raised before anything is sized from it.

The limits are far above any real model (Llama-3.1-405B: 126 layers, hidden 16384; the longest contexts are a
few million positions) and far below what would exhaust memory: a layer count of 10^9 would otherwise build
10^9 module objects, a context of 10^12 positions a RoPE table of terabytes.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from exlpy.errors import ConfigError

MAX_LAYERS = 4096
MAX_POSITIONS = 1 << 24  # 16,777,216 positions
MAX_VOCAB = 1 << 24
MAX_DIM = 1 << 20  # hidden, intermediate and head sizes
MAX_HEADS = 1 << 14
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value: Any, key: str, where: str, lo: int, hi: int, *, strict: bool = False) -> int:
    """An integer in [lo, hi]. An integral float (2048.0) is accepted from files, as transformers writes some
    that way, but not with `strict` (arguments and runtime settings, which are used as they are)."""
    if not strict and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not is_int(value) and not isinstance(value, (bool, float)) and hasattr(value, "__index__"):
        try:
            value = operator.index(value)  # numpy and 0-dim torch integers
        except TypeError:
            pass
    if not is_int(value):
        raise ConfigError(f"{where}: '{key}' should be an integer, got {_shown(value)}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where}: '{key}' = {_shown(value)} is out of range (must be in [{lo}, {hi}])")
    return value


def as_positive_float(value: Any, key: str, where: str, *, allow_zero: bool = False) -> float:
    """A finite real number > 0 (>= 0 with allow_zero). Strings, lists, NaN and infinities are refused."""
    if not (is_int(value) or isinstance(value, float)):
        raise ConfigError(f"{where}: '{key}' should be a number, got {_shown(value)}")
    v = float(value) if abs(value) < 1e308 else math.inf
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        need = "finite and >= 0" if allow_zero else "finite and > 0"
        raise ConfigError(f"{where}: '{key}' = {_shown(value)} is invalid (must be {need})")
    return v


def as_token_ids(value: Any, key: str, where: str) -> list[int]:
    """A token id, a list of them, or null. Ids must be JSON integers (not "2" or 2.5)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    out = []
    for v in items:
        if v is None:
            continue
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not is_int(v) or not -1 <= v < MAX_VOCAB:
            raise ConfigError(f"{where}: '{key}' must hold token ids (integers in [-1, {MAX_VOCAB})), got "
                              f"{_shown(value)}")
        out.append(v)
    return out


def check_compute_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"config.dtype = {dtype!r} is not a compute dtype (use torch.float16, torch.bfloat16 "
                          "or torch.float32, or None for the device default)")
    return dtype
