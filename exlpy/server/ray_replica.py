"""One replica of exlpy on Ray Serve (exlpy/server/ray_app.py): a full exlpy engine (model, paged cache, dynamic
generator and its bridge thread) and `exlpy serve`'s FastAPI app (exlpy/server/app.py), which the ingress
(ray_ingress.py) calls through `forward`: the request's method, path, headers and body go in, the response's
start (status, headers) and then its body come out as a stream, chunk by chunk (tokens as they are made).

The app runs in the replica's process, called as ASGI, so every route, error, key check and streaming detail is
exactly `exlpy serve`'s. The replica runs the app's lifespan (Ray allows one ASGI ingress per application, the
ingress): the async constructor enters it, which starts the bridge on the replica's event loop, and Ray's call
of `__del__` when it removes the replica leaves it, which stops the bridge. A stream the ingress cancels (its
client went away) ends with a disconnect, as under uvicorn, so the request's jobs are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import serve

REPLICA_HEADER = "x-exlpy-replica"


@dataclass
class ForwardedRequest:
    """An HTTP request as the ingress hands it to a replica; `routing_key` and `policy` are read by the request
    router (ray_router.py) before the request leaves the ingress's process."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    root_path: str = ""
    client: tuple[str, int] | None = None
    routing_key: str | None = None
    policy: str = "pow2"  # ray_router.POLICIES: how the router picks this request's replica


def _replica_id() -> str:
    try:
        ctx = serve.get_replica_context()
        rid = getattr(ctx, "replica_id", None)
        return str(getattr(rid, "unique_id", None) or getattr(ctx, "replica_tag", None) or rid)
    except Exception:  # outside a replica (direct use of the class in a test)
        return "local"


class ReplicaHeader:
    """ASGI middleware naming the replica on every HTTP response (streams included: it edits the start message,
    never buffers the body)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class ExlpyReplica:
    """One replica: the engine and its app, reached through `forward` (see the module's docstring)."""

    async def __init__(self, opts: Any) -> None:
        from exlpy.server.app import create_app
        from exlpy.server.state import load_state

        self.replica = _replica_id()
        self.state = load_state(options=opts.model, max_queue=opts.max_queue)
        self.state.access = opts.access
        app = create_app(self.state)
        app.add_middleware(ReplicaHeader, replica=self.replica)
        self.app = app
        self._lifespan = app.router.lifespan_context(app)
        await self._lifespan.__aenter__()  # starts the bridge on this (the replica's user code) event loop

    async def __del__(self) -> None:
        lifespan = getattr(self, "_lifespan", None)
        if lifespan is not None:
            self._lifespan = None
            await lifespan.__aexit__(None, None, None)  # stops the bridge: running requests end

    async def forward(self, req: ForwardedRequest) -> AsyncIterator[dict[str, Any] | bytes]:
        """Run `req` through the app: yields the response start ({"status", "headers"}) and then the body's
        chunks; chunks that are ready together travel as one (fewer messages through Ray under load)."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
                 "root_path": req.root_path, "query_string": req.query_string, "headers": req.headers,
                 "client": req.client, "server": ("exlpy-replica", 0), "state": {}}
        messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            messages.put_nowait(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                messages.put_nowait({"type": "exlpy.done"})

        task = asyncio.create_task(run())
        try:
            done = False
            while not done:
                m = await messages.get()
                if m["type"] == "http.response.start":
                    yield {"status": int(m["status"]), "headers": list(m.get("headers", []))}
                    continue
                chunks = []
                while True:
                    if m["type"] == "exlpy.done":
                        done = True
                        break
                    if m["type"] == "http.response.body":
                        chunks.append(m.get("body", b""))
                        if not m.get("more_body", False):
                            done = True
                            break
                    if messages.empty():
                        break
                    m = messages.get_nowait()
                data = b"".join(chunks)
                if data:
                    yield data
            await task  # the app's own exception, if it raised one
        finally:
            gone.set()  # the ingress stopped reading (or the app finished): the app sees a disconnect
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
                task.cancel()

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray every `request_routing_stats_period_s` and handed to the request router, where the
        ingress sums the replicas' metrics for `/metrics` (ray_metrics.py)."""
        metrics = self.state.metrics
        text = metrics.render()[0].decode() if metrics is not None else ""
        return {"replica": self.replica, "metrics": text}

    def check_health(self) -> None:
        """Ray replaces the replica when this raises: the generator thread died (or the model was unloaded)."""
        bridge = self.state.bridge
        if bridge is None:
            raise RuntimeError(f"exlpy replica {self.replica}: no model is loaded")
        if not bridge.alive():
            raise RuntimeError(f"exlpy replica {self.replica}: the generator loop stopped")
