"""`exlpy serve` as a real process: uvicorn on a free port, the demo model, /health and one completion."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from exlpy.cli.main import build_parser, main  # noqa: E402
from tests.conftest import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_serve_is_a_subcommand_with_its_flags() -> None:
    from exlpy.cli.serve import options_from_args

    args = build_parser().parse_args(["serve", "--port", "9001", "--max-queue", "3", "--cache-size", "4096"])
    opts, warnings = options_from_args(args)
    assert (opts.access.port, opts.max_queue, opts.model.cache_size, opts.access.host, opts.model.model_dir) == \
        (9001, 3, 4096, "127.0.0.1", None) and warnings == []


def test_bad_max_queue_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--max-queue", "0"]) == 1
    assert "--max-queue must be >= 1" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_process_answers_http() -> None:
    port = _free_port()
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "exlpy", "serve", "--port", str(port), "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = json.loads(urllib.request.urlopen(f"{base}/health", timeout=2).read())
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = proc.stdout.read() if proc.stdout else ""
                    raise AssertionError(f"server did not come up: {log}") from None
                time.sleep(0.2)
        assert health["status"] == "ok" and health["model"] == "aidreams260K"
        assert health["cache_pages"] == 8  # default cache: at least 2048 tokens
        req = urllib.request.Request(f"{base}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "Once", "max_tokens": 8, "temperature": 0}).encode(),
                                     headers={"content-type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=30).read())
        assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] <= 8
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
