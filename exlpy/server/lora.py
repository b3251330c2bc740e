"""LoRA adapters in `exlpy serve`: `--lora NAME=DIR` serves each adapter as a model of its own.

Every adapter is listed in /v1/models (with the base model as its `parent`, as vLLM does) and selected by the
request's `model` field; the base model's name (or no name) means no adapter. Requests for different adapters
and the base model run in the same batches (per-row adapters, exlpy/lora/). A name the server does not serve
is answered 404 in OpenAI's error shape (exlpy/server/app.py `check_model`).
"""

from __future__ import annotations

import os
from typing import Any

from exlpy.errors import ConfigError
from exlpy.server.options import LoraSpec, lora_specs


def parse_specs(specs: list[str] | tuple[LoraSpec, ...] | None, base_name: str) -> list[tuple[str, str]]:
    """`NAME=DIR` arguments (or LoraSpecs) as (name, directory), names unique and distinct from the base model's,
    directories existing."""
    out: list[tuple[str, str]] = []
    for spec in as_specs(specs):
        what = f"--lora {spec.name}={spec.directory}"
        if spec.name == base_name or spec.name in {n for n, _ in out}:
            raise ConfigError(f"{what}: the model name {spec.name!r} is already served")
        if not os.path.isdir(spec.directory):
            raise ConfigError(f"{what}: {spec.directory} is not a directory")
        out.append((spec.name, spec.directory))
    return out


def as_specs(specs: list[str] | tuple[LoraSpec, ...] | None) -> tuple[LoraSpec, ...]:
    if specs and all(isinstance(s, str) for s in specs):
        return lora_specs(list(specs), None, None)  # type: ignore[arg-type]
    return tuple(specs or ())  # type: ignore[arg-type]


def load_adapters(model: Any, specs: list[str] | tuple[LoraSpec, ...] | None, base_name: str) -> dict[str, Any]:
    """Read every adapter. Slots grow as adapters are used (up to 8 resident at once by default, more when
    more are given), so adapters loaded later through POST /v1/lora/load fit too."""
    from exlpy.lora import ExLlamaV2Lora, configure
    from exlpy.lora.slots import DEFAULT_MAX_SLOTS

    specs = as_specs(specs)
    parse_specs(specs, base_name)
    if len(specs) > DEFAULT_MAX_SLOTS:
        configure(model, max_adapters=len(specs))
    return {s.name: ExLlamaV2Lora.from_directory(model, s.directory, lora_scaling=s.scaling) for s in specs}


def adapter_cards(state: Any) -> list[dict[str, Any]]:
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "exlpy",
             "root": lora.directory, "parent": state.model_name, "max_model_len": state.max_seq_len}
            for name, lora in state.adapters.items()]
