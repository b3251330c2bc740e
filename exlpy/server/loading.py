"""Loading a model for serving from `ModelOptions`: placement (automatic, `gpu_split`, tensor parallelism), the
cache kind (FP16 / Q8 / Q6 / Q4) and size, RoPE overrides, the prompt template, a draft model and LoRA adapters,
all through the library's own API (the same calls a user of exllamav2's API makes).

`load_generator` returns a ready `ExLlamaV2DynamicGenerator` and the adapters by name; `unload_generator` gives
every device buffer back, so the admin routes can switch models without restarting.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

from exlpy.errors import ConfigError
from exlpy.generator.dynamic.pages import PAGE_SIZE
from exlpy.server import sizing
from exlpy.server.lora import load_adapters
from exlpy.server.options import DraftOptions, ModelOptions
from exlpy.server.sizing import CachePlan

MIN_CACHE_TOKENS = 2048  # a default cache below this would run one request at a time on short-context models
GB = 1024**3
MB = 1024**2


def round_to_pages(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


def cache_class(mode: str) -> type:
    from exlpy.cache import ExLlamaV2Cache, ExLlamaV2Cache_Q4, ExLlamaV2Cache_Q6, ExLlamaV2Cache_Q8

    return {"FP16": ExLlamaV2Cache, "Q8": ExLlamaV2Cache_Q8, "Q6": ExLlamaV2Cache_Q6,
            "Q4": ExLlamaV2Cache_Q4}[mode]


def model_config(model_dir: str, max_seq_len: int | None, rope_scale: float | None,
                 rope_alpha: float | None) -> Any:
    from exlpy import ExLlamaV2Config

    if not os.path.isdir(model_dir):
        raise ConfigError(f"model directory {model_dir} does not exist")
    config = ExLlamaV2Config(model_dir)
    if max_seq_len:
        config.max_seq_len = max_seq_len
    if rope_scale is not None:
        config.scale_pos_emb = rope_scale
    if rope_alpha is not None:
        config.scale_alpha_value = rope_alpha
    return config


def place(model: Any, cache_tokens: int, mode: str, gpu_split: tuple[float, ...] | None, tensor_parallel: bool,
          reserve_mb: tuple[int, ...] | None = None) -> Any:
    """Load `model` as asked and return its cache of `cache_tokens` tokens."""
    cls = cache_class(mode)
    progress = sys.stderr.isatty()
    split = list(gpu_split) if gpu_split else None
    if tensor_parallel:
        from exlpy.cache import ExLlamaV2Cache_TP

        model.load_tp(split, progress=progress, expect_cache_tokens=cache_tokens, expect_cache_base=cls)
        return ExLlamaV2Cache_TP(model, base=cls, max_seq_len=cache_tokens)
    if split is not None:
        model.load(gpu_split=split, progress=progress)
        return cls(model, max_seq_len=cache_tokens)
    cache = cls(model, max_seq_len=cache_tokens, lazy=True)
    reserve = [r * MB for r in reserve_mb] if reserve_mb else None
    model.load_autosplit(cache, reserve_vram=reserve, progress=progress)
    return cache


def set_prompt_template(tokenizer: Any, template: str, model_dir: str) -> None:
    """A Jinja file, or the name of one of the model's own templates (tokenizer_config.json may hold a list of
    {name, template}), becomes the template every chat request is rendered with."""
    from exlpy.tokenizer.chat import _compile, select_template

    if os.path.isfile(template):
        try:
            with open(template, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompt-template {template}: cannot be read ({e})") from None
        source = f"prompt template {template}"
    elif template.endswith((".jinja", ".j2")) or os.sep in template:
        raise ConfigError(f"--prompt-template {template}: no such file")
    else:
        try:
            text = select_template(tokenizer.tokenizer_config.get("chat_template"), template, model_dir)
        except Exception as e:  # ChatTemplateError: no template of that name
            raise ConfigError(f"--prompt-template {template!r} is neither a file nor a template of the model: "
                              f"{e}") from None
        source = f"chat template {template!r} of {model_dir}"
    _compile(text, source)  # a template that does not parse fails now, not at the first request
    tokenizer.tokenizer_config["chat_template"] = text


def load_draft(draft: DraftOptions, max_seq_len: int, cache_tokens: int) -> tuple[Any, Any]:
    from exlpy import ExLlamaV2

    config = model_config(draft.model_dir, None, draft.rope_scale, draft.rope_alpha)
    config.max_seq_len = max_seq_len
    model = ExLlamaV2(config)
    return model, place(model, cache_tokens, draft.cache_mode, draft.gpu_split, False)


def load_generator(opts: ModelOptions, warmup: bool = True) -> tuple[Any, dict[str, Any]]:
    """(dynamic generator, adapters by name) for `opts`; the bundled demo model when no directory is given.
    Without `cache_size`, an automatically placed model's cache is sized from free GPU memory (or the CPU
    default) once the weights are in place: `cache_plan_of(generator)` says how."""
    from exlpy import ExLlamaV2, ExLlamaV2Tokenizer
    from exlpy.demo import DEMO_MODEL_DIR
    from exlpy.generator.dynamic import ExLlamaV2DynamicGenerator
    from exlpy.server.metrics import KernelCompiles

    KernelCompiles.install()  # compiles before mark_ready() count as startup, after it as serving
    model_dir = opts.model_dir or DEMO_MODEL_DIR
    config = model_config(model_dir, opts.max_seq_len, opts.rope_scale, opts.rope_alpha)
    # Placement reserves room for a placeholder of one context; the default size is taken once the weights are
    # in place (_size_cache).
    cache_tokens = round_to_pages(opts.cache_size or max(config.max_seq_len, MIN_CACHE_TOKENS))
    tokenizer = ExLlamaV2Tokenizer(config)
    if opts.prompt_template:
        set_prompt_template(tokenizer, opts.prompt_template, model_dir)
    model = ExLlamaV2(config)
    from exlpy.server.vision import attach, detach

    # The vision tower first: the placement and the cache size then see the memory it takes.
    attach(model, opts.vision, opts.allow_local_images)
    try:
        cache = place(model, cache_tokens, opts.cache_mode, opts.gpu_split, opts.tensor_parallel,
                      opts.autosplit_reserve)
    except BaseException:
        detach(model)
        raise
    try:
        adapters = load_adapters(model, opts.loras, opts.name)
        draft = draft_cache = None
        if opts.draft is not None:
            draft, draft_cache = load_draft(opts.draft, config.max_seq_len, cache_tokens)
        chunk = opts.chunk_size or config.max_input_len
        chunk = max(PAGE_SIZE, chunk // PAGE_SIZE * PAGE_SIZE)
        default_batch = max(1, config.max_input_len // 8)
        plan = _size_cache(model, cache, draft_cache, opts, chunk, opts.max_batch_size or default_batch,
                           min(config.max_seq_len, cache_tokens))
        if plan.tokens != cache.max_seq_len:
            cache = _replace_cache(model, cache, plan.tokens, opts.cache_mode)
            if draft is not None and opts.draft is not None:
                draft_cache = _replace_cache(draft, draft_cache, plan.tokens, opts.draft.cache_mode)
        # No more rows than the cache has pages (each running request holds at least one).
        batch = opts.max_batch_size or max(1, min(default_batch, plan.tokens // PAGE_SIZE))
        generator = ExLlamaV2DynamicGenerator(model, cache, tokenizer, max_batch_size=batch,
                                              max_chunk_size=chunk, max_prefill_per_step=opts.max_prefill_per_step,
                                              draft_model=draft, draft_cache=draft_cache,
                                              num_draft_tokens=opts.num_draft_tokens,
                                              use_ngram_draft=opts.ngram_draft)
    except BaseException:
        detach(model)
        model.unload()
        raise
    if warmup:
        generator.warmup()
    KernelCompiles.mark_ready()
    _PLANS[generator] = plan
    return generator, adapters


_PLANS: weakref.WeakKeyDictionary[Any, CachePlan] = weakref.WeakKeyDictionary()


def cache_plan_of(generator: Any) -> CachePlan | None:
    """How `load_generator` sized this generator's cache (None for a generator built elsewhere)."""
    return _PLANS.get(generator)


def cache_plan_dict(generator: Any) -> dict[str, Any]:
    plan = cache_plan_of(generator)
    return plan.as_dict() if plan is not None else {}


def _size_cache(model: Any, cache: Any, draft_cache: Any, opts: ModelOptions, chunk: int, max_batch: int,
                max_seq_len: int) -> CachePlan:
    """The cache's size: `cache_size` as given; from free GPU memory for an automatically placed model; the
    placeholder (one context) under tensor parallelism or a manual gpu_split; else the CPU default."""
    from exlpy.engine.graphs import BUCKETS, bucket_for

    caches = [cache] + ([draft_cache] if draft_cache is not None else [])
    per_token = sizing.caches_per_token(caches)
    kv = sum(per_token.values())
    tokens = cache.max_seq_len
    if opts.cache_size:
        return CachePlan(tokens, "--cache-size", int(kv * tokens), max_seq_len, PAGE_SIZE)
    if opts.tensor_parallel or opts.gpu_split:
        return CachePlan(tokens, "one context (set --cache-size with --gpu-split / --tensor-parallel)",
                         int(kv * tokens), max_seq_len, PAGE_SIZE)
    if any(d.startswith("cuda") for d in per_token):
        top = bucket_for(max_batch) or max_batch
        widths = [w for w in BUCKETS if w <= (bucket_for(-(-max_seq_len // PAGE_SIZE)) or 256)]
        shapes = [(r, w) for r in BUCKETS if r <= top for w in widths]
        return sizing.measure_and_size(model, caches, opts.gpu_memory_utilization, PAGE_SIZE, chunk, shapes,
                                       max_seq_len)
    tokens = sizing.cpu_default_tokens(max_seq_len, kv, sizing.available_ram(), PAGE_SIZE, MIN_CACHE_TOKENS)
    return CachePlan(tokens, "CPU default", int(kv * tokens), max_seq_len, PAGE_SIZE)


def _replace_cache(model: Any, cache: Any, tokens: int, mode: str) -> Any:
    """A cache of `tokens` on the devices the model's layers were placed on, in place of the placeholder."""
    for i in range(cache.num_hidden_layers):
        cache.free_layer(i)
    del cache
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - freeing the allocator's cache is best effort
        pass
    return cache_class(mode)(model, max_seq_len=tokens)


def unload_generator(generator: Any, adapters: dict[str, Any]) -> None:
    """Give back the model's, the draft model's and the adapters' device memory."""
    import gc

    from exlpy.server.vision import detach

    for lora in adapters.values():
        lora.unload()
    generator.clear_queue()
    detach(generator.model)
    for model in (getattr(generator, "draft_model", None), generator.model):
        if model is not None and model.loaded:
            model.unload()
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - freeing the allocator's cache is best effort
        pass
