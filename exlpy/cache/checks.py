"""Checks of a cache's constructor arguments, before anything is allocated from them."""

from __future__ import annotations

from typing import Any

from exlpy.config.values import MAX_POSITIONS, as_int


def check_cache_args(model: Any, batch_size: Any, max_seq_len: Any, num_key_value_heads: Any
                     ) -> tuple[int, int, int | None]:
    """(batch_size, max_seq_len, num_key_value_heads) checked: batch_size >= 1, max_seq_len -1 (the model's)
    or in [1, MAX_POSITIONS], an integer KV head count; a ConfigError names the argument and its range."""
    where = "ExLlamaV2Cache"
    as_int(batch_size, "batch_size", where, 1, 1 << 20, strict=True)
    if max_seq_len != -1 or isinstance(max_seq_len, bool):
        as_int(max_seq_len, "max_seq_len", where, 1, MAX_POSITIONS, strict=True)
    if num_key_value_heads is not None:
        as_int(num_key_value_heads, "num_key_value_heads", where, 1, 1 << 14, strict=True)
    config = getattr(model, "config", None)  # None: a CacheLayout (a clone of a checked cache)
    if config is not None:
        config.check_settings()  # e.g. config.dtype, which sizes every K/V tensor
    return batch_size, max_seq_len, num_key_value_heads
