"""`exlpy convert`: EXL2 conversion with exllamav2's flags (see exlpy.convert)."""

from __future__ import annotations

from typing import Any

from exlpy.convert.args import DESCRIPTION, add_arguments, run


def add_parser(sub: Any) -> None:
    p = sub.add_parser("convert", help="convert a model to EXL2 (measure, optimize, quantize, compile)",
                       description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(_run=run)
