"""One replica of exlpy on Ray Serve (exlpy/server/ray_app.py): a full exlpy engine (model, paged cache, dynamic
generator and its bridge thread) and `exlpy serve`'s FastAPI app (exlpy/server/app.py), which the ingress
(ray_ingress.py) calls through `forward`: the request's method, path, headers and body go in, the response's
start (status, headers) and then its body come out as a stream, chunk by chunk (tokens as they are made).

The app runs in the replica's process, called as ASGI, so every route, error, key check and streaming detail is
exactly `exlpy serve`'s. The replica runs the app's lifespan (Ray allows one ASGI ingress per application, the
ingress): the async constructor enters it, which starts the bridge on the replica's event loop, and Ray's call
of `__del__` when it removes the replica leaves it, which stops the bridge. A stream the ingress cancels (its
client went away) ends with a disconnect, as under uvicorn, so the request's jobs are cancelled.

Streams are coalesced under load. Every message the replica yields costs ~0.5 ms of CPU in the ingress and
~0.3 ms in Ray's HTTP proxy (two single-threaded Python processes), whatever it carries; at one message per token
per stream they capped the whole application at ~2,000 tokens/s on two H100s (benchmarks/results/ray_serve.md).
So a stream's first chunk (its first n chunks, one per choice, with n > 1) leaves at once, and after it the
replica sends a stream's ready tokens at most once per `window()` = open streams / the replica's share of
`stream_messages_per_s` (ray_app.py), capped at `max_stream_window_s`: the replica's messages a second stay under
its share whatever the token rate, each one carrying the tokens of several generator steps when the load is high,
and with few streams the window is shorter than a generator step, so every token leaves as it is made. The end of
a stream never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
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


def _choices(req: ForwardedRequest) -> int:
    """How many choices a streamed request has (n x prompts): so many of its first messages leave at once, so no
    choice's first token waits for the coalescing window."""
    if req.method != "POST" or not req.body:
        return 1
    try:
        body = json.loads(req.body)
        n = body.get("n") or 1
        prompt = body.get("prompt")
        prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
        return max(1, int(n) * prompts)
    except (ValueError, TypeError, AttributeError):  # the app answers a malformed body with its error
        return 1


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
        self.streams = 0  # streamed responses open in this replica (what the window is sized by)
        self.messages_per_s = opts.replica_messages_per_s
        self.max_window_s = opts.max_stream_window_s
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
        chunks; chunks that are ready together travel as one, and a stream's chunks after its first wait up to
        `window()` since its last message for the ones behind them (see the module's docstring)."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
                 "root_path": req.root_path, "query_string": req.query_string, "headers": req.headers,
                 "client": req.client, "server": ("exlpy-replica", 0), "state": {}}
        messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gone = asyncio.Event()
        finished = asyncio.Event()  # the app returned: its last message is queued, nothing more to wait for
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
                finished.set()

        task = asyncio.create_task(run())
        streaming = False
        last = 0.0  # when the last body chunk left (the window counts from there)
        immediate = _choices(req)  # body messages that leave at once: up to one per choice's first token
        try:
            done = False
            while not done:
                m = await messages.get()
                if m["type"] == "http.response.start":
                    headers = list(m.get("headers", []))
                    streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in headers)
                    if streaming:
                        self.streams += 1
                    yield {"status": int(m["status"]), "headers": headers}
                    continue
                chunks: list[bytes] = []
                done = self._take(m, chunks, messages)
                wait = last + self.window() - time.monotonic() if streaming and not immediate and not done else 0.0
                if wait > 0:  # not the first chunk: what the next steps make joins it (see the module's docstring)
                    with contextlib.suppress(asyncio.TimeoutError):  # the stream's end leaves at once
                        await asyncio.wait_for(finished.wait(), wait)
                    while not done and not messages.empty():
                        done = self._take(messages.get_nowait(), chunks, messages)
                data = b"".join(chunks)
                if data:
                    last = time.monotonic()
                    immediate = max(0, immediate - 1)
                    yield data
            await task  # the app's own exception, if it raised one
        finally:
            if streaming:
                self.streams -= 1
            gone.set()  # the ingress stopped reading (or the app finished): the app sees a disconnect
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
                task.cancel()

    @staticmethod
    def _take(m: dict[str, Any], chunks: list[bytes], messages: asyncio.Queue[dict[str, Any]]) -> bool:
        """Body chunks of `m` and of every message already queued behind it into `chunks`; True at the end."""
        while True:
            if m["type"] == "exlpy.done":
                return True
            if m["type"] == "http.response.body":
                chunks.append(m.get("body", b""))
                if not m.get("more_body", False):
                    return True
            if messages.empty():
                return False
            m = messages.get_nowait()

    def window(self) -> float:
        """How long a stream's ready chunk may wait for the next ones before it leaves: this replica's open
        streams / its share of `stream_messages_per_s` (so all of them together send at most that many messages
        a second), at most `max_stream_window_s`; next to nothing while few streams run."""
        if self.messages_per_s <= 0:
            return 0.0
        return min(self.max_window_s, self.streams / self.messages_per_s)

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
