"""Runtime environment, applied once when exlpy is imported (spec §12), and the OOM → advice conversion.

- CUDA_MODULE_LOADING=LAZY unless the user chose otherwise: kernels are loaded when first used, which saves
  hundreds of MiB per device. It must be set before torch initializes CUDA, so `exlpy/__init__.py` imports
  this module first.
- One warning when the installed torch has neither CUDA nor ROCm: everything then runs on the CPU. Silence it
  with EXLPY_NO_CPU_WARNING=1 (CPU-only deployments that know).
- `limit_cpu_threads_for_gpu()`: torch's CPU thread pool only slows the small host-side ops of a GPU model
  down (spin-up cost exceeds the work), so placement calls this after a GPU load. A model on the CPU keeps
  its threads; unlike exllamav2 we do not set 1 thread globally at import.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")

import contextlib  # noqa: E402 - the variable above must be set before torch is imported
import warnings  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import torch  # noqa: E402

from exlpy.errors import ExlpyWarning, InsufficientVRAMError, NoGpuWarning  # noqa: E402


class CpuOnlyTorchWarning(NoGpuWarning):
    """The installed torch has no GPU backend."""


_default_formatwarning = warnings.formatwarning


def _formatwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   line: str | None = None) -> str:
    """exlpy's warnings as one line, without the file, line number and source line that Python's default format
    adds (they point into exlpy, not at anything the user wrote); other warnings keep the default format."""
    if isinstance(category, type) and issubclass(category, ExlpyWarning):
        text = str(message)
        text = text[len("exlpy: "):] if text.startswith("exlpy: ") else text
        return f"exlpy: warning: {text}\n"
    return _default_formatwarning(message, category, filename, lineno, line)


def install_warning_format() -> None:
    if warnings.formatwarning is not _formatwarning:
        global _default_formatwarning
        _default_formatwarning = warnings.formatwarning
        warnings.formatwarning = _formatwarning


_warned_cpu_only = False
_threads_before_gpu: int | None = None


def torch_has_gpu_backend() -> bool:
    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def warn_if_cpu_only_torch() -> None:
    """Warn once per process when torch was built without CUDA/ROCm."""
    global _warned_cpu_only
    from exlpy.runtime import options

    if _warned_cpu_only or torch_has_gpu_backend() or not options().cpu_warning:
        return
    _warned_cpu_only = True
    warnings.warn(
        f"exlpy: the installed torch {torch.__version__} was built without CUDA or ROCm; every model "
        "will run on the CPU (slow). Install a CUDA or ROCm build of torch to use GPUs.",
        CpuOnlyTorchWarning,
        stacklevel=3,
    )


def limit_cpu_threads_for_gpu() -> None:
    """Use one CPU thread for torch's host-side ops while a model runs on GPUs (remembering the old count)."""
    global _threads_before_gpu
    if _threads_before_gpu is None:
        _threads_before_gpu = torch.get_num_threads()
    torch.set_num_threads(1)


def restore_cpu_threads() -> None:
    """Undo `limit_cpu_threads_for_gpu` (e.g. before running a model on the CPU in the same process)."""
    global _threads_before_gpu
    if _threads_before_gpu is not None:
        torch.set_num_threads(_threads_before_gpu)
        _threads_before_gpu = None


def is_oom(e: BaseException) -> bool:
    """An allocator out-of-memory, CUDA or HIP (HIP builds sometimes raise a plain RuntimeError)."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(e, oom_type):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("CUDA out of memory" in text or "HIP out of memory" in text)


OOM_ADVICE = (
    "reduce max_seq_len (or the cache's batch_size), use a quantized cache (ExLlamaV2Cache_Q4/Q6/Q8), "
    "lower max_input_len / max_batch_size, or spread the model over more GPUs"
)


@contextlib.contextmanager
def oom_guard(what: str) -> Iterator[None]:
    """Turn an out-of-memory inside the block into InsufficientVRAMError saying what ran out and what to
    reduce."""
    try:
        yield
    except Exception as e:
        if not is_oom(e):
            raise
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InsufficientVRAMError(f"Insufficient VRAM during {what}: {detail}. To fit, {OOM_ADVICE}") from e


install_warning_format()
# The CPU-only-torch warning is given where a model is loaded onto the CPU (engine/placement.py), not at import:
# `exlpy --version`, the tokenizer or `exlpy plan --devices` need no GPU.
