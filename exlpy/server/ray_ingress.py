"""The ingress of exlpy on Ray Serve (exlpy/server/ray_app.py): the deployment behind Ray's HTTP proxy that
reads each request, picks its routing (ray_router.py) and hands it to an engine replica (ray_replica.py), then
streams the replica's answer back. It holds no model (a small CPU actor; `ingress_replicas` of them).

Replica failures (the replica's process died, its node went away, Ray replaced it):
- a request whose answer has not started yet is sent again, to a replica the router still lists, up to
  `retries` times (nothing the client saw is lost: a non-streaming answer is held until complete, a stream
  until its first chunk);
- past that, the client gets OpenAI's error shape with status 503, code `replica_unavailable` and a
  `Retry-After` header (any other failure of the call is a 500 in the same shape, code `internal_error`);
- a stream already running ends with an error event (`data: {"error": {...}}`, code `replica_unavailable`)
  and `data: [DONE]`, as exlpy ends a stream whose job failed, instead of hanging or being cut.
Each response says in `x-exlpy-attempts` how many replicas it took.

`GET /metrics` and `/metrics/replicas` are answered here, from every replica's metrics (ray_metrics.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from exlpy.server.auth import KeyPolicy
from exlpy.server.ray_replica import ForwardedRequest
from exlpy.server.ray_router import POLICIES, ROUTERS, ROUTING_HEADER, ROUTING_KEY_HEADER, routing_key

log = logging.getLogger("exlpy.ray")

ATTEMPTS_HEADER = "x-exlpy-attempts"
# What a replica that stopped looks like from here: its actor died or cannot be reached (node lost).
REPLICA_GONE: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass(frozen=True)
class IngressOptions:
    engine: str  # the engine deployment's name (its router holds the replicas' metrics)
    router: str = "pow2"  # the default policy; a request's `x-exlpy-routing` header overrides it
    prefix_chars: int = 1024
    retries: int = 1
    retry_after_s: int = 1
    metrics_require_key: bool = False


def _error(message: str, status: int, code: str, retry_after: int | None = None, attempts: int = 1,
           kind: str = "server_error", param: str | None = None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (ATTEMPTS_HEADER.encode(), str(attempts).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return status, headers, body


def _sse_error(message: str, code: str = "replica_unavailable") -> bytes:
    event = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((v for k, v in headers if k.lower() == name), None)


@serve.ingress()
class ExlpyIngress:
    """Ray Serve's HTTP entry of the application (see the module's docstring)."""

    def __init__(self, engine: Any, opts: IngressOptions, policy: KeyPolicy) -> None:
        self.engine = engine.options(stream=True)
        self.opts = opts
        self.policy = policy
        self.app_name = serve.get_replica_context().app_name

    def __serve_build_asgi_app__(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
        return Starlette(routes=[Route("/metrics", self._metrics), Route("/metrics/replicas", self._metrics),
                                 Route("/{path:path}", self._proxy, methods=methods)])

    # --- forwarding ------------------------------------------------------------------------------------------
    async def _proxy(self, request: Any) -> Any:
        scope = request.scope
        body = await request.body()
        headers = list(scope.get("headers") or [])
        policy = (_header(headers, ROUTING_HEADER.encode()) or b"").decode().strip().lower() or self.opts.router
        if policy not in POLICIES:
            from starlette.responses import Response

            status, hs, err = _error(f"header {ROUTING_HEADER} must be one of {', '.join(POLICIES)}, got {policy!r}",
                                     400, "invalid_routing", kind="invalid_request_error", param=ROUTING_HEADER)
            return _raw(Response(err, status_code=status), hs)
        key = None
        if policy == "prefix":
            own = _header(headers, ROUTING_KEY_HEADER.encode())
            key = own.decode(errors="replace") if own else routing_key(scope["path"], body, self.opts.prefix_chars)
        client = scope.get("client")
        req = ForwardedRequest(method=scope["method"], path=scope["path"], query_string=scope.get("query_string",
                               b""), headers=headers, body=body, root_path=scope.get("root_path", ""),
                               client=tuple(client) if client else None, routing_key=key, policy=policy)
        return await self._forward(req)

    async def _forward(self, req: ForwardedRequest) -> Any:
        from starlette.responses import Response, StreamingResponse

        attempts = 0
        while True:
            attempts += 1
            gen = self.engine.forward.remote(req)
            try:
                start = await gen.__anext__()
                status, headers = start["status"], list(start["headers"])
                stream = (_header(headers, b"content-type") or b"").startswith(b"text/event-stream")
                if stream:  # held until the first chunk: a replica lost before it is retried
                    try:
                        first = [await gen.__anext__()]
                    except StopAsyncIteration:
                        first = []
                else:  # held whole: a non-streaming answer is retried at any point
                    first = [chunk async for chunk in gen]
                break
            except REPLICA_GONE as e:
                gen.cancel()
                if attempts <= self.opts.retries:
                    log.warning("exlpy ingress: a replica stopped before answering (%s); retrying (%d/%d)",
                                type(e).__name__, attempts, self.opts.retries)
                    continue
                again = f", and so did the {attempts - 1} it was sent to again" if attempts > 1 else ""
                status, hs, err = _error(
                    f"The replica serving this request stopped before answering ({type(e).__name__}){again}; "
                    "nothing was generated for this request. Retry it.", 503, "replica_unavailable",
                    self.opts.retry_after_s, attempts)
                return _raw(Response(err, status_code=status), hs)
            except Exception as e:  # the replica's forward itself failed (a bug): OpenAI's shape, not Ray's text
                gen.cancel()
                log.exception("exlpy ingress: a replica failed to answer")
                status, hs, err = _error(f"internal error in the replica: {type(e).__name__}: {e}", 500,
                                         "internal_error", attempts=attempts)
                return _raw(Response(err, status_code=status), hs)
            except BaseException:  # cancelled (the client went away): so is the replica's work
                gen.cancel()
                raise
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        headers.append((ATTEMPTS_HEADER.encode(), str(attempts).encode()))
        if not stream:
            return _raw(Response(b"".join(first), status_code=status), headers)

        async def body() -> AsyncIterator[bytes]:
            try:
                for chunk in first:
                    yield chunk
                async for chunk in gen:
                    yield chunk
            except REPLICA_GONE as e:
                yield _sse_error(f"The replica serving this stream stopped ({type(e).__name__}); the text so far "
                                 "is incomplete. Retry the request.")
            except Exception as e:
                log.exception("exlpy ingress: a replica's stream failed")
                yield _sse_error(f"internal error in the replica: {type(e).__name__}: {e}", "internal_error")
            finally:
                gen.cancel()  # no-op when finished; a client gone away cancels the replica's stream

        return _raw(StreamingResponse(body(), status_code=status), headers)

    # --- metrics ---------------------------------------------------------------------------------------------
    async def _metrics(self, request: Any) -> Any:
        from starlette.responses import Response

        from exlpy.server import ray_metrics

        refused = self.policy.refusal("/metrics", {k.lower(): v for k, v in request.scope.get("headers") or []})
        if refused is not None:
            status, message, code = refused
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "code": code}}).encode()
            return Response(body, status_code=status, media_type="application/json")
        texts = await self._replica_metrics()
        text = ray_metrics.per_replica(texts) if request.url.path.endswith("/replicas") else ray_metrics.summed(texts)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _replica_metrics(self) -> dict[str, str]:
        router = ROUTERS.get((self.app_name, self.opts.engine))
        if router is None:  # the handle builds its router on its first request: send a cheap one
            await self._forward(ForwardedRequest(method="GET", path="/health"))
            router = ROUTERS.get((self.app_name, self.opts.engine))
        if router is None:
            return {}
        return {rid: s["metrics"] for rid, s in router.replica_stats().items() if s.get("metrics")}


def _raw(response: Any, headers: list[tuple[bytes, bytes]]) -> Any:
    """`response` with exactly `headers` (the replica's, or ours), plus a content length for a whole body."""
    if hasattr(response, "body"):
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(response.body)).encode()))
    response.raw_headers = headers
    return response
