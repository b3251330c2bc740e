"""A real `exlpy serve` HTTP server (uvicorn on 127.0.0.1, a free port, in a thread) over SmolLM2 EXL2, for
the tests that use the official `openai` client; no tests here."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from exlpy import ExLlamaV2Cache  # noqa: E402
from exlpy.generator import ExLlamaV2DynamicGenerator  # noqa: E402
from exlpy.server import create_app, state_from_generator  # noqa: E402
from tests.smollm2_util import smollm2  # noqa: E402

MODEL_NAME = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_smollm2(pages: int = 16) -> Iterator[tuple[str, Any]]:
    """Yields (base url "http://127.0.0.1:PORT", server state) while a server runs."""
    import uvicorn

    model, tok, _ = smollm2()
    cache = ExLlamaV2Cache(model, max_seq_len=pages * 256)
    gen = ExLlamaV2DynamicGenerator(model, cache, tok, max_chunk_size=2048)
    state = state_from_generator(gen, MODEL_NAME)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if time.monotonic() - t0 > 30 or not thread.is_alive():
            raise RuntimeError("exlpy test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=30)
