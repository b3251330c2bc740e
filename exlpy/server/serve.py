"""Running a `RequestPlan`: score prompts where logprobs of the prompt were asked for, run every choice's job
through the bridge (several prompts x best_of candidates run at once), keep the best n by cumulative logprob,
and answer in OpenAI's shape, whole or as server-sent events.

A streamed response sends its headers once every job was accepted, so a request that fails at once still
answers with its status; a failure later arrives as an SSE `data: {"error": ...}` event before `[DONE]`. A
client that disconnects has its jobs cancelled and their cache pages freed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from json.encoder import encode_basestring as _json_str  # json.dumps(str, ensure_ascii=False)
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from exlpy.server import logprobs as lp
from exlpy.server.bridge import JobFailedError, JobHandle
from exlpy.server.format import ResultReader
from exlpy.server.plans import RequestPlan
from exlpy.server.schemas import Usage, error_body
from exlpy.server.state import ServerState
from exlpy.server.tools import parse_tool_calls


@dataclass
class Candidate:
    prompt: int
    handle: JobHandle | None  # None when the request generates nothing (max_tokens 0)
    reader: ResultReader


@dataclass
class Run:
    state: ServerState
    plan: RequestPlan
    chat: bool
    rid: str
    model_name: str = ""  # what the response names: the base model or the LoRA adapter the request chose
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_scores: list[list[lp.TokenLogprob] | None] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def pieces(self) -> list[str]:
        return self.state.pieces

    def cancel_all(self) -> None:
        for c in self.candidates:
            if c.handle is not None:
                self.state.bridge.cancel(c.handle)


async def execute(state: ServerState, plan: RequestPlan, stream: bool, request: Request, chat: bool,
                  loras: list[Any] | None = None, name: str | None = None) -> Response:
    run = Run(state, plan, chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", name or state.model_name)
    await _score_prompts(run, loras)
    try:
        for p in range(len(plan.prompts)):
            for k in range(plan.best_of):
                handle = None
                if plan.max_new_tokens[p] > 0:
                    job = plan.make_job(p, k, f"{run.rid}-{p}-{k}")
                    job.loras = loras or []  # the adapter the request's model names, else none
                    handle = await state.bridge.submit(job)
                run.candidates.append(Candidate(p, handle, ResultReader(run.pieces, plan.top_logprobs,
                                                                        plan.raw_logprobs)))
    except BaseException:
        run.cancel_all()
        raise
    watcher = asyncio.ensure_future(_watch_disconnect(request, run))
    if stream:
        # Headers go out once the first result is in, so a job that fails at once still answers 500.
        events = _Events(run.candidates)
        try:
            first = await events.next()
            if isinstance(first[1], BaseException):
                raise first[1]
        except BaseException:
            watcher.cancel()
            events.close()
            run.cancel_all()
            raise
        return StreamingResponse(_stream(run, watcher, events, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        await asyncio.gather(*(_drain(c) for c in run.candidates))
    except BaseException:
        run.cancel_all()
        raise
    finally:
        watcher.cancel()
    if any(c.handle is not None and c.reader.finish_reason is None for c in run.candidates):
        return JSONResponse(error_body("client disconnected", "client_error"), status_code=499)
    return JSONResponse(_response(run))


async def _score_prompts(run: Run, loras: list[Any] | None) -> None:
    plan = run.plan
    wanted = (plan.echo and plan.top_logprobs is not None) or plan.prompt_logprobs is not None
    if not wanted:
        run.prompt_scores = [None] * len(plan.prompts)
        return
    top = max(plan.top_logprobs or 0, plan.prompt_logprobs or 0)
    model, vocab = run.state.bridge.generator.model, len(run.pieces)
    for ids in plan.prompts:
        run.prompt_scores.append(await run.state.bridge.run_exclusive(
            lambda ids=ids: lp.score_prompt(model, ids, vocab, top, loras)))


async def _watch_disconnect(request: Request, run: Run) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            run.cancel_all()
            return


async def _drain(c: Candidate) -> None:
    if c.handle is None:
        c.reader.finish_reason = "length"
        return
    r = await c.handle.next()
    while r is not None:
        c.reader.add(r)
        r = await c.handle.next()


def _chosen(run: Run) -> list[Candidate]:
    """Per prompt, the n candidates to return (best_of: the highest cumulative logprob first)."""
    out = []
    plan = run.plan
    for p in range(len(plan.prompts)):
        cands = [c for c in run.candidates if c.prompt == p]
        if plan.best_of > plan.n:
            cands = sorted(cands, key=lambda c: c.reader.cumulative_logprob, reverse=True)
        out += cands[:plan.n]
    return out


def _usage(run: Run) -> Usage:
    prompt = sum(int(ids.shape[-1]) for ids in run.plan.prompts)
    completion = sum(c.reader.completion_tokens for c in run.candidates)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _prompt_text(run: Run, p: int) -> str:
    text = run.plan.prompt_texts[p]
    if text is None:
        out = run.state.tokenizer.decode(run.plan.prompts[p][0], decode_special_tokens=True)
        text = out[0] if isinstance(out, list) else out
    return text


def _completion_logprobs(run: Run, c: Candidate) -> dict[str, Any] | None:
    plan = run.plan
    if plan.top_logprobs is None:
        return None
    tokens, offset = c.reader.tokens, 0
    entries: list[Any] = list(c.reader.entries)
    if plan.echo:
        prompt_ids = plan.prompts[c.prompt][0].tolist()
        scores = run.prompt_scores[c.prompt] or []
        tokens, entries = prompt_ids + tokens, [None, *scores, *entries]
    return lp.legacy(entries, run.pieces, tokens, offset, plan.top_logprobs)


def _message(run: Run, c: Candidate) -> tuple[dict[str, Any], str | None]:
    text, finish = c.reader.text, c.reader.finish_reason
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if run.plan.tools is not None and finish in ("stop", "length"):  # complete calls count even when cut off
        content, calls = parse_tool_calls(text, run.plan.tools)
        if calls:
            msg = {"role": "assistant", "content": content, "tool_calls": calls}
            finish = "tool_calls"
    return msg, finish


def _response(run: Run) -> dict[str, Any]:
    plan = run.plan
    choices = []
    for i, c in enumerate(_chosen(run)):
        if run.chat:
            msg, finish = _message(run, c)
            logprobs = {"content": lp.chat(c.reader.entries, run.pieces, plan.top_logprobs or 0)} \
                if plan.top_logprobs is not None else None
            choices.append({"index": i, "message": msg, "logprobs": logprobs, "finish_reason": finish})
        else:
            text = (_prompt_text(run, c.prompt) if plan.echo else "") + c.reader.text
            choice = {"index": i, "text": text, "logprobs": _completion_logprobs(run, c),
                      "finish_reason": c.reader.finish_reason}
            if plan.prompt_logprobs is not None:
                choice["prompt_logprobs"] = lp.vllm_prompt(run.prompt_scores[c.prompt] or [], run.pieces,
                                                           plan.prompt_logprobs)
            choices.append(choice)
    out: dict[str, Any] = {"id": run.rid, "object": "chat.completion" if run.chat else "text_completion",
                           "created": run.created, "model": run.model_name, "choices": choices,
                           "usage": _usage(run).model_dump()}
    if run.chat and plan.prompt_logprobs is not None:
        out["prompt_logprobs"] = lp.vllm_prompt(run.prompt_scores[0] or [], run.pieces, plan.prompt_logprobs)
    return out


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


_MARK = "\x00exlpy-text\x00"


def _text_event(run: Run, i: int) -> tuple[str, str]:
    """The SSE event of a candidate's plain text delta (no logprobs) as (before, after) the JSON string of the
    text: built once per candidate, so each token costs one string escape instead of a json.dumps of the chunk.
    The bytes are those `_sse(_chunk(...))` writes."""
    delta: dict[str, Any] = {"index": i, "delta": {"content": _MARK}} if run.chat else {"index": i, "text": _MARK}
    delta.update({"finish_reason": None, "logprobs": None})
    before, after = _sse(_chunk(run, [delta])).split(json.dumps(_MARK), 1)
    return before, after


def _chunk(run: Run, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": run.rid, "object": "chat.completion.chunk" if run.chat else "text_completion",
            "created": run.created, "model": run.model_name, "choices": choices}


class _Events:
    """The results of a run's candidates as (candidate index, results since the last read), or (i, None) at a
    candidate's end, or (i, exception). One candidate is read straight from its handle; several through one
    task each feeding a shared queue. Every read takes all that arrived: a stream that fell behind the
    generator catches up in one chunk instead of one per token."""

    def __init__(self, candidates: list[Candidate]) -> None:
        self.single = candidates[0] if len(candidates) == 1 else None
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.tasks = [] if self.single else [asyncio.ensure_future(_pump(i, c, self.queue))
                                             for i, c in enumerate(candidates)]
        self.open = len(candidates)

    async def next(self) -> tuple[int, Any]:
        c = self.single
        if c is None:
            return await self.queue.get()
        if c.handle is None:
            return 0, None
        try:
            items = await c.handle.drain()
        except BaseException as e:  # noqa: BLE001 - reported by the stream
            return 0, e
        return 0, items or None

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


async def _pump(i: int, c: Candidate, queue: asyncio.Queue[tuple[int, Any]]) -> None:
    """Forward one candidate's results into the shared stream queue; None marks its end."""
    try:
        if c.handle is not None:
            items = await c.handle.drain()
            while items:
                queue.put_nowait((i, items))
                items = await c.handle.drain()
        queue.put_nowait((i, None))
    except BaseException as e:  # noqa: BLE001 - forwarded to the stream, which reports it
        queue.put_nowait((i, e))


async def _stream(run: Run, watcher: asyncio.Future[Any], events: _Events, first: tuple[int, Any]
                  ) -> AsyncIterator[str]:
    plan = run.plan
    held = run.chat and plan.tools is not None  # tool calls are parsed from the whole reply
    pending: list[tuple[int, Any]] = [first]
    plain = plan.top_logprobs is None
    templates = [_text_event(run, i) for i in range(len(run.candidates))] if plain else []
    try:
        for i, c in enumerate(run.candidates):
            if run.chat:
                yield _sse(_chunk(run, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]))
            elif plan.echo:
                lps = None
                if plan.top_logprobs is not None:
                    ids = plan.prompts[c.prompt][0].tolist()
                    lps = lp.legacy([None, *(run.prompt_scores[c.prompt] or [])], run.pieces, ids, 0,
                                    plan.top_logprobs)
                yield _sse(_chunk(run, [{"index": i, "text": _prompt_text(run, c.prompt), "logprobs": lps,
                                         "finish_reason": None}]))
        open_ = events.open
        while open_:
            i, items = pending.pop() if pending else await events.next()
            c = run.candidates[i]
            if isinstance(items, BaseException):
                raise items
            if items is None:
                open_ -= 1
                if c.handle is not None and c.reader.finish_reason is None:
                    return  # cancelled: the client is gone
                yield _sse(_chunk(run, [_final_delta(run, c, i, held)]))
                continue
            text, entries = "", []
            for r in items:
                t, e = c.reader.add(r)
                text += t
                entries += e
            if held or not (text or entries):
                continue
            if plain:
                before, after = templates[i]
                yield before + _json_str(text) + after
                continue
            if run.chat:
                delta = {"index": i, "delta": {"content": text}, "finish_reason": None,
                         "logprobs": {"content": lp.chat(entries, run.pieces, plan.top_logprobs or 0)}
                         if plan.top_logprobs is not None else None}
            else:
                delta = {"index": i, "text": text, "finish_reason": None,
                         "logprobs": lp.legacy(entries, run.pieces, [e.token for e in entries], 0,
                                               plan.top_logprobs) if plan.top_logprobs is not None else None}
            yield _sse(_chunk(run, [delta]))
        if plan.include_usage:
            final = _chunk(run, [])
            final["usage"] = _usage(run).model_dump()
            yield _sse(final)
        yield "data: [DONE]\n\n"
    except JobFailedError as e:
        yield _sse(error_body(str(e), "server_error", code="generation_failed"))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        events.close()
        run.cancel_all()


def _final_delta(run: Run, c: Candidate, i: int, held: bool) -> dict[str, Any]:
    if c.handle is None:
        c.reader.finish_reason = "length"  # max_tokens 0: nothing generated
    if not run.chat:
        return {"index": i, "text": "", "logprobs": None, "finish_reason": c.reader.finish_reason}
    delta: dict[str, Any] = {}
    finish = c.reader.finish_reason
    if held:
        msg, finish = _message(run, c)
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(msg["tool_calls"])]
        if msg.get("content"):
            delta["content"] = msg["content"]
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
