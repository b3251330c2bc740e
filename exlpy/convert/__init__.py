"""EXL2 conversion: measure, optimize, quantize and compile a Hugging Face model (spec §4).

`convert(...)` is the Python API; `exlpy convert` and `python -m exlpy.convert` are the command line.
"""

from __future__ import annotations

from typing import Any


def convert(*args: Any, **kwargs: Any) -> Any:
    """Convert a model to EXL2; see exlpy.convert.pipeline.convert for the arguments."""
    from exlpy.convert.pipeline import convert as _convert

    return _convert(*args, **kwargs)


__all__ = ["convert"]
