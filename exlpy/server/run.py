"""Running `exlpy serve` from `ServeOptions`: load the model, build the app, and run uvicorn with TLS when asked
and a bounded shutdown (exlpy/server/lifecycle.py `drain`).

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections; running requests then have `--shutdown-timeout`
seconds to finish, after which their jobs end with an error event and the process exits. uvicorn's own
graceful-shutdown timeout, a few seconds later, is the backstop for a connection that still does not close.
"""

from __future__ import annotations

import asyncio
import ipaddress
import sys
from typing import Any

import uvicorn

from exlpy.server.lifecycle import drain
from exlpy.server.options import ServeOptions
from exlpy.server.state import ServerState

SHUTDOWN_GRACE_S = 3  # after the drain ended every job: time for the streams' last events to go out


def make_server(app: Any, state: ServerState, opts: ServeOptions) -> Any:
    """A uvicorn server for `app` with the options' address, TLS and bounded shutdown."""
    access = opts.access
    config = uvicorn.Config(app, host=access.host, port=access.port, log_level=opts.log_level,
                            ssl_keyfile=access.ssl_keyfile, ssl_certfile=access.ssl_certfile,
                            timeout_graceful_shutdown=int(access.shutdown_timeout) + SHUTDOWN_GRACE_S)
    return DrainingServer(config, state, access.shutdown_timeout)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown first drains the model's requests for at most `timeout` seconds."""

    def __init__(self, config: uvicorn.Config, state: ServerState, timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.timeout = timeout

    async def shutdown(self, sockets: Any = None) -> None:
        draining = asyncio.ensure_future(drain(self.state, self.timeout))
        try:
            await super().shutdown(sockets)
        finally:
            draining.cancel()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(opts: ServeOptions) -> int:
    from exlpy.server import create_app, load_state

    state = load_state(max_queue=opts.max_queue, max_body_bytes=opts.max_body_bytes, options=opts.model)
    state.access = opts.access
    state.models_root, state.loras_root = opts.models_root, opts.loras_root
    g = state.generator
    access = opts.access
    scheme = "https" if access.tls else "http"
    print(f"exlpy serve: {state.model_name}, context {g.max_seq_len} tokens, cache {g.num_pages} pages x 256 "
          f"tokens ({opts.model.cache_mode}), batch up to {g.max_batch_size}, queue up to {opts.max_queue}; "
          f"{scheme}://{access.host}:{access.port}/v1", flush=True)
    if state.adapters:
        print(f"LoRA adapters (model names): {', '.join(state.adapters)}", flush=True)
    if access.disable_auth:
        print("exlpy serve: warning: disable_auth is set: every route is open, admin routes included",
              file=sys.stderr, flush=True)
    elif not access.api_keys:
        where = "this machine" if is_loopback(access.host) else f"{access.host}:{access.port}"
        level = "" if is_loopback(access.host) else "warning: "
        print(f"exlpy serve: {level}no --api-key: anyone who reaches {where} can use the model",
              file=sys.stderr, flush=True)
    server = make_server(create_app(state), state, opts)
    server.run()
    return 0
