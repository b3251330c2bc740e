"""Running the model core: execution strategies (one device, layer split, tensor parallel), the CUDA-graph
runner that captures any of them, loading, and the exllamav2-compatible facade `ExLlamaV2` on top."""

from exlpy.engine.facade import ExLlamaV2

__all__ = ["ExLlamaV2"]
