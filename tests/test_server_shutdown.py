"""Bounded shutdown of `exlpy serve` as a real process: SIGTERM with streams in flight. Streams that finish within
--shutdown-timeout end normally; the others get an SSE error event and [DONE] when it runs out, and the process
exits a few seconds later."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tests.conftest import child_env  # noqa: E402
from tests.openai_server import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 2.0
NO_EOS = {"2": -100.0}


def _start(port: int, *flags: str) -> subprocess.Popen[str]:
    # A context of 8192 tokens on the demo model (RoPE past its 128 trained positions: the text is noise, but the
    # streams last long enough to still run at the signal).
    proc = subprocess.Popen([sys.executable, "-m", "exlpy", "serve", "--port", str(port), "--log-level", "warning",
                             "--max-seq-len", "8192", "--cache-size", "32768", *flags], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"server did not come up: {proc.communicate()[0]}") from None
            time.sleep(0.2)


def _stream(base: str, max_tokens: int, out: dict[str, Any]) -> None:
    events: list[Any] = []
    out["events"] = events
    try:
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                          json={"prompt": "Once", "max_tokens": max_tokens, "temperature": 0.8, "stream": True,
                                "logit_bias": NO_EOS}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
    except httpx.HTTPError as e:
        out["error"] = repr(e)


def test_sigterm_ends_streams_after_the_timeout_and_exits() -> None:
    port = free_port()
    proc = _start(port, "--shutdown-timeout", str(TIMEOUT_S))
    base = f"http://127.0.0.1:{port}"
    try:
        long_runs = [{} for _ in range(3)]
        threads = [threading.Thread(target=_stream, args=(base, 8000, o), daemon=True) for o in long_runs]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not all(len(o.get("events", [])) >= 3 for o in long_runs):
            assert time.monotonic() < deadline, "streams did not start"
            time.sleep(0.05)
        short: dict[str, Any] = {}
        threads.append(threading.Thread(target=_stream, args=(base, 12, short), daemon=True))
        threads[-1].start()
        while not short.get("events"):
            assert time.monotonic() < deadline, "the short stream did not start"
            time.sleep(0.01)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=TIMEOUT_S + 8)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read() if proc.stdout else ""
    assert elapsed < TIMEOUT_S + 5, f"exited {elapsed:.1f} s after SIGTERM\n{log}"
    assert elapsed >= TIMEOUT_S - 0.5, f"exited after {elapsed:.1f} s: the streams were not given their time"
    # The short stream finished within the timeout, normally.
    assert short["events"][-1] == "[DONE]" and short["events"][-2]["choices"][0]["finish_reason"] == "length", log
    # The long ones were ended with an error event, then [DONE].
    for o in long_runs:
        events = o["events"]
        assert o["status"] == 200 and events[-1] == "[DONE]", (o, log)
        err = events[-2]["error"]
        assert "shut down" in err["message"] and "--shutdown-timeout" in err["message"], err
        assert len(events) > 5  # they were streaming until then


def test_sigterm_when_idle_exits_at_once() -> None:
    port = free_port()
    proc = _start(port, "--shutdown-timeout", "30")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert time.monotonic() - t0 < 5
