"""Request guards of `exlpy serve`: nothing a single request sends may stall or crash the others.

- `BodyLimit`: an ASGI middleware answering 413 for a body over the limit (by Content-Length before reading
  anything, or while a chunked body streams in), so a 60 MB upload never reaches the JSON parser.
- `plan_request`: a size check on the raw prompt before anything is tokenized (a prompt with more characters
  than the context could hold at the tokenizer's longest piece per token is refused at once), then
  tokenization and chat-template rendering in a worker thread (the event loop keeps answering /health and
  streaming other requests), then the ids checked against the model's vocabulary (which may be smaller than
  the tokenizer's): a 400 naming the field, never a failed batch.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Callable
from typing import Any

from exlpy.errors import GeneratorError, SequenceLengthError
from exlpy.server.params import bad
from exlpy.server.plans import RequestPlan
from exlpy.server.state import DEFAULT_MAX_BODY_BYTES

NORMALIZER_SLACK = 2  # normalizers may drop characters (whitespace runs): allow twice the strict bound


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: HTTP request bodies larger than `max_bytes` get a 413 with an OpenAI error body."""

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, int(length))
            return
        seen = 0
        started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge()
            return message

        def tracked_send(message: dict[str, Any]) -> Any:
            # Returns send's awaitable instead of awaiting it: no coroutine of its own for each streamed event.
            nonlocal started
            started = started or message["type"] == "http.response.start"
            return send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send, seen)

    async def _refuse(self, send: Any, size: int) -> None:
        msg = (f"request body of {size} bytes exceeds the server's limit of {self.max_bytes} bytes "
               "(exlpy serve --max-body-mb)")
        body = json.dumps({"error": {"message": msg, "type": "invalid_request_error", "param": None,
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


_longest: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_piece(tokenizer: Any) -> int:
    """Most characters one token can stand for (the longest piece, special tokens included)."""
    try:
        return _longest[tokenizer]
    except (KeyError, TypeError):
        pass
    n = max((len(p) for p in tokenizer.get_id_to_piece_list(True)), default=1)
    try:
        _longest[tokenizer] = max(n, 1)
    except TypeError:
        pass
    return max(n, 1)


def prompt_chars(req: Any) -> tuple[str, int]:
    """(field, size) of a request's prompt before tokenizing: characters of text, or the number of ids."""
    if hasattr(req, "messages"):
        total = 0
        for m in req.messages or []:
            c = m.content
            total += len(c) if isinstance(c, str) else sum(len(p.text or "") for p in (c or []))
        return "messages", total
    p = req.prompt
    if isinstance(p, str):
        return "prompt", len(p)
    if isinstance(p, list) and p and all(isinstance(s, str) for s in p):
        return "prompt", max(len(s) for s in p)  # each prompt of a batch is checked on its own
    if isinstance(p, list) and p and all(isinstance(s, list) for s in p):
        return "prompt", -max(len(s) for s in p)
    return "prompt", -len(p) if isinstance(p, list) else 0  # negative: a count of token ids


def check_prompt_size(req: Any, tokenizer: Any, max_seq_len: int) -> None:
    field, size = prompt_chars(req)
    if size < 0:
        if -size > max_seq_len:  # exactly the context: plans.token_budget decides (max_tokens 0 may score it)
            raise bad(SequenceLengthError, field, f"the prompt has {-size} tokens and the context (max_seq_len) "
                      f"holds {max_seq_len}: no room for a new token")
        return
    per_token = longest_piece(tokenizer)
    limit = max_seq_len * per_token * NORMALIZER_SLACK
    if size > limit:
        raise bad(SequenceLengthError, field, f"is {size} characters long: more than a context of {max_seq_len} "
                  f"tokens can hold (at most {per_token} characters per token)")


def check_vocab(plan: RequestPlan, vocab: int, field: str) -> None:
    for i, ids in enumerate(plan.prompts):
        for e in plan.embeddings:  # image ids stand for the request's own embeddings
            ids = ids[(ids < e.first_index) | (ids >= e.first_index + e.length)]
        if ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            t = next(int(x) for x in ids.view(-1) if not 0 <= int(x) < vocab)
            where = field if len(plan.prompts) == 1 else f"{field}[{i}]"
            raise bad(GeneratorError, where, f"token id {t} is outside the model's vocabulary [0, {vocab})")


async def plan_request(plan_fn: Callable[[Any, Any, Any, int], RequestPlan], req: Any, state: Any) -> RequestPlan:
    """Size check, then tokenize / render in a worker thread, then check ids against the model's vocabulary."""
    check_prompt_size(req, state.tokenizer, state.max_seq_len)
    generator = state.bridge.generator
    plan = await asyncio.to_thread(plan_fn, req, state.tokenizer, generator.model, state.max_seq_len)
    check_vocab(plan, int(generator.model_vocab), prompt_chars(req)[0])
    return plan
