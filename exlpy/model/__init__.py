"""The model core: modules, their forward pass, per-call metadata. No devices, placement or strategies here
(those are exlpy/engine/), so the same blocks serve one GPU, a layer split and tensor parallelism."""

from exlpy.model.batch import ForwardBatch, build_batch
from exlpy.model.module import Module, drive, run_module
from exlpy.model.transformer import Transformer, build_modules

__all__ = ["ForwardBatch", "Module", "Transformer", "build_batch", "build_modules", "drive", "run_module"]
