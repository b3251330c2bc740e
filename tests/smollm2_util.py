"""SmolLM2-135M-Instruct EXL2 (../shared) loaded once, with a dynamic generator; no tests here."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tests.conftest import shared_path

SMOL = ("models", "smollm2-135m-exl2-4.0")


@lru_cache(maxsize=1)
def _load(path: str) -> tuple[Any, Any, Any]:
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exlpy.generator import ExLlamaV2DynamicGenerator

    cfg = ExLlamaV2Config(path)
    cfg.max_seq_len = 2048
    model = ExLlamaV2(cfg)
    cache = ExLlamaV2Cache(model, max_seq_len=4096, lazy=True)
    model.load_autosplit(cache)
    tok = ExLlamaV2Tokenizer(cfg)
    return model, tok, ExLlamaV2DynamicGenerator(model, cache, tok, max_chunk_size=2048)


def smollm2() -> tuple[Any, Any, Any]:
    """(model, tokenizer, dynamic generator) of the real SmolLM2 EXL2 model."""
    return _load(str(shared_path(*SMOL)))


def chat_prompt(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
