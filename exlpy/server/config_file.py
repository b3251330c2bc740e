"""`exlpy serve --config FILE`: a YAML file whose keys follow TabbyAPI's config.yml where they mean the same, so
its users can bring theirs. Flags given on the command line override the file.

Each section's keys map to one option name (exlpy/server/options.py). A key exlpy does not know is an error
naming it; a TabbyAPI key that exlpy knows but does not implement is a warning saying so (the server starts
without it). Empty values (`model_name:`) mean "not set", as in TabbyAPI's sample file.
"""

from __future__ import annotations

from typing import Any

from exlpy.errors import ConfigError

# section -> {key: option name}. TabbyAPI's names first; the keys marked (exlpy) are exlpy's own additions.
KEYS: dict[str, dict[str, str]] = {
    "network": {"host": "host", "port": "port", "disable_auth": "disable_auth",
                # (exlpy)
                "api_key_file": "api_key_file", "ssl_keyfile": "ssl_keyfile", "ssl_certfile": "ssl_certfile",
                "allowed_origins": "allowed_origins", "shutdown_timeout": "shutdown_timeout",
                "metrics_require_key": "metrics_require_key", "max_queue": "max_queue",
                "max_body_mb": "max_body_mb"},
    "model": {"model_dir": "model_dir", "model_name": "model_name", "max_seq_len": "max_seq_len",
              "tensor_parallel": "tensor_parallel", "gpu_split_auto": "gpu_split_auto",
              "autosplit_reserve": "autosplit_reserve", "gpu_split": "gpu_split", "rope_scale": "rope_scale",
              "rope_alpha": "rope_alpha", "cache_mode": "cache_mode", "cache_size": "cache_size",
              "chunk_size": "chunk_size", "max_batch_size": "max_batch_size", "prompt_template": "prompt_template",
              # (exlpy)
              "vision": "vision", "served_model_name": "served_model_name", "ngram_draft": "ngram_draft",
              "allow_local_images": "allow_local_images",
              "num_draft_tokens": "num_draft_tokens"},
    "draft_model": {"draft_model_dir": "draft_model_dir", "draft_model_name": "draft_model_name",
                    "draft_rope_scale": "draft_rope_scale", "draft_rope_alpha": "draft_rope_alpha",
                    "draft_cache_mode": "draft_cache_mode", "draft_gpu_split": "draft_gpu_split"},
    "lora": {"lora_dir": "lora_dir", "loras": "loras"},
}

# TabbyAPI keys exlpy knows but does not implement: a warning each, saying why where it matters.
NOT_IMPLEMENTED: dict[str, dict[str, str]] = {
    "network": {"disable_fetch_requests": "exlpy never fetches URLs from requests",
                "send_tracebacks": "errors are answered in OpenAI's shape without tracebacks",
                "api_servers": "exlpy serves the OpenAI API only"},
    "logging": {"log_prompt": "", "log_generation_params": "", "log_requests": ""},
    "model": {"inline_model_loading": "load models through POST /v1/model/load", "use_dummy_models": "",
              "dummy_model_names": "", "use_as_default": "", "backend": "exlpy is its own backend",
              "tensor_parallel_backend": "exlpy picks its collective backend (EXLPY_TP_COMM)",
              "num_experts_per_token": "MoE models use their own num_experts_per_tok",
              "override_base_seq_len": "", "fasttensors": "exlpy reads safetensors memory-mapped",
              "max_rope": "", "cuda_malloc_backend": ""},
    "embeddings": {"embedding_model_dir": "no embeddings endpoint", "embeddings_device": "",
                   "embedding_model_name": ""},
    "sampling": {"override_preset": "requests carry their own sampling fields"},
    "developer": {"unsafe_launch": "", "disable_request_streaming": "", "cuda_malloc_backend": "",
                  "realtime_process_priority": "", "uvloop": ""},
}


# Values of unimplemented keys that are TabbyAPI's defaults (its sample config.yml) warn about nothing.
QUIET_VALUES: dict[str, Any] = {"api_servers": ["OAI"], "dummy_model_names": ["gpt-3.5-turbo"],
                                "backend": "exllamav2", "tensor_parallel_backend": "native",
                                "embeddings_device": "cpu", "embedding_model_dir": "models"}


def read_config(path: str) -> tuple[dict[str, Any], list[str]]:
    """(flat option values, warnings) from a YAML config file."""
    try:
        import yaml
    except ImportError as e:
        raise ConfigError(f"--config needs PyYAML ({e}): pip install 'exlpy[server]'") from e
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    return flatten(data, path)


def flatten(data: Any, path: str = "the config file") -> tuple[dict[str, Any], list[str]]:
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (network, model, ...), "
                          f"got {type(data).__name__}")
    values: dict[str, Any] = {}
    warnings: list[str] = []
    for section, body in data.items():
        known, unimplemented = KEYS.get(section, {}), NOT_IMPLEMENTED.get(section, {})
        if not known and not unimplemented:
            raise ConfigError(f"{path}: unknown section {section!r} (known: "
                              f"{', '.join(sorted({*KEYS, *NOT_IMPLEMENTED}))})")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping, got {type(body).__name__}")
        for key, value in body.items():
            where = f"{section}.{key}"
            if key in known:
                if value is not None and value != []:
                    values[known[key]] = value
            elif key in unimplemented:
                quiet = key in QUIET_VALUES and value in (QUIET_VALUES[key], [QUIET_VALUES[key]])
                if value is not None and value is not False and value != [] and not quiet:
                    why = unimplemented[key]
                    warnings.append(f"{path}: {where} is a TabbyAPI setting exlpy does not implement; ignored"
                                    + (f" ({why})" if why else ""))
            else:
                raise ConfigError(f"{path}: unknown key {where!r} (known in {section}: "
                                  f"{', '.join(sorted(known)) or 'none'})")
    if isinstance(values.get("api_key_file"), str):
        values["api_key_file"] = [values["api_key_file"]]
    return values, warnings
