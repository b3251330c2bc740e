"""`exlpy serve` as a real process: uvicorn on a free port, the demo model, /health and one completion."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

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
        if torch.cuda.is_available():  # sized from free GPU memory (tests/test_serving_gpu.py checks how)
            assert health["cache_pages"] >= 8
        else:
            assert health["cache_pages"] == 8  # the CPU default cache: at least 2048 tokens
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


@pytest.mark.exclusive_gpu  # on a GPU the reload sizes its cache from the free memory
def test_serve_process_with_config_file_and_keys(tmp_path: Path) -> None:
    """The whole path: a TabbyAPI-style config.yml (port, model, cache mode) plus TabbyAPI's api_tokens.yml."""
    pytest.importorskip("yaml")
    import shutil

    from exlpy.demo import DEMO_MODEL_DIR

    shutil.copytree(DEMO_MODEL_DIR, tmp_path / "models" / "demo")
    (tmp_path / "api_tokens.yml").write_text("api_key: user-key\nadmin_key: admin-key\n")
    port = _free_port()
    cfg = tmp_path / "config.yml"
    cfg.write_text(f"network:\n  host: 127.0.0.1\n  port: {port}\n  api_key_file: {tmp_path / 'api_tokens.yml'}\n"
                   f"model:\n  model_dir: {tmp_path / 'models'}\n  model_name: demo\n  cache_mode: Q8\n"
                   "  cache_size: 512\n  vision: false\n")
    proc = subprocess.Popen([sys.executable, "-m", "exlpy", "serve", "--config", str(cfg), "--log-level", "warning"],
                            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"

    def call(path: str, key: str | None, body: dict | None = None) -> tuple[int, dict]:
        headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(f"{base}{path}", method="POST" if body is not None else "GET", headers=headers,
                                     data=json.dumps(body).encode() if body is not None else None)
        try:
            with urllib.request.urlopen(req, timeout=180) as r:  # a load compiles kernels; slow under xdist
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"server did not come up: {proc.stdout.read() if proc.stdout else ''}") \
                        from None
                time.sleep(0.2)
        body = {"prompt": "Once", "max_tokens": 4}
        assert call("/v1/completions", None, body)[0] == 401
        assert call("/v1/completions", "admin-key-x", body)[0] == 401
        status, out = call("/v1/completions", "user-key", body)
        assert status == 200 and out["model"] == "demo"
        assert call("/v1/model", "user-key")[1]["parameters"]["cache_mode"] == "Q8"
        assert call("/v1/model/unload", "user-key", {})[0] == 403
        status, out = call("/v1/model/load", "admin-key", {"model_name": "demo", "cache_mode": "Q4"})
        assert status == 200, out
        assert call("/v1/model", "admin-key")[1]["parameters"]["cache_mode"] == "Q4"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
