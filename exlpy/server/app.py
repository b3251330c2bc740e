"""FastAPI app: OpenAI-compatible /v1/completions, /v1/chat/completions, /v1/models, vLLM's /tokenize,
/detokenize and /tokenizer_info, /health, and the admin routes (exlpy/server/admin.py).

Middlewares, outermost first: CORS (--allowed-origins), keys (auth.py), the model gate (lifecycle.py: 503 while
a model is switched or the server shuts down), the body limit (guards.py).

Every error is in OpenAI's shape ({"error": {"message", "type", "param", "code"}}): 400 for a bad request
(the typed exception's message, naming the field), 404 for an unknown model or route, 503 when admission
control refuses (the queue of requests waiting to start is full), 500 when a request's job failed while
running (other requests keep going), 499 when the client went away before anything was sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from exlpy.errors import ExlpyError
from exlpy.server import guards, plans
from exlpy.server.admin import add_admin_routes
from exlpy.server.auth import KeyPolicy, RequireKeys
from exlpy.server.bridge import JobFailedError, ServerBusyError
from exlpy.server.lifecycle import GateMiddleware, ServerShutdownError, SwitchInProgressError
from exlpy.server.lora import adapter_cards
from exlpy.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from exlpy.server.serve import execute
from exlpy.server.state import ServerState


class ModelNotFoundError(ExlpyError, LookupError):
    """The request names a model this server does not serve."""

    def __init__(self, name: str, served: str) -> None:
        super().__init__(f"The model `{name}` does not exist; this server serves `{served}`")
        self.param = "model"


def check_model(state: ServerState, name: str | None) -> list[Any]:
    """The LoRA adapters the request's `model` names: [] for the base model (or no name), [adapter] for a
    `--lora NAME=DIR` adapter (exlpy/server/lora.py); any other name is a 404."""
    if name is None or name == state.model_name:
        return []
    lora = state.adapters.get(name)
    if lora is None:
        raise ModelNotFoundError(name, ", ".join([state.model_name, *state.adapters]))
    return [lora]


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if state.bridge is not None:
            state.bridge.start()
        yield
        if state.bridge is not None:
            await state.bridge.stop()

    app = FastAPI(title="exlpy", summary="OpenAI-compatible server over exlpy's dynamic generator",
                  lifespan=lifespan)
    app.state.exlpy = state
    # Outermost last: CORS answers preflights before the keys are checked, keys before the gate counts a
    # request, the gate before the body is read.
    app.add_middleware(guards.BodyLimit, max_bytes=state.max_body_bytes)
    app.add_middleware(GateMiddleware, gate=state.gate)
    access = state.access
    app.add_middleware(RequireKeys, policy=KeyPolicy(access.api_keys, access.admin_keys, access.disable_auth,
                                                     access.metrics_require_key))
    if access.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(access.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    _add_error_handlers(app)
    add_admin_routes(app, state)

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "exlpy",
                "max_model_len": state.max_seq_len}

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.bridge is None or state.gate.closed_reason is not None:
            busy = state.gate.closed_reason or "no model is loaded"
            stats = state.bridge.stats() if state.bridge is not None else {}
            return JSONResponse({"status": busy, "model": state.model_name if state.bridge else None, **stats},
                                status_code=503)
        ok = state.bridge.alive()
        return JSONResponse({"status": "ok" if ok else "generator loop stopped", "model": state.model_name,
                             **state.bridge.stats()}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(), *adapter_cards(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if check_model(state, model_id):
            return next(c for c in adapter_cards(state) if c["id"] == model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        loras = check_model(state, req.model)
        plan = await guards.plan_request(plans.plan_completion, req, state)
        return await execute(state, plan, req.stream, request, chat=False, loras=loras, name=req.model)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        loras = check_model(state, req.model)
        plan = await guards.plan_request(plans.plan_chat, req, state)
        return await execute(state, plan, req.stream, request, chat=True, loras=loras, name=req.model)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(state, req.model)
        from exlpy.server.tokenize import tokenize_ids

        ids = tokenize_ids(req, state.tokenizer)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_seq_len, "tokens": ids,
                               "token_strs": None}
        if req.return_token_strs:
            pieces = state.pieces
            out["token_strs"] = [pieces[i] if 0 <= i < len(pieces) else "" for i in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        check_model(state, req.model)
        from exlpy.server.tokenize import detokenize_text

        return {"prompt": detokenize_text(req.tokens, state.tokenizer)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        from exlpy.server.tokenize import tokenizer_info as info

        return info(state.tokenizer, state.max_seq_len)

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

    @app.exception_handler(StarletteHTTPException)
    async def _http(r: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            msg = f"no route {r.method} {r.url.path} (this server has /v1/completions, /v1/chat/completions, " \
                  "/v1/models, /tokenize, /detokenize, /tokenizer_info, /health)"
            return JSONResponse(error_body(msg, "invalid_request_error", code="not_found"), status_code=404)
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ModelNotFoundError)
    async def _no_model(_r: Request, e: ModelNotFoundError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "invalid_request_error", "model", "model_not_found"),
                            status_code=404)

    @app.exception_handler(ServerBusyError)
    async def _busy(_r: Request, e: ServerBusyError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "server_error", code="queue_full"), status_code=503,
                            headers={"Retry-After": "1"})

    @app.exception_handler(JobFailedError)
    async def _failed(_r: Request, e: JobFailedError) -> JSONResponse:
        if isinstance(e.cause, ServerShutdownError):
            return JSONResponse(error_body(str(e.cause), "server_error", code="shutting_down"), status_code=503)
        return JSONResponse(error_body(str(e), "server_error", code="generation_failed"), status_code=500)

    @app.exception_handler(ServerShutdownError)
    async def _shutdown(_r: Request, e: ServerShutdownError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "server_error", code="shutting_down"), status_code=503)

    @app.exception_handler(SwitchInProgressError)
    async def _switching(_r: Request, e: SwitchInProgressError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "server_error", code="model_switching"), status_code=409)

    @app.exception_handler(ExlpyError)
    async def _bad(_r: Request, e: ExlpyError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "invalid_request_error", getattr(e, "param", None)),
                            status_code=400)

    @app.exception_handler(Exception)
    async def _internal(_r: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)
