"""The model core: modules, their forward pass, per-call metadata. No devices, placement or strategies here
(those are exlpy/engine/), so the same blocks serve one GPU, a layer split and tensor parallelism."""

from exlpy.model.batch import ForwardBatch, build_batch
from exlpy.model.module import Module, drive, run_module
from exlpy.model.transformer import Transformer, build_modules

__all__ = ["ForwardBatch", "Module", "Transformer", "build_batch", "build_modules", "drive", "run_module"]


def __getattr__(name: str) -> object:
    # exllamav2 scripts import the model class as `exllamav2.model.ExLlamaV2` (exlpy.compat maps that module
    # here). The class is the engine's facade, one layer up; resolved on first use so importing the core
    # never imports the engine.
    if name == "ExLlamaV2":
        from exlpy.engine import ExLlamaV2

        return ExLlamaV2
    raise AttributeError(f"module 'exlpy.model' has no attribute {name!r}")
