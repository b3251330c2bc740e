"""Model configuration: config.json parsed once into typed objects, plus exllamav2's runtime knobs."""

from exlpy.config.arch import ARCHITECTURES, ArchParams
from exlpy.config.config import ExLlamaV2Config
from exlpy.config.features import ModelFeatures
from exlpy.config.hf import ModelSpec, load_spec
from exlpy.config.rope import RopeScaling

__all__ = ["ARCHITECTURES", "ArchParams", "ExLlamaV2Config", "ModelFeatures", "ModelSpec", "RopeScaling",
           "load_spec"]
