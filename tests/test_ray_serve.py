"""exlpy on Ray Serve (exlpy/server/ray_app.py): a local Ray, two CPU replicas of the demo model behind Ray's HTTP
proxy and exlpy's ingress, the openai client and httpx against it: routes, streaming, errors; prefix routing
(same prefix, same replica, more prefix cache hits than power of two choices); a replica killed mid-stream (the
stream ends with an error event, non-streaming requests are retried, a replacement serves); metrics summed over
the replicas."""

from __future__ import annotations

import json
import os
import random
import socket
import threading
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
from exlpy.server.ray_app import ATTEMPTS_HEADER, REPLICA_HEADER, build_app, parse_args  # noqa: E402
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
    # The replicas are worker processes: they must import this checkout's exlpy (not an installed copy) and the
    # Ray this process runs (where PYTHONPATH brings it, as on the GPU machine), and one intra-op thread each keeps
    # two replicas from fighting over two cores.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # 512 positions and 16 pages of 256 tokens: prompts long enough to fill cached pages (the demo tokenizer
        # makes ~1.6 characters a token), and room for the prefixes of the routing test on both replicas.
        ARGS.update(model=DEMO_MODEL_DIR, replicas=2, cpus_per_replica=0.5, cache_size=4096, max_seq_len=512,
                    prompt_template=str(template), api_key=KEY, health_check_period_s=1, health_check_timeout_s=30,
                    shutdown_timeout_s=60, router="prefix", prefix_chars=200, stats_period_s=0.5)
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


def _post(url: str, path: str, body: dict[str, Any], key: str | None = KEY, **headers: str) -> httpx.Response:
    hs = {k.replace("_", "-"): v for k, v in headers.items()}
    if key:
        hs["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{url}{path}", json=body, headers=hs, timeout=60)


def _metrics(url: str, path: str = "/metrics") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}{path}", timeout=30)
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(r.text) for s in f.samples}


def _total(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in m.items() if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


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
    r = _post(base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}, x_exlpy_routing="random")
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-exlpy-routing"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_both_replicas_serve(base_url: str) -> None:
    seen = set()
    for _ in range(24):  # power of two choices between two idle replicas: random, so both come up quickly
        r = _post(base_url, "/v1/completions", {"prompt": "A dog", "max_tokens": 2}, x_exlpy_routing="pow2")
        assert r.status_code == 200
        seen.add(r.headers[REPLICA_HEADER])
        if len(seen) == 2:
            break
    assert len(seen) == 2
    # round-robin: one request at a time, so no replica is full and each takes its turn
    order = [_post(base_url, "/v1/completions", {"prompt": "A dog", "max_tokens": 2},
                   x_exlpy_routing="rr").headers[REPLICA_HEADER] for _ in range(6)]
    assert len(set(order)) == 2 and all(a != b for a, b in zip(order, order[1:])), order
    health = httpx.get(f"{base_url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok" and REPLICA_HEADER in health.headers


def _system_prompts(rng: random.Random, n: int) -> list[str]:
    words = ["the", "little", "girl", "saw", "a", "big", "red", "ball", "in", "park", "and", "her", "dog", "ran",
             "home", "happy", "sun", "tree", "bird", "sang"]
    return [f"System {rng.random():.12f}: " + " ".join(rng.choice(words) for _ in range(110)) for _ in range(n)]


def _routing_phase(url: str, routing: str, seed: int) -> tuple[float, dict[int, set[str]]]:
    """16 completions over 4 shared system prompts of ~400 tokens (one full cache page each), sent one after
    the other with `routing`; the prefix cache hit rate over them (from the summed /metrics) and the replicas
    each system prompt went to."""
    rng = random.Random(seed)
    systems = _system_prompts(rng, 4)
    before = _metrics(url)
    replicas: dict[int, set[str]] = {i: set() for i in range(len(systems))}
    for _ in range(4):
        for i, system in enumerate(systems):
            r = _post(url, "/v1/completions", {"prompt": f"{system}\nUser {rng.random():.6f}: hi", "max_tokens": 1},
                      x_exlpy_routing=routing)
            assert r.status_code == 200, r.text
            replicas[i].add(r.headers[REPLICA_HEADER])
    done = _total(before, "exlpy:request_success_total") + 16
    q0 = _total(before, "exlpy:prefix_cache_queries_total")

    def complete(m: dict) -> dict | None:
        # Each replica pushes its counters with its routing stats, so one read can hold a replica's newest successes
        # and older cache counters (3,564 of 4,096 queries once on a loaded CI machine): wait for both.
        ok = (_total(m, "exlpy:request_success_total") >= done
              and _total(m, "exlpy:prefix_cache_queries_total") - q0 >= 16 * 256)
        return m if ok else None

    after = _wait("the replicas' metrics of the phase", lambda: complete(_metrics(url)))
    hits = _total(after, "exlpy:prefix_cache_hits_total") - _total(before, "exlpy:prefix_cache_hits_total")
    queries = _total(after, "exlpy:prefix_cache_queries_total") - _total(before, "exlpy:prefix_cache_queries_total")
    assert queries >= 16 * 256
    return hits / queries, replicas


def test_prefix_routing_keeps_prefixes_on_one_replica(base_url: str) -> None:
    """Prefix routing sends every request of a system prompt to one replica, so each prompt is prefilled once;
    power of two choices spreads them, and both replicas prefill most prompts (one page missed per replica)."""
    prefix_rate, prefix_replicas = _routing_phase(base_url, "prefix", seed=1)
    pow2_rate, _ = _routing_phase(base_url, "pow2", seed=2)
    assert all(len(seen) == 1 for seen in prefix_replicas.values())
    assert prefix_rate > pow2_rate
    assert prefix_rate >= 0.8 * (12 * 256) / (16 * 420)  # 12 of 16 first pages were cached


def test_metrics_summed_over_replicas(base_url: str) -> None:
    seen: set[str] = set()
    for i in range(40):  # keys of our own until both replicas served one
        r = _post(base_url, "/v1/completions", {"prompt": "A cat", "max_tokens": 3}, x_exlpy_routing_key=f"k{i}")
        assert r.status_code == 200
        seen.add(r.headers[REPLICA_HEADER])
        if len(seen) == 2:
            break
    assert len(seen) == 2

    def consistent() -> tuple[dict[Any, float], dict[Any, float]] | None:
        per, total = _metrics(base_url, "/metrics/replicas"), _metrics(base_url)
        reps = {dict(lab)["replica"] for (_, lab) in per}
        if reps != seen or total != _metrics(base_url) or per != _metrics(base_url, "/metrics/replicas"):
            return None
        return per, total

    per, total = _wait("the metrics of both replicas", consistent)
    assert total[("exlpy:replicas", ())] == 2
    for name in ("exlpy:generation_tokens_total", "exlpy:prompt_tokens_total", "exlpy:cache_pages_total",
                 "exlpy:prefix_cache_queries_total", "exlpy:num_requests_running"):
        assert total[(name, ())] == sum(_total(per, name, replica=rid) for rid in seen)
    assert total[("exlpy:cache_pages_total", ())] == 2 * 16
    assert total[("exlpy:generation_tokens_total", ())] >= 6
    hist = "exlpy:time_to_first_token_seconds_count"
    assert total[(hist, ())] == sum(_total(per, hist, replica=rid) for rid in seen) > 0
    assert 0.0 <= total[("exlpy:kv_cache_usage_perc", ())] <= 1.0


def test_client_gone_cancels_the_replicas_job(base_url: str) -> None:
    """A client that closes its stream early: the ingress cancels the replica's stream, whose app sees the
    disconnect and cancels the job (it stops generating long before its 440 tokens)."""
    gen = "exlpy:generation_tokens_total"
    before = _total(_metrics(base_url), gen)
    body = {"prompt": "Gone", "max_tokens": 440, "logit_bias": NO_EOS, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        assert next(x for x in r.iter_lines() if x).startswith("data: {")
    ended = _wait("the job's end in the metrics", lambda: (lambda m: m if _total(m, gen) > before and _total(
        m, "exlpy:num_requests_running") == 0 else None)(_metrics(base_url)))
    assert _total(ended, gen) - before < 300


def test_replica_killed_mid_stream(base_url: str) -> None:
    """A replica killed while it streams one answer and computes others: the stream ends with an error event
    and [DONE] (no hang, no cut connection), the non-streaming requests it held are sent again to the other
    replica (none is lost), new requests keep succeeding, and a replacement replica serves again."""
    before = _replica_actors()
    assert len(before) == 2
    body = {"prompt": "The killed replica", "max_tokens": 440, "logit_bias": NO_EOS}
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(_post(base_url, "/v1/completions", body)))
               for _ in range(3)]
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        victim_id = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        assert next(x for x in lines if x).startswith("data: {")
        for t in threads:  # the same prompt, so prefix routing sends them to the same replica
            t.start()
        time.sleep(0.5)
        victim = next(n for n in before if n.endswith(f"#{victim_id}"))
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        rest = [x for x in lines if x]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
    for t in threads:
        t.join(timeout=WAIT_S)
    assert len(results) == 3 and all(x.status_code == 200 for x in results), [x.text for x in results]
    assert all(x.json()["usage"]["completion_tokens"] == 440 for x in results)
    retried = [x for x in results if x.headers[ATTEMPTS_HEADER] == "2"]
    assert retried and all(x.headers[REPLICA_HEADER] != victim_id for x in retried)
    for _ in range(3):
        assert _post(base_url, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}).status_code == 200
    after = _wait("a replacement replica", lambda: (lambda s: s if len(s) == 2 and victim not in s else None)(
        _replica_actors()))
    _wait("two running replicas again", lambda: _running(2))
    assert len(after - before) == 1
    for i in range(6):
        r = _post(base_url, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}, x_exlpy_routing_key=f"r{i}")
        assert r.status_code == 200


def test_redeploy_keeps_running_streams(base_url: str, ray_app_args: dict[str, Any]) -> None:
    """Redeploying with one replica (and `retries=0`, for the next test) while streams run replaces the running
    replicas (a new version): those stop taking requests and have `shutdown_timeout_s` to finish theirs, so every
    stream ends with [DONE]. (On the demo
    model the streams may also just finish before the old replica is told to stop; the test checks none is lost.)"""
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
    serve.run(build_app(**{**ray_app_args, "replicas": 1, "retries": 0}), name=APP, route_prefix="/")
    for t in threads:
        t.join(timeout=WAIT_S)
    assert len(results) == 4
    assert all(code == 200 and text.rstrip().endswith("data: [DONE]") for code, _, text in results)
    remaining = _replica_actors()
    assert any(not any(name.endswith(f"#{rid}") for name in remaining) for _, rid, _ in results)
    _wait("one running replica", lambda: _running(1))


def test_lost_replica_without_retries_is_a_503(base_url: str) -> None:
    """With `retries=0` (the redeploy above), a request whose replica dies gets OpenAI's error shape: 503,
    code `replica_unavailable`, and a Retry-After header."""
    (victim,) = _replica_actors()
    result: list[httpx.Response] = []
    body = {"prompt": "Lost", "max_tokens": 440, "logit_bias": NO_EOS}
    t = threading.Thread(target=lambda: result.append(_post(base_url, "/v1/completions", body)))
    t.start()
    time.sleep(0.5)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    t.join(timeout=WAIT_S)
    (r,) = result
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.headers[ATTEMPTS_HEADER] == "1"
    error = r.json()["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error" and "Retry" in error["message"]


def test_arguments_are_checked() -> None:
    opts = parse_args({"model": "/m", "replicas": "3", "gpus_per_replica": "1", "max_seq_len": "4096",
                       "tensor_parallel": "true", "api_key": "a,b", "shutdown_timeout_s": "5"})
    assert opts.replicas == 3 and opts.gpus_per_replica == 1.0 and opts.model.max_seq_len == 4096
    assert opts.model.tensor_parallel and opts.access.api_keys == ("a", "b") and opts.autoscaling is None
    assert opts.shutdown_timeout_s == 5.0 and opts.router == "pow2" and opts.retries == 1
    routed = parse_args({"router": "Prefix", "prefix_chars": "300", "prefix_imbalance": "0", "retries": "0"})
    assert (routed.router, routed.prefix_chars, routed.prefix_imbalance, routed.retries) == ("prefix", 300, 0, 0)
    with pytest.raises(ConfigError, match="router"):
        parse_args({"router": "round-robin"})
    with pytest.raises(ConfigError, match="stats_period_s"):
        parse_args({"stats_period_s": "0"})
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
    assert opts.gpus_per_replica == 1 and opts.autoscaling is not None and opts.router == "prefix"
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= opts.gpus_per_replica  # a worker pod fits a replica
    assert opts.autoscaling["max_replicas"] * opts.gpus_per_replica <= workers["maxReplicas"] * gpus


def test_api_key_from_environment() -> None:
    from exlpy.runtime import RuntimeOptions, use_options

    with use_options(RuntimeOptions.from_env({"EXLPY_API_KEY": "from-env"})):
        assert parse_args({"api_key": "a"}).access.api_keys == ("a", "from-env")
        assert parse_args({}).access.api_keys == ("from-env",)
