"""Admin routes of `exlpy serve`: load, unload and switch the model and LoRA adapters without restarting; new
requests get 503 while a switch runs, running ones finish first."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from exlpy.demo import DEMO_MODEL_DIR  # noqa: E402
from exlpy.server import create_app, load_state  # noqa: E402
from exlpy.server.options import AccessOptions, ModelOptions, ServeOptions  # noqa: E402
from tests.lora_util import write_adapter  # noqa: E402
from tests.openai_server import free_port  # noqa: E402
from tests.test_server_auth import running  # noqa: E402
from tests.test_server_helpers import (  # noqa: E402
    NO_EOS,
    single_torch_thread,  # noqa: E402, F401  (autouse fixture)
    slow_steps,
    sse_events,
)

ADMIN = {"Authorization": "Bearer boss"}
USER = {"Authorization": "Bearer user"}


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    models, loras = tmp_path / "models", tmp_path / "loras"
    for name in ("first", "second"):
        shutil.copytree(DEMO_MODEL_DIR, models / name)
    write_adapter(loras / "poet", Path(DEMO_MODEL_DIR), r=8, seed=1, std=0.3)
    return models, loras


def _state(roots: tuple[Path, Path]) -> Any:
    state = load_state(options=ModelOptions(model_dir=str(roots[0] / "first"), cache_size=512), warmup=False)
    state.access = AccessOptions(api_keys=("user",), admin_keys=("boss",))
    state.models_root, state.loras_root = str(roots[0]), str(roots[1])
    return state


def _complete(c: Any, model: str, **kw: Any) -> Any:
    return c.post("/v1/completions", headers=USER, json={"model": model, "prompt": "Once", "max_tokens": 6,
                                                         "temperature": 0, **kw})


def test_load_unload_and_switch_models(roots: tuple[Path, Path]) -> None:
    state = _state(roots)
    with TestClient(create_app(state)) as c:
        card = c.get("/v1/model", headers=USER).json()
        assert card["id"] == "first" and card["parameters"]["cache_mode"] == "FP16"
        assert _complete(c, "first").status_code == 200
        r = c.post("/v1/model/load", headers=ADMIN, json={"model_name": "second", "cache_mode": "Q8",
                                                          "max_seq_len": 64, "cache_size": 256})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "second" and r.json()["parameters"]["max_seq_len"] == 64
        assert type(state.generator.cache).__name__ == "ExLlamaV2Cache_Q8"
        assert [m["id"] for m in c.get("/v1/models", headers=USER).json()["data"]] == ["second"]
        assert _complete(c, "second").status_code == 200
        assert _complete(c, "first").status_code == 404
        # Bad loads answer 400 naming the field, and leave the served model in place.
        for body, match in (({"model_name": "../first"}, "not a path"), ({"model_name": "third"}, "not a model "),
                            ({}, "model_name"), ({"model_name": "first", "cache_mode": "Q5"}, "cache_mode"),
                            ({"model_name": "first", "max_seq_len": "64"}, "max_seq_len"),
                            ({"model_name": "first", "gpu_splitt": [1]}, "gpu_splitt")):
            r = c.post("/v1/model/load", headers=ADMIN, json=body)
            assert r.status_code == 400 and match in r.json()["error"]["message"], (body, r.text)
        assert _complete(c, "second").status_code == 200
        # Unload: model routes answer 503 until the next load; /health says why.
        assert c.post("/v1/model/unload", headers=ADMIN).json() == {"unloaded": "second"}
        r = _complete(c, "second")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable"
        assert "no model is loaded" in r.json()["error"]["message"]
        h = c.get("/health")
        assert h.status_code == 503 and "no model" in h.json()["status"]
        assert c.post("/v1/model/unload", headers=ADMIN).status_code == 400
        assert c.post("/v1/model/load", headers=ADMIN, json={"name": "first"}).status_code == 200
        assert _complete(c, "first").status_code == 200 and c.get("/health").status_code == 200


def test_load_and_unload_adapters(roots: tuple[Path, Path]) -> None:
    state = _state(roots)
    with TestClient(create_app(state)) as c:
        base = _complete(c, "first", logit_bias=NO_EOS, max_tokens=12).json()["choices"][0]["text"]
        r = c.post("/v1/lora/load", headers=ADMIN, json={"loras": [{"name": "poet", "scaling": 1.0}]})
        assert r.status_code == 200 and r.json() == {"success": ["poet"], "failure": []}
        assert [x["id"] for x in c.get("/v1/loras", headers=USER).json()["data"]] == ["poet"]
        assert "poet" in [m["id"] for m in c.get("/v1/models", headers=USER).json()["data"]]
        adapted = _complete(c, "poet", logit_bias=NO_EOS, max_tokens=12).json()["choices"][0]["text"]
        assert adapted != base  # the adapter is applied (std 0.3 deltas change greedy text)
        for body, match in (({"loras": [{"name": "poet"}]}, "already loaded"),
                            ({"loras": [{"name": "../poet"}]}, "not a path"),
                            ({"loras": [{"name": "absent"}]}, "not a directory"),
                            ({"loras": [{"name": "poet", "scaling": "1"}]}, "scaling")):
            r = c.post("/v1/lora/load", headers=ADMIN, json=body)
            assert r.status_code == 400 and match in r.json()["error"]["message"], (body, r.text)
        assert c.post("/v1/lora/unload", headers=ADMIN, json={"loras": ["nope"]}).status_code == 400
        assert c.post("/v1/lora/unload", headers=ADMIN, json={"loras": ["poet"]}).json() == {"unloaded": ["poet"]}
        assert _complete(c, "poet").status_code == 404
        assert _complete(c, "first", logit_bias=NO_EOS, max_tokens=12).json()["choices"][0]["text"] == base


def test_switch_refuses_new_requests_and_lets_running_ones_finish(roots: tuple[Path, Path]) -> None:
    state = _state(roots)
    slow_steps(state.generator, 0.03)  # a 40-token stream takes over a second
    opts = ServeOptions(access=AccessOptions(port=free_port()), model=ModelOptions(), log_level="warning")
    stream: dict[str, Any] = {}
    load: dict[str, Any] = {}
    with running(opts, state) as base:
        def run_stream() -> None:
            r = httpx.post(f"{base}/v1/completions", headers=USER, timeout=60,
                           json={"prompt": "Once", "max_tokens": 40, "temperature": 0, "stream": True,
                                 "logit_bias": NO_EOS})
            stream["events"] = sse_events(r.text)

        def run_load() -> None:
            r = httpx.post(f"{base}/v1/model/load", headers=ADMIN, json={"model_name": "second"}, timeout=60)
            load["status"], load["at"] = r.status_code, time.monotonic()

        t_stream = threading.Thread(target=run_stream)
        t_stream.start()
        deadline = time.monotonic() + 20
        while not state.bridge.num_running():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t_load = threading.Thread(target=run_load)
        t_load.start()
        while state.gate.closed_reason is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        refused = httpx.post(f"{base}/v1/completions", headers=USER, json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and "loading model second" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        assert httpx.get(f"{base}/health").status_code == 503
        second = httpx.post(f"{base}/v1/model/load", headers=ADMIN, json={"model_name": "first"}, timeout=30)
        assert second.status_code == 409 and second.json()["error"]["code"] == "model_switching"
        t_stream.join(timeout=30)
        t_load.join(timeout=60)
        events = stream["events"]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for e in events[:-1] if e["choices"] and e["choices"][0]["text"]) > 10
        assert events[0]["model"] == "first" and load["status"] == 200
        r = httpx.post(f"{base}/v1/completions", headers=USER, json={"model": "second", "prompt": "x",
                                                                     "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "second"
