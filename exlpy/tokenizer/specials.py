"""Which ids are BOS/EOS/PAD and which ids stop generation.

Order of authority (spec §9): the model's config.json, then tokenizer_config.json's `bos_token`/`eos_token`/
`pad_token` (a string or `{"content": ...}`), then defaults BOS 1 / EOS 2. PAD falls back to `<pad>` if the
vocabulary has it, else EOS when EOS differs from BOS, else -1 (no padding id).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from exlpy.errors import TokenizerError
from exlpy.tokenizer.backend import read_json_object


@dataclass(frozen=True)
class ModelTokenIds:
    """Token ids stated by the model's own config files (None where the files say nothing)."""

    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    eos_all: tuple[int, ...] = ()  # every EOS in config.json and generation_config.json


def _as_ids(value: Any, key: str = "token id", where: str = "") -> list[int]:
    if value is None:
        return []
    out = []
    for v in value if isinstance(value, list) else [value]:
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise TokenizerError(f"'{key}' must hold integer token ids, got {str(value)[:60]!r}: {where}")
        out.append(v)
    return out


def _first(value: Any, key: str = "token id", where: str = "") -> int | None:
    ids = _as_ids(value, key, where)
    return ids[0] if ids else None


def ids_from_files(model_dir: str) -> ModelTokenIds:
    """Read config.json (also its `text_config`) and generation_config.json when they exist."""
    cfg: dict[str, Any] = {}
    p = os.path.join(model_dir, "config.json")
    if os.path.isfile(p):
        cfg = read_json_object(p, "config.json")
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}

    def get(key: str) -> Any:
        return cfg[key] if cfg.get(key) is not None else text_cfg.get(key)

    gen_eos: list[int] = []
    p = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(p):
        gen_eos = _as_ids(read_json_object(p, "generation_config.json").get("eos_token_id"), "eos_token_id", p)
    cfg_path = os.path.join(model_dir, "config.json")
    eos_all = tuple(dict.fromkeys(_as_ids(get("eos_token_id"), "eos_token_id", cfg_path) + gen_eos))
    bos, eos, pad = (_first(get(k), k, cfg_path) for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
    return ModelTokenIds(bos, eos, pad, eos_all)


def ids_from_config(config: Any) -> ModelTokenIds:
    """From a prepared ExLlamaV2Config (its spec and generation_config); unprepared ones read the files."""
    spec = getattr(config, "spec", None)
    if spec is None:
        return ids_from_files(config.model_dir)
    gen = getattr(config, "generation_config", None) or {}
    config_eos = list(getattr(spec, "eos_token_ids", ()) or ())
    eos_all = tuple(dict.fromkeys(config_eos + _as_ids(gen.get("eos_token_id"))))
    return ModelTokenIds(spec.bos_token_id, spec.eos_token_id, spec.pad_token_id, eos_all)


def token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass(frozen=True)
class SpecialIds:
    bos: int
    eos: int
    pad: int
    stop: frozenset[int]


def resolve_special_ids(model: ModelTokenIds, tokenizer_config: dict[str, Any],
                        lookup: dict[str, int]) -> SpecialIds:
    """Combine the model's ids, tokenizer_config.json and the vocabulary (`lookup`: token text -> id)."""

    def from_tok_config(key: str) -> int | None:
        text = token_text(tokenizer_config.get(key))
        return lookup.get(text) if text is not None else None

    bos = model.bos if model.bos is not None else from_tok_config("bos_token")
    eos = model.eos if model.eos is not None else from_tok_config("eos_token")
    bos = 1 if bos is None else bos
    eos = 2 if eos is None else eos
    pad = model.pad if model.pad is not None else from_tok_config("pad_token")
    if pad is None:
        pad = lookup.get("<pad>", eos if eos != bos else -1)
    return SpecialIds(bos, eos, pad, frozenset((eos, *model.eos_all)))
