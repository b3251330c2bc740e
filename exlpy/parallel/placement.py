"""Loading the module list onto devices (single device; replaced by the planner-driven version)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from exlpy.cache.base import ExLlamaV2CacheBase
    from exlpy.model.model import ExLlamaV2


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda:0")
    return torch.device("cpu")


def _load_on(model: ExLlamaV2, devices: list[torch.device], callback: Callable[[int, int], None] | None,
             callback_gen: Callable[[int, int], Any] | None, progress: bool) -> Generator[Any, None, None]:
    n = len(model.modules)
    for i, dev in enumerate(devices):
        if callback is not None:
            callback(i, n)
        if callback_gen is not None:
            yield from callback_gen(i, n)
        model.place_module(i, dev)
    if callback is not None:
        callback(n, n)
    if callback_gen is not None:
        yield from callback_gen(n, n)
    model.loaded = True


def load_split_gen(model: ExLlamaV2, gpu_split: list[float] | None, callback: Any, callback_gen: Any,
                   progress: bool, lazy: bool = False) -> Generator[Any, None, None]:
    dev = default_device()
    yield from _load_on(model, [dev] * len(model.modules), callback, callback_gen, progress)


def load_autosplit_gen(model: ExLlamaV2, cache: ExLlamaV2CacheBase, reserve_vram: Any, last_id_only: bool,
                       callback: Any, callback_gen: Any, progress: bool) -> Generator[Any, None, None]:
    dev = default_device()
    if dev.type == "cpu":
        warnings.warn("no CUDA device: loading the model on the CPU", stacklevel=4)
    yield from _load_on(model, [dev] * len(model.modules), callback, callback_gen, progress)
