"""`GET /metrics` (exlpy/server/metrics.py): Prometheus text format parsed by prometheus_client's own parser,
counts that follow the requests served, and the Triton compile counter's split at ready."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from exlpy.server import create_app  # noqa: E402
from exlpy.server.metrics import KernelCompiles  # noqa: E402
from tests.test_server_helpers import NO_EOS, make_state, single_torch_thread  # noqa: E402, F401


def scrape(text: str) -> dict[str, Any]:
    """{sample name: value} for unlabelled samples, {name{label=value}: value} for labelled ones."""
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def test_metrics_count_requests_tokens_and_latencies() -> None:
    state = make_state()

    async def main() -> tuple[str, str, Any]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            try:
                before = (await c.get("/metrics")).text
                body = {"prompt": [1, 5, 9, 13, 17], "max_tokens": 6, "temperature": 0, "logit_bias": NO_EOS}
                rs = await asyncio.gather(c.post("/v1/completions", json=body),
                                          c.post("/v1/completions", json={**body, "stream": True}))
                after = await c.get("/metrics")
                return before, after.text, (rs, after.headers["content-type"])
            finally:
                await state.bridge.stop()

    before, after, (rs, kind) = asyncio.run(main())
    assert all(r.status_code == 200 for r in rs) and kind.startswith("text/plain")
    m0, m = scrape(before), scrape(after)
    assert m0["exlpy:generation_tokens_total"] == 0 and m0["exlpy:num_requests_running"] == 0
    assert m["exlpy:prompt_tokens_total"] == 10 and m["exlpy:generation_tokens_total"] == 12
    assert m["exlpy:request_success_total{finished_reason=length}"] == 2
    assert m["exlpy:time_to_first_token_seconds_count"] == 2
    assert m["exlpy:inter_token_latency_seconds_count"] == 10  # 5 gaps per request
    assert m["exlpy:e2e_request_latency_seconds_count"] == 2
    assert m["exlpy:step_time_seconds_count"] >= 6 and m["exlpy:step_time_seconds_sum"] > 0
    assert m["exlpy:cache_pages_total"] == 16 and m["exlpy:cache_pages_used"] == 0
    assert m["exlpy:kv_cache_usage_perc"] == 0.0 and m["exlpy:num_preemptions_total"] == 0
    assert m["exlpy:num_requests_waiting"] == 0
    assert ("exlpy:kernel_compiles_total{phase=serving}" in m) == KernelCompiles.available


def test_kernel_compile_counter_splits_at_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in (("startup", 0), ("serving", 0), ("ready", False), ("last", []), ("available", True)):
        monkeypatch.setattr(KernelCompiles, k, v)
    KernelCompiles.count("warmup kernel")
    KernelCompiles.mark_ready()
    KernelCompiles.count("_flash_kernel[num_warps=4](T: i32)")
    h = KernelCompiles.health()
    assert h["kernel_compiles_startup"] == 1 and h["kernel_compiles_serving"] == 1
    assert h["kernel_compiles_serving_last"] == ["_flash_kernel[num_warps=4](T: i32)"]


def test_installed_triton_hook_counts_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    for k, v in (("startup", 0), ("serving", 0), ("ready", True), ("last", []), ("keys", []), ("_installed", False),
                 ("available", False)):
        monkeypatch.setattr(KernelCompiles, k, v)
    KernelCompiles.install()
    knobs.runtime.jit_post_compile_hook(key="k", repr="_paged_kernel[num_warps=4]()", fn=None, compile={},
                                        is_manual_warmup=False, already_compiled=False)
    assert KernelCompiles.available
    # the variant's key (argument specializations and constexprs) is kept: it names what the warm-up missed
    assert KernelCompiles.serving == 1 and KernelCompiles.last == ["_paged_kernel[num_warps=4]() key=k"]


def test_preemptions_are_counted_and_every_request_completes() -> None:
    """16 pages of 16 tokens for 4 requests that each grow to 5 pages: the newest is preempted (and resumed)."""
    state = make_state(pages=1, page_size=16)

    async def main() -> tuple[list[Any], str]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            try:
                body = {"max_tokens": 70, "temperature": 0, "logit_bias": NO_EOS}
                rs = await asyncio.gather(*[c.post("/v1/completions", json={**body, "prompt": [1, 5 + k, 9]})
                                            for k in range(4)])
                return list(rs), (await c.get("/metrics")).text
            finally:
                await state.bridge.stop()

    rs, text = asyncio.run(main())
    m = scrape(text)
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 70 for r in rs)
    assert m["exlpy:num_preemptions_total"] >= 1
    assert m["exlpy:num_preemptions_total"] == state.bridge.generator.preemptions
    assert m["exlpy:generation_tokens_total"] == 4 * 70 and m["exlpy:cache_pages_used"] == 0
