"""The Llama-family model: modules, forward pass, loading entry points."""

from exlpy.model.model import ExLlamaV2

__all__ = ["ExLlamaV2"]
