"""When the model can serve: the gate in front of the model's routes, bounded shutdown, and model switching.

- `ModelGate` (ASGI middleware) counts the requests that use the model, from their first byte to the end of
  their response (a stream included), and answers 503 in OpenAI's shape while the gate is closed: while a model
  is being loaded, unloaded or switched, while the server shuts down, or when no model is loaded. Routes that do
  not touch the model (/health, /metrics, the admin routes, GET /v1/model) pass at any time.
- `drain(state, timeout)`: SIGTERM. The gate closes (uvicorn has already stopped accepting connections), running
  requests may finish for up to `timeout` seconds, then every job left is ended with an error: its stream gets
  an SSE error event and [DONE], a waiting non-streamed request a 503, and the process exits.
- `exclusive(state, reason)`: the admin routes' switch. The gate closes, running requests finish (they are
  bounded by their token budgets), then the body runs with no request in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from exlpy.errors import ExlpyError
from exlpy.server.auth import ADMIN_ROUTES, METRICS_ROUTE, OPEN_ROUTES

# Routes that never use the model: they stay reachable while the gate is closed.
UNGATED = OPEN_ROUTES | ADMIN_ROUTES | {METRICS_ROUTE, "/v1/model", "/v1/loras", "/v1/lora"}


class ServerShutdownError(ExlpyError, RuntimeError):
    """The server shut down before the job finished (--shutdown-timeout passed)."""


class SwitchInProgressError(ExlpyError, RuntimeError):
    """An admin change was asked for while another one runs."""


NO_MODEL = "no model is loaded (POST /v1/model/load loads one)"


class ModelGate:
    """Open / closed (with the reason) and the number of model requests in flight."""

    # Polled rather than asyncio.Event / Lock: those bind to the first loop that waits on them, and a state may
    # outlive its loop (tests build several clients over one state).
    POLL_S = 0.02

    def __init__(self) -> None:
        self.closed_reason: str | None = None
        self.active = 0
        self.switching = False  # an exclusive() section runs
        self.shutting_down = False  # drain() started: nothing reopens the gate

    def close(self, reason: str) -> None:
        self.closed_reason = reason

    def open(self) -> None:
        if not self.shutting_down:
            self.closed_reason = None

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """True once no model request is in flight; False when `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.active:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(self.POLL_S)
        return True


class GateMiddleware:
    """ASGI middleware: model routes pass an open gate (and are counted) or get 503 with the reason."""

    def __init__(self, app: Any, gate: ModelGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in UNGATED:
            await self.app(scope, receive, send)
            return
        reason = self.gate.closed_reason
        if reason is not None:
            body = json.dumps({"error": {"message": f"the model is not available: {reason}; retry shortly",
                                         "type": "server_error", "param": None, "code": "model_unavailable"}
                               }).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.gate.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.leave()


async def drain(state: Any, timeout: float) -> None:
    """Bounded shutdown: close the gate, let running requests finish for up to `timeout` seconds, then end the
    remaining jobs with ServerShutdownError (their streams send an error event)."""
    gate: ModelGate = state.gate
    gate.shutting_down = True
    gate.close("the server is shutting down")
    t0 = time.monotonic()
    if await gate.wait_idle(timeout):
        return
    bridge = state.bridge
    if bridge is not None:
        bridge.abort_all(ServerShutdownError(
            f"the server shut down; this request was still running after the shutdown timeout of {timeout:g} s "
            f"(exlpy serve --shutdown-timeout) and was ended after {time.monotonic() - t0:.1f} s"))


@contextlib.asynccontextmanager
async def exclusive(state: Any, reason: str) -> AsyncIterator[None]:
    """Close the gate with `reason`, wait for the model requests in flight to finish, run the body, reopen
    (unless the body left no model loaded: then the gate says so)."""
    gate: ModelGate = state.gate
    if gate.switching:
        raise SwitchInProgressError(f"another model or adapter change is under way ({gate.closed_reason}); "
                                    "retry when it is done")
    gate.switching = True
    gate.close(reason)
    try:
        await gate.wait_idle()
        yield
    finally:
        gate.switching = False
        if gate.shutting_down:
            pass
        elif state.bridge is None:
            gate.close(NO_MODEL)
        else:
            gate.open()
