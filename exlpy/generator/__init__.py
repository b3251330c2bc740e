"""Generators (streaming, dynamic, async, base) and the sampler."""

from exlpy.generator.base import ExLlamaV2BaseGenerator
from exlpy.generator.dynamic import (
    ExLlamaV2DynamicGenerator,
    ExLlamaV2DynamicGeneratorAsync,
    ExLlamaV2DynamicJob,
    ExLlamaV2DynamicJobAsync,
)
from exlpy.generator.hooks import ExLlamaV2PostSamplingHook, ExLlamaV2PostSamplingResult
from exlpy.generator.sampler import ExLlamaV2Sampler
from exlpy.generator.streaming import ExLlamaV2StreamingGenerator
from exlpy.version import __version__
from exlpy.vision.embedding import ExLlamaV2MMEmbedding

__all__ = ["ExLlamaV2BaseGenerator", "ExLlamaV2DynamicGenerator", "ExLlamaV2DynamicGeneratorAsync",
           "ExLlamaV2DynamicJob", "ExLlamaV2DynamicJobAsync", "ExLlamaV2MMEmbedding", "ExLlamaV2PostSamplingHook",
           "ExLlamaV2PostSamplingResult", "ExLlamaV2Sampler", "ExLlamaV2StreamingGenerator", "__version__"]
