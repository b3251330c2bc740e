"""What a running server holds (bridge, tokenizer, model name) and how `exlpy serve` builds it from a model dir."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from exlpy.server.bridge import GeneratorBridge
from exlpy.server.lifecycle import ModelGate
from exlpy.server.options import AccessOptions, ModelOptions

DEFAULT_MAX_BODY_BYTES = 32 * 2**20  # larger request bodies get a 413 (exlpy/server/guards.py)


@dataclass
class ServerState:
    bridge: GeneratorBridge | None  # None after POST /v1/model/unload (the gate answers 503 meanwhile)
    tokenizer: Any
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get a 413
    adapters: dict[str, Any] = field(default_factory=dict)  # --lora NAME -> ExLlamaV2Lora (exlpy/server/lora.py)
    # --- access and model switching (exlpy/server/auth.py, lifecycle.py, admin.py) ---
    access: AccessOptions = field(default_factory=AccessOptions)
    gate: ModelGate = field(default_factory=ModelGate)
    model_options: ModelOptions | None = None  # how the served model was loaded (None: built by the caller)
    models_root: str | None = None  # where POST /v1/model/load finds models by name (TabbyAPI's model_dir)
    loras_root: str | None = None  # where POST /v1/lora/load finds adapters by name (TabbyAPI's lora_dir)
    max_queue: int = 64

    @property
    def max_seq_len(self) -> int:
        return int(self.generator.max_seq_len)

    @property
    def pieces(self) -> list[str]:
        return self.generator.pieces

    @property
    def generator(self) -> Any:
        if self.bridge is None:
            from exlpy.errors import ModelStateError

            raise ModelStateError("no model is loaded")
        return self.bridge.generator


def state_from_generator(generator: Any, model_name: str, max_queue: int = 64,
                         max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ServerState:
    return ServerState(GeneratorBridge(generator, max_queue=max_queue), generator.tokenizer, model_name,
                       max_body_bytes=max_body_bytes, max_queue=max_queue)


def load_state(model_dir: str | None = None, max_seq_len: int | None = None, cache_size: int | None = None,
               max_batch_size: int | None = None, max_queue: int = 64, warmup: bool = True,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, draft_model_dir: str | None = None,
               ngram_draft: bool = False, num_draft_tokens: int | None = None,
               loras: list[str] | None = None, options: ModelOptions | None = None) -> ServerState:
    """Load a model (the bundled demo by default) with a lazily allocated paged cache and wrap it for serving.

    `options` (exlpy/server/options.py) says everything about the load; without it the keyword arguments build
    one. The cache holds `cache_size` tokens (rounded up to whole 256-token pages; default: the context length,
    at least 2048): concurrent requests share it, taking pages as their sequences grow (the newest request is
    preempted and resumed later when it runs full).
    """
    from exlpy.server.loading import load_generator
    from exlpy.server.options import model_options

    if options is None:
        options = model_options({"model": model_dir, "max_seq_len": max_seq_len, "cache_size": cache_size,
                                 "max_batch_size": max_batch_size, "draft_model": draft_model_dir,
                                 "ngram_draft": ngram_draft, "num_draft_tokens": num_draft_tokens,
                                 "lora": loras})
    generator, adapters = load_generator(options, warmup=warmup)
    state = state_from_generator(generator, options.name, max_queue, max_body_bytes)
    state.adapters = adapters
    state.model_options = options
    return state
