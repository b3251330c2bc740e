"""KV caches."""

from exlpy.cache.base import ExLlamaV2Cache, ExLlamaV2CacheBase
from exlpy.cache.quant import (
    ExLlamaV2Cache_8bit,
    ExLlamaV2Cache_Q,
    ExLlamaV2Cache_Q4,
    ExLlamaV2Cache_Q6,
    ExLlamaV2Cache_Q8,
)
from exlpy.cache.tp import ExLlamaV2Cache_TP

__all__ = ["ExLlamaV2Cache", "ExLlamaV2CacheBase", "ExLlamaV2Cache_8bit", "ExLlamaV2Cache_Q", "ExLlamaV2Cache_Q4",
           "ExLlamaV2Cache_Q6", "ExLlamaV2Cache_Q8", "ExLlamaV2Cache_TP"]
