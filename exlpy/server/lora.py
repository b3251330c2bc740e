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


def parse_specs(specs: list[str] | None, base_name: str) -> list[tuple[str, str]]:
    """`NAME=DIR` arguments as (name, directory), names unique and distinct from the base model's."""
    out: list[tuple[str, str]] = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ConfigError(f"--lora {spec!r}: expected NAME=DIR (the model name clients send, then the PEFT "
                              "adapter directory)")
        if name == base_name or name in {n for n, _ in out}:
            raise ConfigError(f"--lora {spec!r}: the model name {name!r} is already served")
        if not os.path.isdir(path):
            raise ConfigError(f"--lora {spec!r}: {path} is not a directory")
        out.append((name, path))
    return out


def load_adapters(model: Any, specs: list[str] | None, base_name: str) -> dict[str, Any]:
    """Read every `--lora` adapter. The model gets one adapter slot per adapter, allocated before the first
    request (and the largest rank), so requests for any mix of them run together and nothing is reallocated
    while serving."""
    from exlpy.lora import ExLlamaV2Lora, configure

    pairs = parse_specs(specs, base_name)
    if pairs:
        configure(model, max_adapters=len(pairs))
    return {name: ExLlamaV2Lora.from_directory(model, path) for name, path in pairs}


def adapter_cards(state: Any) -> list[dict[str, Any]]:
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "exlpy",
             "root": lora.directory, "parent": state.model_name, "max_model_len": state.max_seq_len}
            for name, lora in state.adapters.items()]
