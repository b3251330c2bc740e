"""Generators (streaming, dynamic, async, base) and the sampler."""

from exlpy.generator.base import ExLlamaV2BaseGenerator
from exlpy.generator.dynamic import (
    ExLlamaV2DynamicGenerator,
    ExLlamaV2DynamicGeneratorAsync,
    ExLlamaV2DynamicJob,
    ExLlamaV2DynamicJobAsync,
)
from exlpy.generator.sampler import ExLlamaV2Sampler
from exlpy.generator.streaming import ExLlamaV2StreamingGenerator

__all__ = ["ExLlamaV2BaseGenerator", "ExLlamaV2DynamicGenerator", "ExLlamaV2DynamicGeneratorAsync",
           "ExLlamaV2DynamicJob", "ExLlamaV2DynamicJobAsync", "ExLlamaV2Sampler", "ExLlamaV2StreamingGenerator"]
