"""Typed exceptions. Every user-facing failure is one of these and names what was wrong."""

from __future__ import annotations


class ExlpyError(Exception):
    """Base class of every error exlpy raises on purpose."""


class ExlpyWarning(UserWarning):
    """Base class of exlpy's warnings. They print as one line, `exlpy: warning: ...`, without the Python
    source line the default format adds (exlpy/env.py installs the format)."""


class NoGpuWarning(ExlpyWarning):
    """A model is placed on the CPU because no GPU is usable (EXLPY_NO_CPU_WARNING=1 silences it)."""


class ConfigError(ExlpyError, ValueError):
    """config.json (or a runtime setting) is missing, malformed or unsupported."""


class UnsupportedArchitectureError(ConfigError):
    """The model's architecture or one of its features is not implemented."""


class WeightsError(ExlpyError, ValueError):
    """A weights file or tensor is missing, corrupt or has the wrong shape/dtype."""

    def __init__(self, message: str, *, tensor: str | None = None, file: str | None = None) -> None:
        parts = [message]
        if tensor is not None:
            parts.append(f"tensor: {tensor}")
        if file is not None:
            parts.append(f"file: {file}")
        super().__init__(" | ".join(parts))
        self.tensor = tensor
        self.file = file


class QuantFormatError(WeightsError):
    """Packed EXL2/GPTQ tensors are inconsistent with each other or with the model shape."""


class InputError(ExlpyError, ValueError):
    """An argument of an API call is malformed: token ids outside the vocabulary or not integers, an empty
    batch, a cache size that is no size."""


class SequenceLengthError(ExlpyError, ValueError):
    """An input is longer than the model or a buffer allows."""


class CacheTooSmallError(SequenceLengthError):
    """Total sequence length exceeds cache size."""


class DeviceError(ExlpyError, RuntimeError):
    """A device query, placement or split is impossible."""


class InsufficientVRAMError(DeviceError):
    """The model and cache do not fit on the available devices."""


class GpuSplitError(DeviceError, ValueError):
    """A gpu_split / reserve_vram argument is malformed."""


class ModelStateError(ExlpyError, RuntimeError):
    """An operation was called in the wrong model state (not loaded, loaded twice, cache not lazy...)."""


class TensorParallelError(ExlpyError, ValueError):
    """Tensor-parallel misuse or an unsupported feature under TP."""


class LoraError(ExlpyError):
    """A LoRA adapter cannot be loaded or applied (base class of the LoRA errors)."""


class LoraConfigError(LoraError, ConfigError):
    """adapter_config.json is missing, malformed, or asks for something exlpy does not apply."""


class LoraWeightsError(WeightsError, LoraError):
    """An adapter's weights file or tensor is missing, unsupported, or does not fit the base model."""


class LoraCapacityError(LoraError, RuntimeError):
    """Every adapter slot holds an adapter in use, or an adapter needs more rank than the slots allow."""


class TokenizerError(ExlpyError, ValueError):
    """Tokenizer files are missing or malformed."""


class SamplerError(ExlpyError, ValueError):
    """Invalid sampler settings."""


class GeneratorError(ExlpyError, ValueError):
    """Invalid job or generator usage."""


class NotSupportedError(ExlpyError, NotImplementedError):
    """An exllamav2 feature that exlpy does not implement (yet). The name exists, so a script that reaches
    it stops here with this message instead of an AttributeError or a silently different result."""


class UnknownArgumentError(ExlpyError, TypeError):
    """A keyword argument the call does not take (a typo, or an exllamav2 option exlpy does not know)."""


class CompatImportError(ExlpyError, ModuleNotFoundError):
    """`import exllamav2.X` under exlpy.compat.install() names a module exlpy has no counterpart for."""


class CompatInstallError(ExlpyError, RuntimeError):
    """`exlpy compat install/uninstall` cannot do what was asked (a real exllamav2 is installed, the site
    directory is not writable, the files there belong to something else)."""


class CommandLineError(SystemExit):
    """A command-line argument of an exllamav2-style script (exlpy.model_init) is missing or wrong. It is a
    SystemExit carrying the message: the script ends with it on stderr and status 1, without a traceback, as
    a command-line tool should (exllamav2 printed the message and exited with status 0)."""


class CacheError(ExlpyError, ValueError):
    """A cache argument is of the wrong kind or does not match the input (e.g. one cache per row)."""


class DraftModelError(GeneratorError):
    """Speculative decoding was set up wrongly: a draft model or cache that does not fit the target (vocabulary,
    cache size or batch), a draft model that is not loaded, or a draft length out of range."""


class GrammarError(GeneratorError):
    """A JSON schema, regex or grammar for constrained decoding is invalid, or generation left it."""


class ConvertError(ExlpyError, RuntimeError):
    """A conversion job (exlpy convert) cannot go on; the message says what to change."""


class ConvertSettingsError(ConvertError, ValueError):
    """A conversion setting is out of range or conflicts with another (bits, head bits, rows, paths)."""


class CalibrationDataError(ConvertError, ValueError):
    """The calibration data set is missing, unreadable, empty or too short for the rows asked."""


class MeasurementFileError(ConvertError, ValueError):
    """A measurement.json given with -m is malformed or belongs to another model."""


class NumericalError(ConvertError):
    """NaN/inf in a source tensor or in hidden states, or a Hessian that stays singular after damping."""


class JobConflictError(ConvertError):
    """The work or output directory holds a different job (or foreign files); -nr restarts."""


class ConvertIOError(ConvertError, OSError):
    """Writing the job's files failed (disk full, not writable); the job stays resumable."""


class ImageError(InputError):
    """An image that cannot be used: it does not decode, has no pixels, or exceeds the size limits."""


class MultimodalError(InputError):
    """Multimodal inputs that do not fit together: an embedding alias missing from the prompt, more image tokens
    than the context holds, images for a model without a vision tower, an embedding of another model."""
