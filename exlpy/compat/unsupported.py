"""exllamav2 classes for features exlpy does not have yet. Each name exists, so `from exllamav2 import
Intervention` works, and using it raises NotSupportedError saying what is missing (vision models are
exlpy/vision/, LoRA adapters exlpy/lora/)."""

from __future__ import annotations

from typing import Any

from exlpy.errors import NotSupportedError

VISION = ("exllamav2's separate multimodal projector class is not part of exlpy: ExLlamaV2VisionTower "
          "(exlpy.vision) loads the projector with the vision encoder")


class ExLlamaV2MultimodalProjector:
    """exllamav2's vision-to-text projector module: the tower includes it in exlpy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(f"ExLlamaV2MultimodalProjector: {VISION}")


class Intervention:
    """exllamav2's module wrapper with pre/post forward hooks (activation steering): not supported."""

    def __init__(self, inner: Any, pre_forward: Any = None, post_forward: Any = None) -> None:
        raise NotSupportedError("Intervention (wrapping a model module with pre/post forward hooks) is not "
                                "supported by exlpy: its modules are not interchangeable with exllamav2's")
