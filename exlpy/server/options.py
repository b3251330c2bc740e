"""`exlpy serve`'s options, parsed once into frozen objects: command-line flags over a YAML config file (whose
keys follow TabbyAPI's config.yml, exlpy/server/config_file.py) over the defaults.

Two groups, kept apart so that each concern reads on its own:
- `AccessOptions`: who may call the server and how it is reached (API and admin keys, TLS, CORS, shutdown).
- `ModelOptions`: how the model is loaded (placement, cache, RoPE overrides, prompt template, draft model,
  adapters). The admin route that loads a model builds one from its request body the same way.

`resolve(values)` takes a flat dict {option name: value or None} (argparse's namespace merged over the file's
values) and checks every value, naming the flag or key at fault.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from exlpy.errors import ConfigError

CACHE_MODES = ("FP16", "Q8", "Q6", "Q4")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds running streams may take to finish after SIGTERM
DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_MB = 32.0


@dataclass(frozen=True)
class DraftOptions:
    """A draft model for speculative decoding (TabbyAPI's `draft_model` section)."""

    model_dir: str
    cache_mode: str = "FP16"
    rope_scale: float | None = None
    rope_alpha: float | None = None
    gpu_split: tuple[float, ...] | None = None


@dataclass(frozen=True)
class LoraSpec:
    name: str  # the model name clients send
    directory: str
    scaling: float = 1.0


@dataclass(frozen=True)
class ModelOptions:
    model_dir: str | None = None  # None: the bundled demo model
    served_model_name: str | None = None
    max_seq_len: int | None = None
    cache_size: int | None = None  # tokens, rounded up to whole pages
    cache_mode: str = "FP16"
    gpu_split: tuple[float, ...] | None = None  # GB per GPU; None: automatic placement (gpu_split_auto)
    autosplit_reserve: tuple[int, ...] | None = None  # MB per GPU kept free by the automatic placement
    tensor_parallel: bool = False
    rope_scale: float | None = None  # linear RoPE scaling (config.scale_pos_emb)
    rope_alpha: float | None = None  # NTK alpha (config.scale_alpha_value)
    prompt_template: str | None = None  # a Jinja file, or the name of one of the model's own templates
    max_batch_size: int | None = None
    chunk_size: int | None = None  # prefill chunk (TabbyAPI's chunk_size)
    draft: DraftOptions | None = None
    ngram_draft: bool = False
    num_draft_tokens: int | None = None
    loras: tuple[LoraSpec, ...] = ()
    # Capacity (exlpy/server/sizing.py): the GPU share the default cache fills; prompt tokens per step next to
    # decoding requests (a lone prompt gets 256 of them, each further waiting one 256 more: generator/dynamic/
    # scheduler.py): 2048, not 256: under 64 streams (H100, 8B) 256 held the server at 49.5% of the generator's
    # throughput (TTFT p99 7.8 s), 2048 at 84-88% (2.5-2.9 s) (benchmarks/results/serving.md).
    gpu_memory_utilization: float = 0.9
    max_prefill_per_step: int = 2048
    # Images (exlpy/server/vision.py): the model's vision tower is loaded unless `vision` is false (TabbyAPI's
    # model.vision); image parts name local files only with allow_local_images (never URLs: no fetching).
    vision: bool = True
    allow_local_images: bool = False

    @property
    def name(self) -> str:
        from exlpy.demo import DEMO_MODEL_DIR

        return self.served_model_name or os.path.basename(os.path.normpath(self.model_dir or DEMO_MODEL_DIR))


@dataclass(frozen=True)
class AccessOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    disable_auth: bool = False  # TabbyAPI's network.disable_auth: every route open, admin routes included
    metrics_require_key: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    allowed_origins: tuple[str, ...] = ()  # CORS; none by default
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None


@dataclass(frozen=True)
class ServeOptions:
    access: AccessOptions
    model: ModelOptions
    models_root: str | None = None  # TabbyAPI's model_dir: where admin loads find models by name
    loras_root: str | None = None  # TabbyAPI's lora_dir
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)
    log_level: str = "info"


# --- value checks (each names the flag / key) -------------------------------------------------------------------
# Options that only a config file (or an admin request) sets: no flag of that name.
FILE_ONLY = frozenset({"gpu_split_auto", "chunk_size", "draft_model_dir", "draft_model_name", "draft_rope_scale",
                       "draft_rope_alpha", "draft_gpu_split", "model_name", "disable_auth", "loras"})


def label(option: str) -> str:
    """How a message names an option: its flag, and its key in the config file where it has one."""
    from exlpy.server.config_file import KEYS

    key = next((f"{section}.{k}" for section, keys in KEYS.items() for k, o in keys.items() if o == option), None)
    if option in FILE_ONLY and key:
        return key
    flag = "--" + option.replace("_", "-")
    return f"{flag} ({key})" if key else flag


def _positive_int(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{what} must be a positive integer, got {v!r}")
    return v


def _positive_float(v: Any, what: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{what} must be a positive finite number, got {v!r}")
    return float(v)


def _bool(v: Any, what: str, default: bool = False) -> bool:
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{what} must be true or false, got {v!r}")
    return v


def _str(v: Any, what: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{what} must be a non-empty string, got {v!r}")
    return v


def number_list(v: Any, what: str, kind: type = float) -> tuple[Any, ...] | None:
    """A list of positive numbers from YAML ([20, 24]) or a flag ("20,24"); None or [] means "not set"."""
    if v is None:
        return None
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"{what} must be a list of numbers, got {v!r}")
    out = []
    for x in items:
        try:
            n = kind(x.strip()) if isinstance(x, str) else x
        except ValueError:
            raise ConfigError(f"{what}: {x!r} is not a number") from None
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n < 0:
            raise ConfigError(f"{what}: every entry must be a number >= 0, got {x!r}")
        out.append(kind(n))
    return tuple(out) or None


def cache_mode(v: Any, what: str) -> str:
    if v is None:
        return "FP16"
    mode = str(v).upper()
    if mode not in CACHE_MODES:
        raise ConfigError(f"{what} must be one of {', '.join(CACHE_MODES)}, got {v!r}")
    return mode


def rope_alpha(v: Any, what: str) -> float | None:
    if isinstance(v, str) and v.lower() == "auto":
        return None  # TabbyAPI's "auto": exlpy leaves NTK alpha at the model's own value
    return _positive_float(v, what)


def _keys_from_file(path: str, what: str) -> tuple[list[str], list[str]]:
    """(api keys, admin keys) from a file: one key per line (# comments), or TabbyAPI's api_tokens.yml
    (`api_key: ...`, `admin_key: ...`)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot be read ({e.strerror or e})") from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if lines and all(ln.split(":", 1)[0].strip() in ("api_key", "admin_key") for ln in lines):
        import yaml

        data = yaml.safe_load(text)
        api, admin = data.get("api_key"), data.get("admin_key")
        if not all(isinstance(k, (str, type(None))) for k in (api, admin)):
            raise ConfigError(f"{what} {path}: api_key and admin_key must be strings")
        return ([api] if api else []), ([admin] if admin else [])
    if not lines:
        raise ConfigError(f"{what} {path} holds no key")
    return lines, []


def _check_keys(keys: list[str], what: str) -> tuple[str, ...]:
    for k in keys:
        if not isinstance(k, str) or not k or k != k.strip() or not k.isprintable():
            raise ConfigError(f"{what}: a key must be a non-empty printable string without surrounding spaces")
    return tuple(dict.fromkeys(keys))


def lora_specs(flags: list[str] | None, listed: Any, lora_dir: str | None) -> tuple[LoraSpec, ...]:
    """`--lora NAME=DIR` flags and TabbyAPI's `lora.loras` list ({name, scaling}, found under lora_dir)."""
    out: list[LoraSpec] = []
    for spec in flags or []:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ConfigError(f"--lora {spec!r}: expected NAME=DIR (the model name clients send, then the PEFT "
                              "adapter directory)")
        out.append(LoraSpec(name, path))
    if listed is not None:
        if not isinstance(listed, list):
            raise ConfigError(f"lora.loras must be a list of {{name, scaling}}, got {listed!r}")
        for i, item in enumerate(listed):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or \
                    set(item) - {"name", "scaling"}:
                raise ConfigError(f"lora.loras[{i}] must be {{name: DIR_NAME, scaling: NUMBER}}, got {item!r}")
            scaling = item.get("scaling", 1.0)
            if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
                raise ConfigError(f"lora.loras[{i}].scaling must be a finite number, got {scaling!r}")
            out.append(LoraSpec(item["name"], resolve_child(lora_dir, item["name"], "lora.lora_dir"),
                                float(scaling)))
    return tuple(out)


def resolve_child(root: str | None, name: str, what: str) -> str:
    """`root/name` for a name that must stay inside root (no path separators, no `..`)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(f"{name!r} must be the name of a directory inside {what}, not a path")
    if root is None:
        raise ConfigError(f"{name!r} is a name, but no {what} is set to find it in")
    return os.path.join(root, name)


def _draft(v: Mapping[str, Any]) -> DraftOptions | None:
    directory = _str(v.get("draft_model"), label("draft_model"))
    name = _str(v.get("draft_model_name"), "draft_model.draft_model_name")
    if directory is None and name is not None:
        directory = resolve_child(_str(v.get("draft_model_dir"), "draft_model.draft_model_dir"), name,
                                  "draft_model.draft_model_dir")
    if directory is None:
        return None
    return DraftOptions(directory, cache_mode(v.get("draft_cache_mode"), label("draft_cache_mode")),
                        _positive_float(v.get("draft_rope_scale"), label("draft_rope_scale")),
                        rope_alpha(v.get("draft_rope_alpha"), label("draft_rope_alpha")),
                        number_list(v.get("draft_gpu_split"), label("draft_gpu_split")))


def model_options(v: Mapping[str, Any]) -> ModelOptions:
    """ModelOptions from flat values (flags, file keys or an admin request body); None means "not set"."""
    model_dir = _str(v.get("model"), label("model"))
    if model_dir is None and v.get("model_name") is not None:
        model_dir = resolve_child(_str(v.get("model_dir"), "model.model_dir"), _str(v.get("model_name"),
                                  "model.model_name") or "", "model.model_dir")
    gpu_split = number_list(v.get("gpu_split"), label("gpu_split"))
    auto = _bool(v.get("gpu_split_auto"), label("gpu_split_auto"), default=True)
    if gpu_split is not None and v.get("gpu_split_auto") is True and not v.get("tensor_parallel"):
        raise ConfigError("gpu_split_auto: true and a gpu_split were both given: set gpu_split_auto: false to use "
                          "the split")
    if not auto and gpu_split is None and not v.get("tensor_parallel"):
        raise ConfigError("gpu_split_auto is false but no gpu_split is given: name the GB per GPU")
    max_seq_len = _positive_int(v.get("max_seq_len"), label("max_seq_len"))
    cache_size = _positive_int(v.get("cache_size"), label("cache_size"))
    if max_seq_len and cache_size and cache_size < max_seq_len:
        raise ConfigError(f"--cache-size {cache_size} is smaller than --max-seq-len {max_seq_len}: one request of "
                          "the full context would never fit")
    ngram = _bool(v.get("ngram_draft"), label("ngram_draft"))
    draft = _draft(v)
    if draft is not None and ngram:
        raise ConfigError("--draft-model and --ngram-draft are alternatives: pass one of them")
    template = _str(v.get("prompt_template"), label("prompt_template"))
    return ModelOptions(
        model_dir=model_dir, served_model_name=_str(v.get("served_model_name"), label("served_model_name")),
        max_seq_len=max_seq_len, cache_size=cache_size, cache_mode=cache_mode(v.get("cache_mode"), label("cache_mode")),
        gpu_split=gpu_split, autosplit_reserve=number_list(v.get("autosplit_reserve"), label("autosplit_reserve"), int),
        tensor_parallel=_bool(v.get("tensor_parallel"), label("tensor_parallel")),
        rope_scale=_positive_float(v.get("rope_scale"), label("rope_scale")),
        rope_alpha=rope_alpha(v.get("rope_alpha"), label("rope_alpha")), prompt_template=template,
        max_batch_size=_positive_int(v.get("max_batch_size"), label("max_batch_size")),
        chunk_size=_positive_int(v.get("chunk_size"), label("chunk_size")), draft=draft, ngram_draft=ngram,
        num_draft_tokens=_positive_int(v.get("num_draft_tokens"), label("num_draft_tokens")),
        loras=lora_specs(v.get("lora"), v.get("loras"), _str(v.get("lora_dir"), "lora.lora_dir")),
        vision=_bool(v.get("vision"), label("vision"), default=True),
        allow_local_images=_bool(v.get("allow_local_images"), label("allow_local_images")),
        **capacity(v))


def capacity(v: Mapping[str, Any]) -> dict[str, Any]:
    """--gpu-memory-utilization (0 < u <= 1) and --max-prefill-per-step, when given."""
    out: dict[str, Any] = {}
    util = _positive_float(v.get("gpu_memory_utilization"), label("gpu_memory_utilization"))
    if util is not None:
        if util > 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
        out["gpu_memory_utilization"] = util
    step = _positive_int(v.get("max_prefill_per_step"), label("max_prefill_per_step"))
    if step is not None:
        out["max_prefill_per_step"] = step
    return out


def access_options(v: Mapping[str, Any], env_key: str | None) -> AccessOptions:
    api: list[str] = list(v.get("api_key") or [])
    admin: list[str] = list(v.get("admin_key") or [])
    for path in v.get("api_key_file") or []:
        a, b = _keys_from_file(path, "--api-key-file")
        api += a
        admin += b
    if env_key:
        api.append(env_key)
    keyfile = _str(v.get("ssl_keyfile"), label("ssl_keyfile"))
    certfile = _str(v.get("ssl_certfile"), label("ssl_certfile"))
    if (keyfile is None) != (certfile is None):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together: pass both (the private key and the "
                          "certificate chain, PEM)")
    for path, what in ((keyfile, "--ssl-keyfile"), (certfile, "--ssl-certfile")):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{what} {path}: no such file")
    origins = v.get("allowed_origins") or []
    if isinstance(origins, str):
        origins = [o.strip() for o in origins.split(",") if o.strip()]
    if not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins):
        raise ConfigError(f"--allowed-origins must be a list of origins (https://host[:port]) or *, got {origins!r}")
    timeout = v.get("shutdown_timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout < 0):
        raise ConfigError(f"--shutdown-timeout must be a number of seconds >= 0, got {timeout!r}")
    port = v.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise ConfigError(f"--port must be in [0, 65535], got {port!r}")
    return AccessOptions(
        host=_str(v.get("host"), label("host")) or DEFAULT_HOST, port=DEFAULT_PORT if port is None else port,
        api_keys=_check_keys(api, "--api-key"), admin_keys=_check_keys(admin, "--admin-key"),
        disable_auth=_bool(v.get("disable_auth"), "disable_auth"),
        metrics_require_key=_bool(v.get("metrics_require_key"), label("metrics_require_key")),
        ssl_keyfile=keyfile, ssl_certfile=certfile, allowed_origins=tuple(origins),
        shutdown_timeout=DEFAULT_SHUTDOWN_TIMEOUT if timeout is None else float(timeout))


def resolve(values: Mapping[str, Any], env_key: str | None = None) -> ServeOptions:
    """ServeOptions from flat values (flags over file keys; None: not given). `env_key`: EXLPY_API_KEY."""
    max_queue = values.get("max_queue")
    if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1):
        raise ConfigError(f"--max-queue must be >= 1, got {max_queue!r}")
    body_mb = values.get("max_body_mb")
    if body_mb is not None and (isinstance(body_mb, bool) or not isinstance(body_mb, (int, float))
                                or not math.isfinite(body_mb) or body_mb <= 0):
        raise ConfigError(f"--max-body-mb must be > 0, got {body_mb!r}")
    level = values.get("log_level") or "info"
    return ServeOptions(
        access=access_options(values, env_key), model=model_options(values),
        models_root=_str(values.get("model_dir"), label("model_dir")), loras_root=_str(values.get("lora_dir"),
                                                                                    "--lora-dir"),
        max_queue=DEFAULT_MAX_QUEUE if max_queue is None else max_queue,
        max_body_bytes=int((DEFAULT_MAX_BODY_MB if body_mb is None else body_mb) * 2**20), log_level=level)
