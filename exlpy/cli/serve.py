"""`exlpy serve`: an OpenAI-compatible HTTP server (the bundled demo model by default). Needs the `server` extra."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                       "/v1/chat/completions)")
    p.add_argument("--model", "-m", default=None, help="model directory (default: the bundled 260K demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-seq-len", type=int, default=None, help="context length of one request (default: the "
                   "model's)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait to start before new ones "
                   "are refused with 503 (default: 64)")
    p.add_argument("--draft-model", default=None, metavar="DIR", help="speculative decoding with this draft model "
                   "(same vocabulary, any format); /health shows its acceptance rate")
    p.add_argument("--ngram-draft", action="store_true", help="speculative decoding with n-gram drafts from each "
                   "request's context")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="tokens drafted per step (default: adapted "
                   "to the acceptance rate)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body in MB; larger ones "
                   "get 413 (default: 32)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: the "
                   "model directory's name)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="serve a PEFT LoRA adapter as model NAME (repeatable); requests for it and for the base model "
                   "share batches")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_capacity_args(p)
    p.set_defaults(_run=run)


def add_capacity_args(p: argparse.ArgumentParser) -> None:
    """How much the server holds at once: the KV cache and the batch (exlpy/server/sizing.py)."""
    g = p.add_argument_group("capacity")
    g.add_argument("--cache-size", type=int, default=None, metavar="TOKENS",
                   help="KV cache shared by all requests, in tokens (rounded up to 256-token pages). Default: on "
                   "GPUs what --gpu-memory-utilization leaves after weights, activations and graphs; on the CPU 8 "
                   "full-length requests. Requests take pages as they grow; when it is full the newest request "
                   "waits (preempted) until others finish")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="share of each GPU's memory the server may use, the KV cache taking what weights, "
                   "activations and graphs leave (default: 0.9; ignored with --cache-size)")
    g.add_argument("--max-batch-size", type=int, default=None, help="most requests decoding at once "
                   "(default: the generator's, at most one per cache page)")
    g.add_argument("--max-prefill-per-step", type=int, default=256, metavar="TOKENS",
                   help="prompt tokens run per step next to decoding requests (fewer deep into long prompts; more "
                   "when many more requests wait for their prompt than decode): higher starts new requests sooner, "
                   "lower keeps decoding streams smoother (default: 256)")


def run(args: argparse.Namespace) -> int:
    from exlpy.errors import ConfigError

    try:
        import uvicorn

        from exlpy.server import create_app, load_state
    except ImportError as e:
        raise ConfigError(f"exlpy serve needs fastapi and uvicorn ({e}): pip install 'exlpy[server]'") from e
    if args.max_queue < 1:
        raise ConfigError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not args.max_body_mb > 0:
        raise ConfigError(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    state = load_state(args.model, max_seq_len=args.max_seq_len, cache_size=args.cache_size,
                       max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                       max_body_bytes=int(args.max_body_mb * 2**20), draft_model_dir=args.draft_model,
                       ngram_draft=args.ngram_draft, num_draft_tokens=args.num_draft_tokens, loras=args.lora,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       max_prefill_per_step=args.max_prefill_per_step)
    if args.served_model_name:
        state.model_name = args.served_model_name
    g = state.bridge.generator
    print(f"exlpy serve: {state.model_name}, context {g.max_seq_len} tokens, batch up to {g.max_batch_size}, queue "
          f"up to {args.max_queue}; http://{args.host}:{args.port}/v1", flush=True)
    if state.cache_plan is not None:
        print(state.cache_plan.describe(), flush=True)
    if state.adapters:
        print(f"LoRA adapters (model names): {', '.join(state.adapters)}", flush=True)
    _share_the_gil()
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _share_the_gil() -> None:
    """The generator thread and the event loop share one interpreter lock. A thread that wants it back (the
    generator after waiting for the GPU, the loop after a socket wait) waits up to the switch interval while the
    other runs Python: 5 ms by default, half a decode step of an 8B model. 1 ms bounds that wait."""
    import sys

    sys.setswitchinterval(0.001)
