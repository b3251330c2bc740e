"""What a running server holds (bridge, tokenizer, model name) and how `exlpy serve` builds it from a model dir."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from exlpy.errors import ConfigError
from exlpy.generator.dynamic.pages import PAGE_SIZE
from exlpy.server.bridge import GeneratorBridge

MIN_CACHE_TOKENS = 2048  # a default cache below this would run one request at a time on short-context models
DEFAULT_MAX_BODY_BYTES = 32 * 2**20  # larger request bodies get a 413 (exlpy/server/guards.py)


@dataclass
class ServerState:
    bridge: GeneratorBridge
    tokenizer: Any
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get a 413
    adapters: dict[str, Any] = field(default_factory=dict)  # --lora NAME -> ExLlamaV2Lora (exlpy/server/lora.py)

    @property
    def max_seq_len(self) -> int:
        return int(self.bridge.generator.max_seq_len)

    @property
    def pieces(self) -> list[str]:
        return self.bridge.generator.pieces


def state_from_generator(generator: Any, model_name: str, max_queue: int = 64,
                         max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ServerState:
    return ServerState(GeneratorBridge(generator, max_queue=max_queue), generator.tokenizer, model_name,
                       max_body_bytes=max_body_bytes)


def round_to_pages(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


def load_state(model_dir: str | None = None, max_seq_len: int | None = None, cache_size: int | None = None,
               max_batch_size: int | None = None, max_queue: int = 64, warmup: bool = True,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, draft_model_dir: str | None = None,
               ngram_draft: bool = False, num_draft_tokens: int | None = None,
               loras: list[str] | None = None) -> ServerState:
    """Load a model (the bundled demo by default) with a lazily allocated paged cache and wrap it for serving.

    The cache holds `cache_size` tokens (rounded up to whole 256-token pages; default: the context length, at
    least 2048): concurrent requests share it, taking pages as their sequences grow (the newest request is
    preempted and resumed later when it runs full).
    """
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exlpy.demo import DEMO_MODEL_DIR
    from exlpy.generator.dynamic import ExLlamaV2DynamicGenerator

    model_dir = model_dir or DEMO_MODEL_DIR
    if max_seq_len is not None and max_seq_len < 1:
        raise ConfigError(f"--max-seq-len must be >= 1, got {max_seq_len}")
    if cache_size is not None and cache_size < 1:
        raise ConfigError(f"--cache-size must be >= 1 token, got {cache_size}")
    from exlpy.server.lora import load_adapters, parse_specs

    name = os.path.basename(os.path.normpath(model_dir))
    parse_specs(loras, name)  # bad --lora arguments fail before the model loads
    config = ExLlamaV2Config(model_dir)
    if max_seq_len:
        config.max_seq_len = max_seq_len
    cache_tokens = round_to_pages(cache_size or max(config.max_seq_len, MIN_CACHE_TOKENS))
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=cache_tokens, lazy=True)
    model.load_autosplit(cache, progress=sys.stderr.isatty())
    tokenizer = ExLlamaV2Tokenizer(config)
    adapters = load_adapters(model, loras, name)  # `loras`: --lora NAME=DIR arguments
    chunk = max(PAGE_SIZE, config.max_input_len // PAGE_SIZE * PAGE_SIZE)
    draft = draft_cache = None
    if draft_model_dir:
        if ngram_draft:
            raise ConfigError("--draft-model and --ngram-draft are alternatives: pass one of them")
        draft_config = ExLlamaV2Config(draft_model_dir)
        draft_config.max_seq_len = config.max_seq_len
        draft = ExLlamaV2(draft_config)
        draft_cache = ExLlamaV2Cache(draft, max_seq_len=cache_tokens, lazy=True)
        draft.load_autosplit(draft_cache, progress=sys.stderr.isatty())
    generator = ExLlamaV2DynamicGenerator(model, cache, tokenizer, max_batch_size=max_batch_size,
                                          max_chunk_size=chunk, draft_model=draft, draft_cache=draft_cache,
                                          num_draft_tokens=num_draft_tokens, use_ngram_draft=ngram_draft)
    if warmup:
        generator.warmup()
    state = state_from_generator(generator, name, max_queue, max_body_bytes)
    state.adapters = adapters
    return state
