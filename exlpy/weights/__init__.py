"""Weights on disk: the safetensors index and the per-format linear loaders."""

from exlpy.weights.safetensors_index import SafetensorsIndex, TensorInfo

__all__ = ["SafetensorsIndex", "TensorInfo"]
