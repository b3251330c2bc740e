"""A replica of exlpy on Ray Serve coalesces a stream's tokens under load (exlpy/server/ray_replica.py): the first
chunk leaves at once, later ones wait up to the window for the tokens behind them, the end never waits, and the
text is the same as one message per token. The replica class is driven directly (no Ray cluster): `forward` is
what the ingress calls through Ray."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("exlpy.server.ray_app", exc_type=ImportError)  # skips (with the reason) on a Ray too old

from exlpy.demo import DEMO_MODEL_DIR  # noqa: E402
from exlpy.server.ray_app import parse_args  # noqa: E402
from exlpy.server.ray_replica import ExlpyReplica, ForwardedRequest  # noqa: E402
from tests.test_server_helpers import NO_EOS  # noqa: E402

TOKENS = 24


def text_of(body: bytes) -> tuple[str, int]:
    """The streamed text and the number of SSE data events of a streamed completion's body."""
    events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), len(events)


async def stream_once(replica: ExlpyReplica, n: int = 1) -> tuple[list[tuple[float, bytes]], float]:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": TOKENS, "temperature": 0, "stream": True,
                       "logit_bias": NO_EOS, "n": n}).encode()
    req = ForwardedRequest(method="POST", path="/v1/completions", body=body,
                           headers=[(b"content-type", b"application/json")])
    out: list[tuple[float, bytes]] = []
    t0 = time.monotonic()
    async for item in replica.forward(req):
        if isinstance(item, dict):
            assert item["status"] == 200
            continue
        out.append((time.monotonic() - t0, item))
    return out, time.monotonic() - t0


async def scenario() -> dict[str, Any]:
    results = {}
    for rate, window in ((0.0, 0.25), (0.1, 60.0)):  # every token at once; a 10 s window for one stream
        opts = parse_args({"model": DEMO_MODEL_DIR, "max_seq_len": "512", "cache_size": "2048",
                           "disable_auth": "true", "stream_messages_per_s": str(rate),
                           "max_stream_window_s": str(window)})
        replica = object.__new__(ExlpyReplica)
        await replica.__init__(opts)  # what Ray does on the replica's event loop
        try:
            assert replica.window() == 0.0  # no stream open
            await stream_once(replica)  # warm-up
            results[rate] = await stream_once(replica)
            if rate:
                results["n2"] = await stream_once(replica, n=2)
            assert replica.streams == 0
        finally:
            await replica.__del__()
    return results


# Python's garbage collector calls the (async, Ray-called) __del__ of the replicas built here once more, unawaited.
@pytest.mark.filterwarnings("ignore:coroutine 'ExlpyReplica.__del__' was never awaited:RuntimeWarning")
def test_stream_is_coalesced_under_its_window_and_keeps_its_text() -> None:
    results = asyncio.run(scenario())
    plain, _ = results[0.0]
    held, wall = results[0.1]
    text, _ = text_of(b"".join(b for _, b in plain))
    assert len(plain) >= TOKENS // 2  # a message per token (some may be ready together)
    assert text_of(b"".join(b for _, b in held))[0] == text  # the same text (events may merge tokens)
    # One stream, 0.1 messages a second: the first token at once, then everything else in one message when the
    # stream ends (not after the 10 s window).
    assert len(held) == 2, [b for _, b in held]
    assert text_of(held[0][1] + b"data: [DONE]\n\n")[1] <= 3
    assert wall < 8.0
    # n = 2: each choice's first token leaves at once (the first two messages hold both), the rest at the end
    n2, wall = results["n2"]
    first = [json.loads(line[6:]) for _, b in n2[:2] for line in b.decode().split("\n")
             if line.startswith("data: {")]
    assert {c["choices"][0]["index"] for c in first if c["choices"]} == {0, 1}
    assert len(n2) <= 3 and wall < 8.0
