"""The pure parts of exlpy on Ray Serve, without a Ray cluster: the routing key of a request, the rendezvous order
of replicas, and the sum of replicas' Prometheus metrics (the cluster runs are in tests/test_ray_serve.py)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("ray.serve.request_router", exc_type=ImportError)
prometheus_client = pytest.importorskip("prometheus_client")

from exlpy.server.ray_metrics import per_replica, summed  # noqa: E402
from exlpy.server.ray_router import rendezvous, round_robin, routing_key  # noqa: E402


def _key(body: Any, path: str = "/v1/completions", chars: int = 16) -> str | None:
    return routing_key(path, json.dumps(body).encode(), chars)


def test_routing_key_is_the_prompt_prefix() -> None:
    system = "You are a pirate. " * 4
    a = _key({"prompt": system + "Where is the gold?"})
    assert a == _key({"prompt": system + "Sing a song."}) != _key({"prompt": "Another system prompt entirely"})
    assert _key({"prompt": system, "model": "adapter"}) != a  # an adapter's pages are its own
    # chat: the messages in order, roles included
    chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]}
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": system}]},
                          {"role": "user", "content": "Bye"}]}
    assert _key(chat, "/v1/chat/completions") == _key(parts, "/v1/chat/completions") is not None
    # token ids count four characters each; a batch routes by its first prompt
    ids = list(range(100, 140))
    assert _key({"prompt": ids}) == _key({"prompt": ids[:4] + [7, 7]}) != _key({"prompt": [1, *ids]})
    assert _key({"prompt": [system + "x", "other"]}) == a
    # not a routed request: no key (power of two choices)
    assert _key({"prompt": system}, "/tokenize") is None
    assert routing_key("/v1/completions", b"{not json", 16) is None
    assert _key({"max_tokens": 3}) is None and _key([1, 2]) is None


def test_rendezvous_is_stable_and_spreads() -> None:
    replicas = ["r0", "r1", "r2", "r3"]
    ident = str
    firsts = Counter(rendezvous(f"key{i}", replicas, ident)[0] for i in range(400))
    assert set(firsts) == set(replicas) and min(firsts.values()) > 60  # roughly even
    for i in range(50):
        order = rendezvous(f"key{i}", replicas, ident)
        assert sorted(order) == replicas and rendezvous(f"key{i}", reversed(replicas), ident) == order
        # a replica leaving moves only the keys it held
        rest = rendezvous(f"key{i}", [r for r in replicas if r != "r3"], ident)
        assert rest == [r for r in order if r != "r3"]


def test_round_robin_takes_turns_in_id_order() -> None:
    replicas = ["r2", "r0", "r1"]
    firsts = [round_robin(turn, replicas, str)[0] for turn in range(7)]
    assert firsts == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]  # whatever order the candidates come in
    assert round_robin(4, replicas, str) == ["r1", "r2", "r0"]  # the rest follow: a full first one is skipped
    assert round_robin(3, [], str) == []


def _text(**values: float) -> str:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    Counter("exlpy:generation_tokens", "Tokens generated", registry=reg).inc(values["tokens"])
    ok = Counter("exlpy:request_success", "Requests finished", ["finished_reason"], registry=reg)
    ok.labels(finished_reason="stop").inc(values["stop"])
    Gauge("exlpy:cache_pages_used", "used", registry=reg).set(values["used"])
    Gauge("exlpy:cache_pages_total", "total", registry=reg).set(values["total"])
    Gauge("exlpy:kv_cache_usage_perc", "usage", registry=reg).set(values["used"] / values["total"])
    h = Histogram("exlpy:time_to_first_token_seconds", "ttft", buckets=(0.1, 1.0), registry=reg)
    for v in values["ttfts"]:  # type: ignore[attr-defined]
        h.observe(v)
    return generate_latest(reg).decode()


def _parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_are_summed_over_replicas() -> None:
    texts = {"a": _text(tokens=10, stop=2, used=3, total=16, ttfts=[0.05, 0.5]),
             "b": _text(tokens=5, stop=1, used=13, total=16, ttfts=[2.0])}
    m = _parse(summed(texts))
    assert m[("exlpy:generation_tokens_total", ())] == 15
    assert m[("exlpy:request_success_total", (("finished_reason", "stop"),))] == 3
    assert m[("exlpy:cache_pages_used", ())] == 16 and m[("exlpy:cache_pages_total", ())] == 32
    assert m[("exlpy:kv_cache_usage_perc", ())] == 0.5  # from the summed pages, not a sum of fractions
    assert m[("exlpy:time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 1
    assert m[("exlpy:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 3
    assert m[("exlpy:time_to_first_token_seconds_count", ())] == 3
    assert m[("exlpy:time_to_first_token_seconds_sum", ())] == pytest.approx(2.55)
    assert m[("exlpy:replicas", ())] == 2
    assert not any(name.endswith("_created") for name, _ in m)
    each = _parse(per_replica(texts))
    assert each[("exlpy:generation_tokens_total", (("replica", "a"),))] == 10
    assert each[("exlpy:generation_tokens_total", (("replica", "b"),))] == 5
    assert _parse(summed({})) == {("exlpy:replicas", ()): 0.0}
