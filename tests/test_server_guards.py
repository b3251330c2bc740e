"""`exlpy serve` under hostile input: huge prompts and bodies never stall /health or crash the process, ids the
model cannot embed are a 400, and /health says how full the cache is and why requests wait."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from exlpy.server import create_app  # noqa: E402
from tests.test_server_concurrency import greedy, run  # noqa: E402
from tests.test_server_helpers import make_state, single_torch_thread  # noqa: E402, F401

JSON = {"content-type": "application/json"}


def test_huge_prompt_is_refused_without_stalling_health() -> None:
    state = make_state()
    body = json.dumps({"prompt": "Echoes of vectors " * 600_000, "max_tokens": 4}).encode()  # ~10.8 MB
    assert len(body) > 10 * 2**20

    async def scenario(c: Any) -> tuple[Any, list[float]]:
        done = asyncio.Event()
        waits: list[float] = []

        async def poll() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                waits.append(time.perf_counter() - t0)
                await asyncio.sleep(0.01)

        poller = asyncio.ensure_future(poll())
        await asyncio.sleep(0.05)
        r = await c.post("/v1/completions", content=body, headers=JSON)
        await asyncio.sleep(0.05)
        done.set()
        await poller
        return r, waits

    r, waits = run(state, scenario)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "characters long" in r.json()["error"]["message"]
    assert len(waits) >= 3 and max(waits) < 1.0, waits


def test_oversized_bodies_get_413_and_the_server_keeps_serving() -> None:
    state = make_state()

    async def chunks() -> AsyncIterator[bytes]:
        piece = b" " * 2**20
        yield b'{"prompt": "'
        for _ in range(40):  # 40 MB without a Content-Length: counted as it streams in
            yield piece
        yield b'"}'

    async def scenario(c: Any) -> tuple[Any, ...]:
        big = await c.post("/v1/completions", content=b"x" * (60 * 2**20), headers=JSON)
        streamed = await c.post("/v1/completions", content=chunks(), headers=JSON)
        ok = await c.post("/v1/completions", json=greedy("Once", 4))
        return big, streamed, ok

    big, streamed, ok = run(state, scenario)
    assert big.status_code == 413 and "exceeds the server's limit" in big.json()["error"]["message"]
    assert streamed.status_code in (400, 413)
    assert ok.status_code == 200


def test_ids_outside_the_models_vocabulary_are_a_400() -> None:
    state = make_state()
    state.bridge.generator.model_vocab = 300  # a model whose embedding is smaller than its tokenizer

    async def scenario(c: Any) -> tuple[Any, ...]:
        bad = await c.post("/v1/completions", json={"prompt": [1, 299, 450], "max_tokens": 3})
        good = await c.post("/v1/completions", json={"prompt": [1, 299, 5], "max_tokens": 3, "temperature": 0})
        return bad, good

    bad, good = run(state, scenario)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert "token id 450 is outside the model's vocabulary [0, 300)" in bad.json()["error"]["message"]
    assert good.status_code == 200


def test_health_reports_cache_tokens_and_why_requests_wait() -> None:
    state = make_state(pages=1)
    gen = state.bridge.generator

    async def scenario(c: Any) -> tuple[Any, ...]:
        first = asyncio.ensure_future(c.post("/v1/completions", json=greedy("Once", 100)))
        while gen.num_active_jobs() < 1:
            await asyncio.sleep(0.002)
        second = asyncio.ensure_future(c.post("/v1/completions", json=greedy("Why", 4)))
        while not gen.pending or gen.pending[0].wait_reason == "queued":
            await asyncio.sleep(0.002)
        health = (await c.get("/health")).json()
        return health, await first, await second

    health, first, second = run(state, scenario)
    assert health["cache_tokens"] == 256 and health["running"] == 1 and health["waiting"] == 1
    reason = health["waiting_reasons"][0]["reason"]
    assert "waiting for cache pages" in reason and "the cache holds 256 tokens" in reason
    assert first.status_code == 200 and second.status_code == 200


def test_app_is_importable_for_uvicorn() -> None:
    assert create_app(make_state()) is not None
