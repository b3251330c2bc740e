"""exlpy: the exllamav2 API in pure Python + Triton."""

import exlpy.env  # noqa: F401  (first: sets CUDA_MODULE_LOADING before torch initializes CUDA)
from exlpy.cache import (
    ExLlamaV2Cache,
    ExLlamaV2Cache_8bit,
    ExLlamaV2Cache_Q4,
    ExLlamaV2Cache_Q6,
    ExLlamaV2Cache_Q8,
    ExLlamaV2CacheBase,
)
from exlpy.cache.tp import ExLlamaV2Cache_TP
from exlpy.compat.unsupported import ExLlamaV2MultimodalProjector, Intervention
from exlpy.config import ExLlamaV2Config
from exlpy.engine import ExLlamaV2
from exlpy.lora import ExLlamaV2Lora
from exlpy.tokenizer import ExLlamaV2Tokenizer
from exlpy.util import SeqTensor, Timer
from exlpy.version import __version__
from exlpy.vision import ExLlamaV2VisionTower

__all__ = [
    "ExLlamaV2",
    "ExLlamaV2Cache",
    "ExLlamaV2Cache_8bit",
    "ExLlamaV2Cache_Q4",
    "ExLlamaV2Cache_Q6",
    "ExLlamaV2Cache_Q8",
    "ExLlamaV2Cache_TP",
    "ExLlamaV2CacheBase",
    "ExLlamaV2Config",
    "ExLlamaV2Lora",
    "ExLlamaV2MultimodalProjector",
    "ExLlamaV2Tokenizer",
    "ExLlamaV2VisionTower",
    "Intervention",
    "SeqTensor",
    "Timer",
    "__version__",
]
