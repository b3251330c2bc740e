"""`exlpy serve`: an OpenAI-compatible HTTP server (the bundled demo model by default). Needs the `server` extra.

Every option can also come from `--config FILE` (YAML with TabbyAPI's key names, exlpy/server/config_file.py);
a flag given on the command line overrides the file. That is why flags default to None here: the defaults live
in exlpy/server/options.py, applied after the merge.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                       "/v1/chat/completions)")
    p.add_argument("--config", default=None, metavar="FILE", help="YAML config file with TabbyAPI's key names "
                   "(network, model, draft_model, lora); flags override it")
    p.add_argument("--host", default=None, help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default: 8000")
    p.add_argument("--max-queue", type=int, default=None, help="requests that may wait to start before new ones "
                   "are refused with 503 (default: 64)")
    p.add_argument("--max-body-mb", type=float, default=None, help="largest request body in MB; larger ones "
                   "get 413 (default: 32)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_loading_args(p)
    add_access_args(p)
    add_capacity_args(p)
    p.set_defaults(_run=run)


def add_loading_args(p: argparse.ArgumentParser) -> None:
    """How the model is loaded (exlpy/server/options.py ModelOptions)."""
    g = p.add_argument_group("model loading")
    g.add_argument("--model", "-m", default=None, help="model directory (default: the bundled 260K demo model)")
    g.add_argument("--model-dir", default=None, metavar="DIR", help="directory of model directories: "
                   "POST /v1/model/load loads them by name (TabbyAPI's model_dir)")
    g.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: the "
                   "model directory's name)")
    g.add_argument("--max-seq-len", type=int, default=None, help="context length of one request (default: the "
                   "model's)")
    g.add_argument("--cache-size", type=int, default=None, metavar="TOKENS",
                   help="KV cache shared by all requests, in tokens (rounded up to 256-token pages). Default: on "
                   "GPUs what --gpu-memory-utilization leaves after weights, activations and graphs; on the CPU 8 "
                   "full-length requests. Requests take pages as they grow; when it is full the newest request "
                   "waits (preempted) until others finish")
    g.add_argument("--cache-mode", default=None, type=str.upper, choices=["FP16", "Q8", "Q6", "Q4"],
                   help="KV cache precision (default: FP16); Q8/Q6/Q4 hold 2x/2.7x/4x the tokens per byte")
    g.add_argument("--gpu-split", default=None, metavar="GB,GB,...", help="GB of weights and cache per GPU "
                   "instead of the automatic placement")
    g.add_argument("--autosplit-reserve", default=None, metavar="MB,MB,...", help="MB per GPU the automatic "
                   "placement leaves free")
    g.add_argument("--tensor-parallel", action="store_true", default=None, help="split every layer across the "
                   "GPUs (with --gpu-split: the GB per GPU)")
    g.add_argument("--rope-scale", type=float, default=None, help="linear RoPE scaling (exllamav2's "
                   "scale_pos_emb)")
    g.add_argument("--rope-alpha", type=float, default=None, help="NTK RoPE alpha (scale_alpha_value)")
    g.add_argument("--prompt-template", default=None, metavar="FILE|NAME", help="chat template: a Jinja file, or "
                   "the name of one of the model's own templates (tokenizer_config.json)")
    g.add_argument("--max-batch-size", type=int, default=None, help="most requests decoding at once "
                   "(default: the generator's, at most one per cache page)")
    g.add_argument("--draft-model", default=None, metavar="DIR", help="speculative decoding with this draft model "
                   "(same vocabulary, any format); /health shows its acceptance rate")
    g.add_argument("--draft-cache-mode", default=None, type=str.upper, choices=["FP16", "Q8", "Q6", "Q4"],
                   help="KV cache precision of the draft model (default: FP16)")
    g.add_argument("--ngram-draft", action="store_true", default=None, help="speculative decoding with n-gram "
                   "drafts from each request's context")
    g.add_argument("--num-draft-tokens", type=int, default=None, help="tokens drafted per step (default: adapted "
                   "to the acceptance rate)")
    g.add_argument("--no-vision", dest="vision", action="store_false", default=None, help="do not load the "
                   "vision tower of a vision-language model (requests with images are then refused)")
    g.add_argument("--allow-local-images", action="store_true", default=None, help="let image_url parts name "
                   "files on this machine (file:// URLs or paths); data: URLs are always accepted, http(s) never")
    g.add_argument("--lora", action="append", default=None, metavar="NAME=DIR",
                   help="serve a PEFT LoRA adapter as model NAME (repeatable); requests for it and for the base model "
                   "share batches")
    g.add_argument("--lora-dir", default=None, metavar="DIR", help="directory of adapter directories: "
                   "POST /v1/lora/load loads them by name (TabbyAPI's lora_dir)")


def add_capacity_args(p: argparse.ArgumentParser) -> None:
    """How much the server holds at once and how it schedules prompts (exlpy/server/sizing.py; the cache's size
    itself is --cache-size above)."""
    g = p.add_argument_group("capacity")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="without --cache-size, the KV cache takes what this share of each GPU's memory leaves after "
                   "weights, activations and graphs (default: 0.9; on the CPU: 8 full-length requests)")
    g.add_argument("--max-prefill-per-step", type=int, default=None, metavar="TOKENS",
                   help="prompt tokens run per step next to decoding requests (fewer deep into long prompts; more "
                   "when many requests wait for their prompt): higher starts new requests sooner, lower keeps "
                   "decoding streams smoother (default: 2048)")


def add_access_args(p: argparse.ArgumentParser) -> None:
    """Who may call the server and how it is reached (exlpy/server/options.py AccessOptions)."""
    g = p.add_argument_group("access")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY", help="a key clients must send "
                   "(Authorization: Bearer KEY or x-api-key: KEY); repeatable. Also EXLPY_API_KEY")
    g.add_argument("--api-key-file", action="append", default=None, metavar="FILE", help="keys, one per line, "
                   "or TabbyAPI's api_tokens.yml (api_key, admin_key); repeatable")
    g.add_argument("--admin-key", action="append", default=None, metavar="KEY", help="a key for the admin routes "
                   "(loading models and adapters); without one they are disabled")
    g.add_argument("--metrics-require-key", action="store_true", default=None, help="/metrics needs an API key "
                   "too (default: open, like /health)")
    g.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="serve HTTPS with this private key")
    g.add_argument("--ssl-certfile", default=None, metavar="PEM", help="... and this certificate chain")
    g.add_argument("--allowed-origins", default=None, metavar="ORIGIN,...", help="origins browsers may call the "
                   "server from (CORS), or *; default: none")
    g.add_argument("--shutdown-timeout", type=float, default=None, metavar="SECONDS", help="on SIGTERM, how long "
                   "running requests may take to finish before they are ended with an error (default: 30)")


def options_from_args(args: argparse.Namespace) -> tuple[object, list[str]]:
    """(ServeOptions, warnings): flags over the config file over the defaults, EXLPY_API_KEY added."""
    from exlpy.runtime import options as runtime_options
    from exlpy.server.config_file import read_config
    from exlpy.server.options import resolve

    values, warnings = read_config(args.config) if args.config else ({}, [])
    flags = {k: v for k, v in vars(args).items() if v is not None and not k.startswith("_") and k != "config"}
    if "model" in flags:  # a model given by flag replaces the file's model_name, not only its model_dir
        values.pop("model_name", None)
    if "draft_model" in flags:
        values.pop("draft_model_name", None)
    return resolve({**values, **flags}, env_key=runtime_options().api_key), warnings


def run(args: argparse.Namespace) -> int:
    from exlpy.errors import ConfigError

    try:
        import uvicorn  # noqa: F401

        from exlpy.server.run import serve
    except ImportError as e:
        raise ConfigError(f"exlpy serve needs fastapi and uvicorn ({e}): pip install 'exlpy[server]'") from e
    opts, warnings = options_from_args(args)
    for w in warnings:
        print(f"exlpy serve: warning: {w}", file=sys.stderr, flush=True)
    return serve(opts)  # type: ignore[arg-type]
