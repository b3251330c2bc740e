"""exllamav2 classes for features exlpy does not have yet. Each name exists, so `from exllamav2 import
ExLlamaV2VisionTower` works, and using it raises NotSupportedError saying what is missing (the vision issue
replaces these with real classes; LoRA adapters are exlpy/lora/)."""

from __future__ import annotations

from typing import Any

from exlpy.errors import NotSupportedError

VISION = "vision models (image and video embeddings) are not supported by exlpy"


class ExLlamaV2VisionTower:
    """exllamav2's vision encoder (Pixtral, Qwen2-VL, SigLIP): not supported."""

    def __init__(self, config: Any) -> None:
        raise NotSupportedError(f"ExLlamaV2VisionTower: {VISION}")


class ExLlamaV2MultimodalProjector:
    """exllamav2's vision-to-text projector: not supported."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(f"ExLlamaV2MultimodalProjector: {VISION}")


class ExLlamaV2MMEmbedding:
    """exllamav2's multimodal embedding (the result of get_image_embeddings): not supported."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(f"ExLlamaV2MMEmbedding: {VISION}")


class Intervention:
    """exllamav2's module wrapper with pre/post forward hooks (activation steering): not supported."""

    def __init__(self, inner: Any, pre_forward: Any = None, post_forward: Any = None) -> None:
        raise NotSupportedError("Intervention (wrapping a model module with pre/post forward hooks) is not "
                                "supported by exlpy: its modules are not interchangeable with exllamav2's")
