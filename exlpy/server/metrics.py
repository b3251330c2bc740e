"""Prometheus metrics of `exlpy serve` (`GET /metrics`, text format), named as vLLM names them, under `exlpy:`.

| metric | type | vLLM's name |
|---|---|---|
| exlpy:num_requests_running / exlpy:num_requests_waiting | gauge | vllm:num_requests_running / _waiting |
| exlpy:kv_cache_usage_perc (0-1), exlpy:cache_pages_used / exlpy:cache_pages_total | gauge | vllm:kv_cache_usage_perc |
| exlpy:prompt_tokens_total / exlpy:generation_tokens_total | counter | vllm:prompt_tokens / generation_tokens |
| exlpy:num_preemptions_total | counter | vllm:num_preemptions |
| exlpy:prefix_cache_queries_total / _hits_total (prompt tokens looked up / cached) | counter | vllm:prefix_cache_* |
| exlpy:request_success_total{finished_reason} | counter | vllm:request_success |
| exlpy:time_to_first_token_seconds | histogram | the same |
| exlpy:inter_token_latency_seconds, exlpy:e2e_request_latency_seconds | histogram | the same |
| exlpy:step_time_seconds | histogram | (exlpy: one generator iteration) |
| exlpy:spec_decode_num_draft_tokens_total / _num_accepted_tokens_total | counter | the same (with a drafter) |
| exlpy:kernel_compiles_total{phase="startup"/"serving"} | counter | (exlpy: Triton compiles; "serving" should stay 0) |

Latencies are taken where the bridge hands a step's results to the event loop: TTFT from the request's
submission to its first token, inter-token per token (a result carrying k tokens counts its gap / k k times).
The registry is the server's own, so several apps in one process (tests) do not collide. prometheus_client is
part of the `server` extra; without it the server runs and /metrics says what to install.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from typing import Any

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
FINISH = {"stop_token": "stop", "stop_string": "stop", "end_filter": "stop", "max_new_tokens": "length"}


class KernelCompiles:
    """Counts Triton kernel compiles in this process (a jit hook), split at `mark_ready()`: compiles after it
    are ones a request waited for, which the serving warm-up is meant to leave at zero."""

    _lock = threading.Lock()
    startup = 0
    serving = 0
    ready = False
    last: list[str] = []
    keys: list[str] = []  # every compile of this process, startup ones too (what the warm-up covered)
    _installed = False

    available = False  # a hook is installed (Triton present, with a hook API this code knows)

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True

            def counting(previous: Any) -> Any:
                def hook(*args: Any, **kwargs: Any) -> Any:
                    # repr names the kernel and launch options, key the arguments' specializations and constexprs
                    cls.count(f"{kwargs.get('repr', '?')} key={kwargs.get('key', '?')}")
                    return previous(*args, **kwargs) if previous else None
                return hook

            try:
                import triton.knobs as knobs  # Triton >= 3.4

                knobs.runtime.jit_post_compile_hook = counting(knobs.runtime.jit_post_compile_hook)
                cls.available = True
                return
            except Exception:  # noqa: BLE001 - no Triton (CPU), or an older one: try its class attribute
                pass
            try:
                from triton.runtime.jit import JITFunction

                if hasattr(JITFunction, "compiled_hook"):
                    JITFunction.compiled_hook = counting(JITFunction.compiled_hook)
                    cls.available = True
            except Exception:  # noqa: BLE001 - nothing compiles without Triton
                pass

    @classmethod
    def count(cls, what: str) -> None:
        with cls._lock:
            cls.keys = [*cls.keys[-4095:], what]
            if cls.ready:
                cls.serving += 1
                cls.last = [*cls.last[-7:], what[:4000]]  # whole: which argument picked the variant
            else:
                cls.startup += 1

    @classmethod
    def mark_ready(cls) -> None:
        cls.ready = True

    @classmethod
    def health(cls) -> dict[str, Any]:
        if not cls.available:
            return {"kernel_compiles_startup": None, "kernel_compiles_serving": None}
        return {"kernel_compiles_startup": cls.startup, "kernel_compiles_serving": cls.serving,
                "kernel_compiles_serving_last": list(cls.last)}


class Metrics:
    """The server's metrics: the observer of the state's bridge (steps, routed results; a model loaded later
    through the admin routes gets a bridge observed the same way) plus gauges read at scrape time."""

    def __init__(self, state: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.state = state
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("exlpy:prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("exlpy:generation_tokens", "Tokens generated", registry=r)
        self.success = Counter("exlpy:request_success", "Requests finished, by reason", ["finished_reason"],
                               registry=r)
        self.ttft = LoopHistogram("exlpy:time_to_first_token_seconds", "Time from submission to the first token",
                                  TTFT_BUCKETS, r)
        self.itl = LoopHistogram("exlpy:inter_token_latency_seconds", "Time between a request's tokens",
                                 ITL_BUCKETS, r)
        self.e2e = LoopHistogram("exlpy:e2e_request_latency_seconds", "Time from submission to the last token",
                                 E2E_BUCKETS, r)
        self.step = LoopHistogram("exlpy:step_time_seconds", "Time of one generator iteration (prefill chunks and "
                                  "one decode step)", STEP_BUCKETS, r)
        r.register(_StateCollector(state))
        self._times: dict[int, tuple[float, float]] = {}  # id(handle) -> (submitted, last token)

    # --- the bridge's observer (event loop) ----------------------------------------------------------------
    def on_accepted(self, handle: Any) -> None:
        self.prompt_tokens.inc(int(getattr(handle.job, "prompt_len", 0) or 0))
        self._times[id(handle)] = (handle.submitted, 0.0)

    def on_step(self, seconds: float, _bridge: Any) -> None:
        self.step.observe(seconds)

    def on_results(self, routed: list[tuple[Any, dict[str, Any]]]) -> None:
        """One step's streaming results (handle, result), taken at one instant."""
        now = time.perf_counter()
        times, itl = self._times, self.itl
        generated = 0
        for handle, r in routed:
            key = id(handle)
            submitted, last = times.get(key, (handle.submitted, 0.0))
            ids = r.get("token_ids")
            n = ids.shape[-1] if ids is not None else 0
            if n:
                generated += n
                if last == 0.0:
                    self.ttft.observe(now - submitted)
                    n -= 1
                if n and last:
                    itl.observe((now - last) / n, n)
                last = now
            if r.get("eos"):
                times.pop(key, None)
                self.e2e.observe(now - submitted)
                reason = "error" if "error" in r else FINISH.get(r.get("eos_reason", ""), "stop")
                self.success.labels(finished_reason=reason).inc()
            else:
                times[key] = (submitted, last)
        if generated:
            self.generation_tokens.inc(generated)

    def on_closed(self, handle: Any) -> None:
        self._times.pop(id(handle), None)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class LoopHistogram:
    """A Prometheus histogram observed from the event loop only: no lock, one bisect per observation, and `n`
    equal observations at once (a result carrying k tokens). prometheus_client's Histogram takes a lock and loops
    over its buckets in Python for every observation, which at thousands of tokens a second is a visible share of
    the event loop's time. Registered as a collector; exposed like a Histogram (buckets, _count, _sum)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], registry: Any) -> None:
        self.name, self.doc = name, doc
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n  # "le" buckets: a value equal to a bound counts in it
        self.sum += value * n

    def describe(self) -> list[Any]:
        from prometheus_client.core import HistogramMetricFamily

        return [HistogramMetricFamily(self.name, self.doc)]

    def collect(self) -> Any:
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        total, buckets = 0, []
        for le, count in zip([*map(floatToGoString, self.bounds), "+Inf"], list(self.counts)):
            total += count
            buckets.append((le, total))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


class _StateCollector:
    """Gauges and counters read from the bridge and the generator when scraped (none while no model is loaded)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        b = self.state.bridge
        if b is None:
            return
        g = b.generator
        total = int(g.num_pages)
        used = total - int(g.page_table.num_unreferenced())
        yield GaugeMetricFamily("exlpy:num_requests_running", "Requests in the generator's batch",
                                value=b.num_running())
        yield GaugeMetricFamily("exlpy:num_requests_waiting", "Requests accepted, waiting to start",
                                value=b.num_queued())
        yield GaugeMetricFamily("exlpy:cache_pages_used", "KV cache pages referenced by jobs", value=used)
        yield GaugeMetricFamily("exlpy:cache_pages_total", "KV cache pages", value=total)
        yield GaugeMetricFamily("exlpy:kv_cache_usage_perc", "KV cache usage (1 = full)",
                                value=used / total if total else 0.0)
        yield CounterMetricFamily("exlpy:num_preemptions", "Jobs preempted because the cache was full",
                                  value=int(getattr(g, "preemptions", 0)))
        # Prompt tokens looked up in the prefix cache (run through the model or found cached) and those found.
        cached = int(getattr(g, "cached_tokens", 0))
        yield CounterMetricFamily("exlpy:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=cached + int(getattr(g, "prefill_tokens", 0)))
        yield CounterMetricFamily("exlpy:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  value=cached)
        spec = getattr(g, "spec", None)
        if spec is not None:
            _, _, _, drafted, accepted = spec.stats()
            yield CounterMetricFamily("exlpy:spec_decode_num_draft_tokens", "Draft tokens proposed", value=drafted)
            yield CounterMetricFamily("exlpy:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                      value=accepted)
        if KernelCompiles.available:
            compiles = CounterMetricFamily("exlpy:kernel_compiles", "Triton kernel compiles in this process",
                                           labels=["phase"])
            compiles.add_metric(["startup"], KernelCompiles.startup)
            compiles.add_metric(["serving"], KernelCompiles.serving)
            yield compiles


def attach(state: Any) -> Metrics | None:
    """Metrics of `state` (kept as state.metrics; its bridge observed), or None without prometheus_client (the
    server runs without /metrics)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return None
    m = Metrics(state)
    state.metrics = m
    if state.bridge is not None:
        state.bridge.observer = m
    return m


def add_route(app: Any, metrics: Metrics | None) -> None:
    """`GET /metrics`: the Prometheus text format (503 naming the missing package without prometheus_client)."""
    from fastapi.responses import JSONResponse, Response

    from exlpy.server.schemas import error_body

    @app.get("/metrics", include_in_schema=False)
    async def _metrics() -> Response:
        if metrics is None:
            return JSONResponse(error_body("metrics need prometheus_client: pip install 'exlpy[server]'",
                                           "server_error", code="metrics_unavailable"), status_code=503)
        body, kind = metrics.render()
        return Response(body, media_type=kind)
