"""Dynamic generator: continuous batching over a paged, prefix-deduplicated KV cache."""

from exlpy.generator.dynamic.async_ import ExLlamaV2DynamicGeneratorAsync, ExLlamaV2DynamicJobAsync
from exlpy.generator.dynamic.generator import ExLlamaV2DynamicGenerator
from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob

__all__ = ["ExLlamaV2DynamicGenerator", "ExLlamaV2DynamicGeneratorAsync", "ExLlamaV2DynamicJob",
           "ExLlamaV2DynamicJobAsync"]
