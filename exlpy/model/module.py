"""Base class of the model's modules: explicit load/unload on one device, sizes known from headers.

`forward` is a coroutine. On one device it never suspends (`run_module` drives it to completion). Under
tensor parallelism one copy of each module runs per GPU, in lock step, and a module suspends at its
collectives (`await group.all_reduce(...)`), where all GPUs' partial results meet: so the same block code
serves one GPU, a layer split and tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import torch

from exlpy.config.config import ExLlamaV2Config
from exlpy.model.batch import ForwardBatch
from exlpy.weights.safetensors_index import SafetensorsIndex


class Module:
    """One entry of the model's module list. Not an nn.Module: weights are loaded lazily, per device."""

    def __init__(self, config: ExLlamaV2Config, key: str) -> None:
        self.config = config
        self.key = key
        self.device: torch.device | None = None

    @property
    def index(self) -> SafetensorsIndex:
        assert self.config.index is not None, "config.prepare() reads the tensor index"
        return self.config.index

    @property
    def spec(self):  # noqa: ANN201 - ModelSpec; annotated loosely to avoid an import cycle in subclasses
        assert self.config.spec is not None
        return self.config.spec

    def tensor_prefixes(self) -> list[str]:
        """Checkpoint prefixes of the tensors this module owns (for byte accounting)."""
        return [self.key]

    def weight_bytes(self) -> int:
        """Bytes of this module's weights as stored on disk (read from headers, no data)."""
        total = 0
        for p in self.tensor_prefixes():
            total += sum(t.nbytes for n, t in self.index.tensors.items() if n == p or n.startswith(p + "."))
        return total

    def active_weight_bytes(self) -> int:
        """Bytes of stored weights one token reads (all of them here; an MoE block's only its k experts')."""
        return self.weight_bytes()

    def loaded_bytes(self, dtype_bytes: int) -> int:
        """Bytes once loaded: float tensors become `dtype_bytes` wide, packed integer tensors keep their size."""
        total = 0
        for p in self.tensor_prefixes():
            for n, t in self.index.tensors.items():
                if n == p or n.startswith(p + "."):
                    is_float = t.dtype in ("F16", "BF16", "F32")
                    total += (t.nbytes // int(t.torch_dtype.itemsize)) * dtype_bytes if is_float else t.nbytes
        return total

    def load(self, device: torch.device) -> None:
        raise NotImplementedError

    def unload(self) -> None:
        self.device = None

    async def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def dtype(self, device: torch.device) -> torch.dtype:
        return self.config.compute_dtype(device)


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a forward coroutine that has no collectives to wait for (one device) to completion."""
    try:
        op = coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError(f"a single-device forward reached a collective ({op!r}): tensor-parallel modules run "
                       "through the tensor-parallel strategy")


def run_module(module: Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`module.forward` on one device, synchronously (layer-by-layer tools such as the converter)."""
    return drive(module.forward(x, batch))
