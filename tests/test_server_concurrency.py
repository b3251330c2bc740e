"""`exlpy serve` under load: concurrent requests share the batch, disconnects cancel, admission control answers
503, and a failing job (or a failing step) does not take down other requests or the server.

Requests run concurrently in one event loop through httpx's ASGI transport; the disconnect tests drive the ASGI
app directly so that they can hang up mid-response. Steps are slowed down where requests must overlap.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from starlette.requests import ClientDisconnect  # noqa: E402

from exlpy.generator import ExLlamaV2DynamicJob  # noqa: E402
from exlpy.server import ServerState, create_app  # noqa: E402
from tests.test_generator_helpers import PROMPTS  # noqa: E402
from tests.test_server_helpers import (  # noqa: E402
    NO_EOS,
    make_state,
    prompt_ids,
    reference_greedy,
    single_torch_thread,  # noqa: F401  (autouse fixture)
    slow_steps,
    sse_events,
    wait_for,
)


def run(state: ServerState, body: Any) -> Any:
    """Run `body(client)` against the app in a fresh event loop."""

    async def main() -> Any:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            try:
                return await body(client)
            finally:
                await state.bridge.stop()

    return asyncio.run(main())


def greedy(prompt: str, n: int, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": n, "temperature": 0, "logit_bias": NO_EOS, **kw}


def test_eight_concurrent_requests_batch_and_match_solo_outputs() -> None:
    state = make_state()

    async def body(c: Any) -> list[Any]:
        reqs = [c.post("/v1/completions", json=greedy(p, 12, stream=(i % 2 == 1))) for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*reqs)

    responses = run(state, body)
    for i, (p, r) in enumerate(zip(PROMPTS, responses)):
        assert r.status_code == 200, r.text
        if i % 2:
            text = "".join(e["choices"][0]["text"] for e in sse_events(r.text)[:-1])
        else:
            text = r.json()["choices"][0]["text"]
        assert text == reference_greedy(prompt_ids(p), 12, banned_eos=True), p
    stats = state.bridge.stats()
    assert stats["completed"] == 8 and stats["peak_running"] > 1  # they ran in one batch, not one by one
    assert stats["cache_pages_free"] == stats["cache_pages"]


async def _asgi_request(app: Any, path: str, body: dict[str, Any], spec: str, hang_up: Any) -> list[Any]:
    """POST to the ASGI app; the client hangs up once `await hang_up(sent)` returns. Returns the sent messages."""
    payload = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()
    state = {"body_sent": False}

    async def receive() -> dict[str, Any]:
        if not state["body_sent"]:
            state["body_sent"] = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set():
            if spec >= "2.4":
                raise OSError("client disconnected")
            return  # ASGI 2.3 servers (uvicorn) drop what is sent after a disconnect
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 5000), "server": ("test", 80)}
    task = asyncio.ensure_future(app(scope, receive, send))
    await hang_up(sent)
    gone.set()
    try:
        await asyncio.wait_for(task, 10)
    except ClientDisconnect:
        pass  # ASGI 2.4: Starlette learns of the disconnect from a failing send and says so
    return sent


@pytest.mark.parametrize("stream, spec", [(True, "2.3"), (True, "2.4"), (False, "2.3")])
def test_client_disconnect_cancels_the_job_and_frees_its_pages(stream: bool, spec: str) -> None:
    state = make_state()
    gen = state.bridge.generator
    slow_steps(gen, 0.01)  # 100 tokens take over a second; the hang-up comes after a few

    async def main() -> list[Any]:
        app = create_app(state)

        async def hang_up(sent: list[Any]) -> None:
            if stream:
                await wait_for(lambda: any(m.get("body", b"").startswith(b"data: ") for m in sent))
            else:
                await wait_for(lambda: gen.decode_tokens >= 3)

        try:
            sent = await _asgi_request(app, "/v1/completions", greedy("Once", 100, stream=stream), spec, hang_up)
            await wait_for(lambda: state.bridge.counters["cancelled"] == 1)
            return sent
        finally:
            await state.bridge.stop()

    sent = asyncio.run(main())
    stats = state.bridge.stats()
    assert stats["completed"] == 0 and stats["cancelled"] == 1
    assert gen.num_remaining_jobs() == 0 and stats["cache_pages_free"] == stats["cache_pages"]
    assert gen.decode_tokens < 50  # stopped well before its 100 tokens
    body = b"".join(m.get("body", b"") for m in sent)
    assert b"[DONE]" not in body


def test_full_queue_answers_503() -> None:
    state = make_state(max_batch_size=1, max_queue=1)
    slow_steps(state.bridge.generator, 0.005)
    bridge = state.bridge

    async def body(c: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
        a = asyncio.ensure_future(c.post("/v1/completions", json=greedy("Once", 40)))
        await wait_for(lambda: bridge.num_running() == 1)
        b = asyncio.ensure_future(c.post("/v1/completions", json=greedy("Why", 40)))
        await wait_for(lambda: bridge.num_queued() == 1)
        refused = await c.post("/v1/completions", json=greedy("A", 40))
        health = (await c.get("/health")).json()
        return await a, await b, refused, health

    ra, rb, refused, health = run(state, body)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    msg = refused.json()["error"]["message"]
    assert "server busy" in msg and "--max-queue 1" in msg and "1 running" in msg
    assert health["running"] == 1 and health["queued"] == 1 and health["rejected"] == 1
    for r, p in ((ra, "Once"), (rb, "Why")):
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == reference_greedy(prompt_ids(p), 40, banned_eos=True)


def test_failing_job_answers_500_and_concurrent_requests_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    real_sample, real_draw = ExLlamaV2DynamicJob.sample, ExLlamaV2DynamicJob.draw_point

    def sample(self: ExLlamaV2DynamicJob, *args: Any) -> Any:
        if self.seed == 666:  # the request picked to fail (host sampler)
            raise RuntimeError("injected sampling fault")
        return real_sample(self, *args)

    def draw_point(self: ExLlamaV2DynamicJob) -> Any:
        if self.seed == 666:  # ...and on the device-sampling path
            raise RuntimeError("injected sampling fault")
        return real_draw(self)

    monkeypatch.setattr(ExLlamaV2DynamicJob, "sample", sample)
    monkeypatch.setattr(ExLlamaV2DynamicJob, "draw_point", draw_point)
    state = make_state()
    slow_steps(state.bridge.generator, 0.005)
    sampled = {"prompt": "Echoes of", "max_tokens": 30, "temperature": 1.0, "seed": 5, "logit_bias": NO_EOS}

    async def body(c: Any) -> tuple[Any, ...]:
        good = asyncio.ensure_future(c.post("/v1/completions", json=greedy("Once", 30)))
        good_sampled = asyncio.ensure_future(c.post("/v1/completions", json=sampled))
        await wait_for(lambda: state.bridge.num_running() == 2)
        bad = await c.post("/v1/completions", json={**sampled, "seed": 666})
        bad_stream = await c.post("/v1/completions", json={**sampled, "seed": 666, "stream": True})
        alone = await c.post("/v1/completions", json=sampled)  # the same sampled request, run by itself
        return await good, await good_sampled, bad, bad_stream, alone, (await c.get("/health")).json()

    good, good_sampled, bad, bad_stream, alone, health = run(state, body)
    for r in (bad, bad_stream):
        assert r.status_code == 500 and "injected sampling fault" in r.json()["error"]["message"]
    assert good.status_code == 200
    assert good.json()["choices"][0]["text"] == reference_greedy(prompt_ids("Once"), 30, banned_eos=True)
    assert good_sampled.status_code == 200
    if state.bridge.generator.device().type == "cuda":
        # fp16 logits on a GPU depend on which rows share the step (other GEMM tiles), so a seeded draw may
        # differ from the same request run alone; here it must still run to its full length.
        assert good_sampled.json()["usage"]["completion_tokens"] == 30
    else:
        assert good_sampled.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert health["status"] == "ok" and health["failed"] == 2 and health["cache_pages_free"] == health["cache_pages"]


def test_failed_batched_step_is_retried_per_job() -> None:
    """A batched step that fails once (e.g. out of memory with many rows): every job's step is run alone and
    both requests complete exactly."""
    state = make_state()
    gen = state.bridge.generator
    slow_steps(gen, 0.005)
    real_forward = gen.stepper.forward  # every decode step starts here
    calls = {"launch": 0}

    def launch(jobs: list[Any], prev: Any) -> Any:
        if len(jobs) >= 2 and not calls["launch"]:
            calls["launch"] += 1
            raise RuntimeError("injected step fault")
        return real_forward(jobs, prev)

    gen.stepper.forward = launch

    async def body(c: Any) -> tuple[Any, ...]:
        return tuple(await asyncio.gather(*[c.post("/v1/completions", json=greedy(p, 20)) for p in ("Once", "Why")]))

    a, b = run(state, body)
    assert calls["launch"] == 1
    for r, p in ((a, "Once"), (b, "Why")):
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == reference_greedy(prompt_ids(p), 20, banned_eos=True)
    assert state.bridge.stats()["step_failures"] == 0


def test_poisoned_decode_step_fails_only_its_job() -> None:
    """A decode step that fails whenever one job is in it: the generator retries the jobs one by one, so only
    that job fails (500) and the other completes exactly, in the same batch of requests."""
    state = make_state()
    gen = state.bridge.generator
    slow_steps(gen, 0.005)
    real_forward = gen.stepper.forward  # every decode step starts here
    poison = prompt_ids("Why")[0]

    def launch(jobs: list[Any], prev: Any) -> Any:
        if any(j.sequence[:poison.numel()].equal(poison) for j in jobs):
            raise RuntimeError("injected step fault")
        return real_forward(jobs, prev)

    gen.stepper.forward = launch

    async def body(c: Any) -> tuple[Any, ...]:
        first = await asyncio.gather(*[c.post("/v1/completions", json=greedy(p, 20)) for p in ("Once", "Why")])
        left = gen.num_remaining_jobs()
        return (*first, left)

    good, bad, left = run(state, body)
    assert left == 0
    assert bad.status_code == 500 and "injected step fault" in bad.json()["error"]["message"]
    assert good.status_code == 200
    assert good.json()["choices"][0]["text"] == reference_greedy(prompt_ids("Once"), 20, banned_eos=True)
    stats = state.bridge.stats()
    assert stats["failed"] == 1 and stats["step_failures"] == 0 and stats["cache_pages_free"] == stats["cache_pages"]


def test_failed_step_fails_running_jobs_and_the_server_recovers() -> None:
    """A whole iterate() that raises (a fault outside any one job): the running jobs are failed and freed, and
    the server keeps serving."""
    state = make_state()
    gen = state.bridge.generator
    slow_steps(gen, 0.005)
    real_iterate = gen.iterate
    calls = {"raised": 0}

    def iterate() -> Any:
        if gen.num_active_jobs() >= 2 and not calls["raised"]:
            calls["raised"] += 1
            raise RuntimeError("injected step fault")  # e.g. a fault in the generator itself
        return real_iterate()

    gen.iterate = iterate

    async def body(c: Any) -> tuple[Any, ...]:
        first = await asyncio.gather(*[c.post("/v1/completions", json=greedy(p, 20)) for p in ("Once", "Why")])
        left = gen.num_remaining_jobs()  # the failed jobs must be gone from the generator, not run on unseen
        after = await c.post("/v1/completions", json=greedy("Once", 20))
        return (*first, after, left)

    a, b, after, left = run(state, body)
    assert left == 0
    for r in (a, b):
        assert r.status_code == 500 and "injected step fault" in r.json()["error"]["message"]
    assert after.status_code == 200
    assert after.json()["choices"][0]["text"] == reference_greedy(prompt_ids("Once"), 20, banned_eos=True)
    stats = state.bridge.stats()
    assert stats["step_failures"] == 1 and stats["cache_pages_free"] == stats["cache_pages"]
