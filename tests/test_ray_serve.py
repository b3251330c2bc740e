"""exlpy on Ray Serve (exlpy/server/ray_app.py): a local Ray, two CPU replicas of the demo model behind Ray's HTTP
proxy, the openai client and httpx against it; a killed replica is replaced and requests keep succeeding."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("exlpy.server.ray_app", exc_type=ImportError)  # skips (with the reason) on a Ray too old
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from exlpy.demo import DEMO_MODEL_DIR  # noqa: E402
from exlpy.errors import ConfigError  # noqa: E402
from exlpy.server.ray_app import REPLICA_HEADER, build_app, parse_args  # noqa: E402
from tests.test_server_helpers import CHAT_TEMPLATE, NO_EOS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEY = "ray-test-key"
APP = "exlpy"
WAIT_S = 120.0  # bound on every wait for Serve (a replica loads the demo model and warms up in a few seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, ok: Any, timeout: float = WAIT_S) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            out = ok()
        except Exception:
            out = None
        if out:
            return out
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _replica_actors() -> set[str]:
    from ray.util import list_named_actors

    return {a["name"] for a in list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and f"#{APP}#" in a["name"]}


def _running(n: int) -> bool:
    st = serve.status().applications[APP].deployments[APP]
    return dict(st.replica_states) == {"RUNNING": n}


ARGS: dict[str, Any] = {}  # build_app's arguments of the running application (set by the fixture)


@pytest.fixture
def ray_app_args(base_url: str) -> dict[str, Any]:
    return dict(ARGS)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("ray") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    port = _free_port()
    # The replicas are worker processes: they must import this checkout's exlpy (not an installed copy), and one
    # intra-op thread each keeps two replicas from fighting over two cores.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        ARGS.update(model=DEMO_MODEL_DIR, replicas=2, cpus_per_replica=0.5, cache_size=256,
                    prompt_template=str(template), api_key=KEY, health_check_period_s=1, health_check_timeout_s=30,
                    shutdown_timeout_s=60)
        serve.run(build_app(**ARGS), name=APP, route_prefix="/")
        _wait("two running replicas", lambda: _running(2))
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)


def _post(url: str, path: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def test_completion_and_chat(base_url: str) -> None:
    client = _client(base_url)
    out = client.completions.create(model="aidreams260K", prompt="Once upon a time", max_tokens=8,
                                    temperature=0, logit_bias=NO_EOS)
    assert out.usage.completion_tokens == 8 and out.choices[0].text
    again = client.completions.create(model="aidreams260K", prompt="Once upon a time", max_tokens=8,
                                      temperature=0, logit_bias=NO_EOS)
    assert again.choices[0].text == out.choices[0].text  # greedy is the same on every replica
    several = client.completions.create(model="aidreams260K", prompt="Once upon a time", max_tokens=4, n=3,
                                        temperature=1.0, seed=7)
    assert sorted(c.index for c in several.choices) == [0, 1, 2] and several.usage.completion_tokens >= 3
    chat = client.chat.completions.create(model="aidreams260K", max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "Tell me a story."}])
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens >= 1


def test_streaming(base_url: str) -> None:
    client = _client(base_url)
    whole = client.completions.create(model="aidreams260K", prompt="The cat", max_tokens=10, temperature=0,
                                      logit_bias=NO_EOS)
    chunks = list(client.completions.create(model="aidreams260K", prompt="The cat", max_tokens=10, temperature=0,
                                            logit_bias=NO_EOS, stream=True))
    assert len(chunks) > 2  # tokens arrive as they are made, not in one body
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_errors_and_keys(base_url: str) -> None:
    r = _post(base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": "hot"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "temperature"
    r = _post(base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}, key=None)
    assert r.status_code == 401 and "error" in r.json()
    r = _post(base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}, key="wrong")
    assert r.status_code == 401
    r = _post(base_url, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_both_replicas_serve(base_url: str) -> None:
    seen = set()
    for _ in range(24):  # power of two choices between two idle replicas: random, so both come up quickly
        r = _post(base_url, "/v1/completions", {"prompt": "A dog", "max_tokens": 2})
        assert r.status_code == 200
        seen.add(r.headers[REPLICA_HEADER])
        if len(seen) == 2:
            break
    assert len(seen) == 2
    health = httpx.get(f"{base_url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok" and REPLICA_HEADER in health.headers


def test_killed_replica_is_replaced(base_url: str) -> None:
    before = _replica_actors()
    assert len(before) == 2
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    # Requests keep succeeding meanwhile (the router drops the dead replica; a request already sent to it may fail
    # once, so each is retried a bounded number of times).
    for _ in range(4):
        ok = False
        for _attempt in range(5):
            r = _post(base_url, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
            if r.status_code == 200:
                ok = True
                break
            time.sleep(0.5)
        assert ok
    after = _wait("a replacement replica", lambda: (lambda s: s if len(s) == 2 and victim not in s else None)(
        _replica_actors()))
    _wait("two running replicas again", lambda: _running(2))
    assert len(after - before) == 1
    for _ in range(3):
        assert _post(base_url, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}).status_code == 200


def test_redeploy_keeps_running_streams(base_url: str, ray_app_args: dict[str, Any]) -> None:
    """Redeploying with one replica while streams run replaces the running replicas (a new version): those stop
    taking requests and have `shutdown_timeout_s` to finish theirs, so every stream ends with [DONE]. (On the demo
    model the streams may also just finish before the old replica is told to stop; the test checks none is lost.)"""
    import threading

    started = threading.Barrier(5, timeout=60)
    results: list[tuple[int, str, str]] = []

    def one() -> None:
        body = {"prompt": "Once", "max_tokens": 100, "n": 2, "logit_bias": NO_EOS, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            first = next(lines, "")
            started.wait()
            text = "\n".join([first, *lines])
            results.append((r.status_code, r.headers.get(REPLICA_HEADER, ""), text))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()  # every stream is running
    serve.run(build_app(**{**ray_app_args, "replicas": 1}), name=APP, route_prefix="/")
    for t in threads:
        t.join(timeout=WAIT_S)
    assert len(results) == 4
    assert all(code == 200 and text.rstrip().endswith("data: [DONE]") for code, _, text in results)
    remaining = _replica_actors()
    assert any(not any(name.endswith(f"#{rid}") for name in remaining) for _, rid, _ in results)
    _wait("one running replica", lambda: _running(1))


def test_arguments_are_checked() -> None:
    opts = parse_args({"model": "/m", "replicas": "3", "gpus_per_replica": "1", "max_seq_len": "4096",
                       "tensor_parallel": "true", "api_key": "a,b", "shutdown_timeout_s": "5"})
    assert opts.replicas == 3 and opts.gpus_per_replica == 1.0 and opts.model.max_seq_len == 4096
    assert opts.model.tensor_parallel and opts.access.api_keys == ("a", "b") and opts.autoscaling is None
    assert opts.shutdown_timeout_s == 5.0
    auto = parse_args({"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8})
    assert auto.autoscaling == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                "target_ongoing_requests": 8.0}
    with pytest.raises(ConfigError, match="replica"):
        parse_args({"replica": 2})  # a typo is named, not ignored
    with pytest.raises(ConfigError, match="max_seq_len"):
        parse_args({"max_seq_len": "long"})
    with pytest.raises(ConfigError, match="min_replicas"):
        parse_args({"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(ConfigError, match="gpus_per_replica"):
        parse_args({"gpus_per_replica": "1.5"})
    with pytest.raises(ConfigError, match="gpus_per_replica"):
        parse_args({"gpus_per_replica": 0.5})


def test_kuberay_manifest_in_docs_is_valid() -> None:
    yaml = pytest.importorskip("yaml")
    import importlib

    text = (REPO / "docs" / "ray_serve.md").read_text()
    manifest = yaml.safe_load(text.split("```yaml")[1].split("```")[0])
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    (application,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    module, attr = application["import_path"].split(":")
    assert getattr(importlib.import_module(module), attr) is not None
    opts = parse_args(application["args"])  # every argument is one the builder knows, with a valid value
    assert opts.gpus_per_replica == 1 and opts.autoscaling is not None
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= opts.gpus_per_replica  # a worker pod fits a replica
    assert opts.autoscaling["max_replicas"] * opts.gpus_per_replica <= workers["maxReplicas"] * gpus


def test_api_key_from_environment() -> None:
    from exlpy.runtime import RuntimeOptions, use_options

    with use_options(RuntimeOptions.from_env({"EXLPY_API_KEY": "from-env"})):
        assert parse_args({"api_key": "a"}).access.api_keys == ("a", "from-env")
        assert parse_args({}).access.api_keys == ("from-env",)
