"""FastAPI app: OpenAI-compatible /v1/completions, /v1/chat/completions and /v1/models, plus /health.

Status codes: 400 for a bad request (the typed exception's message, naming the field), 503 when admission
control refuses (the queue of requests waiting to start is full), 500 when that request's job failed while
running (other requests keep going), 499 when the client went away before anything was sent.

A streamed response sends its headers only once the first result is in, so a job that fails at once still
answers 500; a failure later in the stream arrives as an SSE `data: {"error": ...}` event before `[DONE]`.
A client that disconnects has its job cancelled and its cache pages freed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from exlpy.errors import ExlpyError
from exlpy.server import guards, params
from exlpy.server.bridge import GeneratorBridge, JobFailedError, JobHandle, ServerBusyError
from exlpy.server.format import ResultReader
from exlpy.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    error_body,
)
from exlpy.server.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.bridge.start()
        yield
        await state.bridge.stop()

    app = FastAPI(title="exlpy", summary="OpenAI-compatible server over exlpy's dynamic generator",
                  lifespan=lifespan)
    app.state.exlpy = state
    app.add_middleware(guards.BodyLimit, max_bytes=state.max_body_bytes)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.bridge.alive()
        return JSONResponse({"status": "ok" if ok else "generator loop stopped", "model": state.model_name,
                             **state.bridge.stats()}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "exlpy", "max_model_len": state.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        plan = await guards.plan_request(params.plan_completion, req, state)
        return await _serve(state, plan, req.stream, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        plan = await guards.plan_request(params.plan_chat, req, state)
        return await _serve(state, plan, req.stream, request, chat=True)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, e: RequestValidationError) -> JSONResponse:
        parts, param = [], None
        for err in e.errors():
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return JSONResponse(error_body("; ".join(parts), "invalid_request_error", param), status_code=400)

    @app.exception_handler(ServerBusyError)
    async def _busy(_r: Request, e: ServerBusyError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "server_error", code="queue_full"), status_code=503,
                            headers={"Retry-After": "1"})

    @app.exception_handler(JobFailedError)
    async def _failed(_r: Request, e: JobFailedError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "server_error", code="generation_failed"), status_code=500)

    @app.exception_handler(ExlpyError)
    async def _bad(_r: Request, e: ExlpyError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "invalid_request_error", getattr(e, "param", None)),
                            status_code=400)


async def _watch_disconnect(request: Request, bridge: GeneratorBridge, handle: JobHandle) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            bridge.cancel(handle)
            return


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _serve(state: ServerState, plan: params.JobPlan, stream: bool, request: Request, chat: bool) -> Response:
    bridge = state.bridge
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    handle = await bridge.submit(plan.make_job(rid))
    watcher = asyncio.ensure_future(_watch_disconnect(request, bridge, handle))

    def done() -> None:
        watcher.cancel()
        bridge.cancel(handle)  # no-op once the job ended; frees its pages when the client left early

    reader = ResultReader(state.pieces, plan.top_logprobs, chat, plan.prompt_tokens)
    try:
        first = await handle.next()
    except BaseException:
        done()
        raise
    if first is None:
        done()
        return JSONResponse(error_body("client disconnected", "client_error"), status_code=499)
    created = int(time.time())
    if stream:
        return StreamingResponse(_stream(state, reader, handle, first, rid, created, chat, plan.include_usage,
                                         done),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        r: dict[str, Any] | None = first
        while r is not None:
            reader.add(r)
            r = await handle.next()
    finally:
        done()
    if reader.finish_reason is None:
        return JSONResponse(error_body("client disconnected", "client_error"), status_code=499)
    if chat:
        return JSONResponse(ChatCompletionResponse(
            id=rid, created=created, model=state.model_name, usage=reader.usage(),
            choices=[ChatChoice(message=AssistantMessage(content=reader.text), logprobs=reader.logprobs,
                                finish_reason=reader.finish_reason)]).model_dump())  # type: ignore[arg-type]
    return JSONResponse(CompletionResponse(
        id=rid, created=created, model=state.model_name, usage=reader.usage(),
        choices=[CompletionChoice(text=reader.text, logprobs=reader.logprobs,
                                  finish_reason=reader.finish_reason)]).model_dump())  # type: ignore[arg-type]


async def _stream(state: ServerState, reader: ResultReader, handle: JobHandle, first: dict[str, Any], rid: str,
                  created: int, chat: bool, include_usage: bool, done: Any) -> AsyncIterator[str]:
    def chunk(text: str | None, frag: dict[str, Any] | None, finish: str | None = None,
              role: bool = False) -> dict[str, Any]:
        if chat:
            delta = ChatDelta(role="assistant" if role else None, content=text)
            out = ChatCompletionChunk(id=rid, created=created, model=state.model_name,
                                      choices=[ChatChunkChoice(delta=delta, logprobs=frag,
                                                               finish_reason=finish)]).model_dump()  # type: ignore
            out["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
            return out
        return CompletionResponse(id=rid, created=created, model=state.model_name,
                                  choices=[CompletionChoice(text=text or "", logprobs=frag,
                                                            finish_reason=finish)]).model_dump()  # type: ignore

    try:
        if chat:
            yield _sse(chunk("", None, role=True))
        r: dict[str, Any] | None = first
        while r is not None:
            text, frag = reader.add(r)
            if text or (frag is not None and any(frag.values())):
                yield _sse(chunk(text, frag))
            r = await handle.next()
        if reader.finish_reason is None:
            return  # cancelled: the client is gone
        yield _sse(chunk(None if chat else "", None, finish=reader.finish_reason))
        if include_usage:
            final = chunk(None, None)
            final["choices"] = []
            final["usage"] = reader.usage().model_dump()
            yield _sse(final)
        yield "data: [DONE]\n\n"
    except JobFailedError as e:
        yield _sse(error_body(str(e), "server_error", code="generation_failed"))
        yield "data: [DONE]\n\n"
    finally:
        done()
