"""What a running server holds (bridge, tokenizer, model name) and how `exlpy serve` builds it from a model dir."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from exlpy.errors import ConfigError
from exlpy.generator.dynamic.pages import PAGE_SIZE
from exlpy.server import sizing
from exlpy.server.bridge import GeneratorBridge
from exlpy.server.sizing import DEFAULT_GPU_MEMORY_UTILIZATION, CachePlan

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
    cache_plan: Any = None  # exlpy/server/sizing.CachePlan: how the KV cache was sized (on /health)

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
               loras: list[str] | None = None,
               gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
               max_prefill_per_step: int = 256) -> ServerState:
    """Load a model (the bundled demo by default) with a paged cache and wrap it for serving.

    The cache holds `cache_size` tokens (rounded up to whole 256-token pages); by default what fits in
    `gpu_memory_utilization` of the GPUs' memory after weights, activations and graphs, or on the CPU 8
    full-length requests (exlpy/server/sizing.py). Concurrent requests share it, taking pages as their
    sequences grow (the newest request is preempted and resumed later when it runs full).
    """
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exlpy.demo import DEMO_MODEL_DIR
    from exlpy.generator.dynamic import ExLlamaV2DynamicGenerator
    from exlpy.server.metrics import KernelCompiles

    KernelCompiles.install()  # compiles before mark_ready() count as startup, after it as serving
    model_dir = model_dir or DEMO_MODEL_DIR
    if max_seq_len is not None and max_seq_len < 1:
        raise ConfigError(f"--max-seq-len must be >= 1, got {max_seq_len}")
    if cache_size is not None and cache_size < 1:
        raise ConfigError(f"--cache-size must be >= 1 token, got {cache_size}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    from exlpy.server.lora import load_adapters, parse_specs

    name = os.path.basename(os.path.normpath(model_dir))
    parse_specs(loras, name)  # bad --lora arguments fail before the model loads
    config = ExLlamaV2Config(model_dir)
    if max_seq_len:
        config.max_seq_len = max_seq_len
    # Placement reserves room for a placeholder of one context; the default size is taken once the weights
    # are in place (_size_cache).
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
    plan = _size_cache(model, [cache] + ([draft_cache] if draft_cache is not None else []), cache_size,
                       gpu_memory_utilization, chunk, max_batch_size or max(1, config.max_input_len // 8),
                       min(config.max_seq_len, cache_tokens) if cache_size else config.max_seq_len)
    if plan.tokens != cache.max_seq_len:
        cache = _replace_cache(model, cache, plan.tokens)
        if draft is not None:
            draft_cache = _replace_cache(draft, draft_cache, plan.tokens)
    if max_batch_size is None:  # no more rows than the cache has pages (each running request holds one)
        max_batch_size = max(1, min(config.max_input_len // 8, plan.tokens // PAGE_SIZE))
    generator = ExLlamaV2DynamicGenerator(model, cache, tokenizer, max_batch_size=max_batch_size,
                                          max_chunk_size=chunk, max_prefill_per_step=max_prefill_per_step,
                                          draft_model=draft, draft_cache=draft_cache,
                                          num_draft_tokens=num_draft_tokens, use_ngram_draft=ngram_draft)
    if warmup:
        generator.warmup()
    KernelCompiles.mark_ready()
    state = state_from_generator(generator, name, max_queue, max_body_bytes)
    state.adapters = adapters
    state.cache_plan = plan
    return state


def _size_cache(model: Any, caches: list[Any], cache_size: int | None, utilization: float, chunk: int,
                max_batch: int, max_seq_len: int) -> CachePlan:
    """The cache's size: `--cache-size` as given, else from free GPU memory, else the CPU default."""
    from exlpy.engine.graphs import BUCKETS, bucket_for

    per_token = sizing.caches_per_token(caches)
    if cache_size:
        tokens = caches[0].max_seq_len
        return CachePlan(tokens, "--cache-size", int(sum(per_token.values()) * tokens), max_seq_len, PAGE_SIZE)
    if any(d.startswith("cuda") for d in per_token):
        top = bucket_for(max_batch) or max_batch
        widths = [w for w in BUCKETS if w <= (bucket_for(-(-max_seq_len // PAGE_SIZE)) or 256)]
        shapes = [(r, w) for r in BUCKETS if r <= top for w in widths]
        return sizing.measure_and_size(model, caches, utilization, PAGE_SIZE, chunk, shapes, max_seq_len)
    kv = sum(per_token.values())
    tokens = sizing.cpu_default_tokens(max_seq_len, kv, sizing.available_ram(), PAGE_SIZE, MIN_CACHE_TOKENS)
    return CachePlan(tokens, "CPU default", int(kv * tokens), max_seq_len, PAGE_SIZE)


def _replace_cache(model: Any, cache: Any, tokens: int) -> Any:
    """A cache of `tokens` on the devices the model's layers were placed on, in place of the placeholder."""
    from exlpy import ExLlamaV2Cache

    for i in range(cache.num_hidden_layers):
        cache.free_layer(i)
    del cache
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ExLlamaV2Cache(model, max_seq_len=tokens)
