"""KV caches."""

from exlpy.cache.base import ExLlamaV2Cache, ExLlamaV2CacheBase

__all__ = ["ExLlamaV2Cache", "ExLlamaV2CacheBase"]
