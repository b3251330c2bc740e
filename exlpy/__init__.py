"""exlpy: the exllamav2 API in pure Python + Triton."""

from exlpy.cache import ExLlamaV2Cache, ExLlamaV2CacheBase
from exlpy.config import ExLlamaV2Config
from exlpy.model import ExLlamaV2

__version__ = "0.1.0"

__all__ = ["ExLlamaV2", "ExLlamaV2Cache", "ExLlamaV2CacheBase", "ExLlamaV2Config", "__version__"]
