"""`exlpy serve` as replicas on Ray Serve: N replicas, each a full exlpy engine on its own GPUs, behind Ray's
HTTP proxy with the same routes, streaming, errors and keys as `exlpy serve` (exlpy/server/app.py).

    serve run exlpy.server.ray_app:app_builder model=DIR replicas=2 gpus_per_replica=1
    serve.run(build_app(model="DIR", replicas=2, gpus_per_replica=1))      # from Python

Placement: each replica asks Ray for `gpus_per_replica` whole GPUs (`ray_actor_options.num_gpus`), so Ray gives
every replica its own devices (CUDA_VISIBLE_DEVICES) and two replicas never share a GPU; inside a replica the
usual placement applies (automatic split, `gpu_split`, or `tensor_parallel` over its GPUs).

Two deployments: `{name}` holds the engine replicas (exlpy/server/ray_replica.py: each runs `exlpy serve`'s app
in its process), `{name}-ingress` is what Ray's HTTP proxy calls (ray_ingress.py: a small CPU actor that reads
the request, routes it, retries it on another replica when its replica stopped before answering, ends a stream
cut by a dying replica with an error event, and sums the replicas' metrics for `/metrics`).

Routing (ray_router.py, a Ray Serve request router): `router=pow2` (the default) is Ray's power of two choices
(two random replicas, the one with fewer ongoing requests), so a replica busy with long generations gets fewer
new ones than round-robin would give it; `router=prefix` sends requests whose prompts start alike (the first
`prefix_chars` characters) to the same replica, where that prefix's KV pages are cached, unless that replica
runs more than `prefix_imbalance` requests above the least busy one; `router=rr` is round-robin (the
baseline of benchmarks/ray_serve.py). A request's `x-exlpy-routing: prefix|pow2|rr` header overrides the app's
choice. `max_ongoing_requests` bounds what one replica holds; past it
requests wait in the ingress. Each response names its replica in the `x-exlpy-replica` header.

Health: Ray calls `check_health` every `health_check_period_s`; it fails when the replica's generator thread has
stopped, and Ray then replaces the replica.

Ray is an optional extra: `pip install "exlpy[ray]"`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from exlpy.errors import ConfigError
from exlpy.runtime import options as runtime_options
from exlpy.server.auth import KeyPolicy
from exlpy.server.options import (
    DEFAULT_MAX_QUEUE,
    AccessOptions,
    ModelOptions,
    _check_keys,
    model_options,
)

try:
    import ray
    from ray import serve
except ImportError as e:  # the error names the extra that brings Ray
    raise ImportError("exlpy.server.ray_app needs Ray Serve: pip install \"exlpy[ray]\" (ray[serve])") from e

MIN_RAY = (2, 60)  # `@serve.ingress()` + __serve_build_asgi_app__, and ray.serve.request_router's public API
if tuple(int(x) for x in ray.__version__.split(".")[:2] if x.isdigit()) < MIN_RAY:
    raise ImportError(f"exlpy.server.ray_app needs ray[serve] >= {'.'.join(map(str, MIN_RAY))} (found "
                      f"{ray.__version__}): pip install -U \"exlpy[ray]\"")

from exlpy.server.ray_ingress import ATTEMPTS_HEADER, ExlpyIngress, IngressOptions  # noqa: E402
from exlpy.server.ray_replica import REPLICA_HEADER, ExlpyReplica  # noqa: E402
from exlpy.server.ray_router import POLICIES, PrefixAffinityRouter  # noqa: E402

__all__ = ["ATTEMPTS_HEADER", "REPLICA_HEADER", "RayServeOptions", "app_builder", "build_app", "parse_args"]

# Arguments that go to the model's load (ModelOptions, the same names as `exlpy serve`'s flags).
MODEL_ARGS = ("model", "served_model_name", "max_seq_len", "cache_size", "cache_mode", "gpu_split",
              "gpu_split_auto", "autosplit_reserve", "tensor_parallel", "rope_scale", "rope_alpha",
              "prompt_template", "max_batch_size", "chunk_size", "gpu_memory_utilization", "max_prefill_per_step")
_INT_ARGS = {"max_seq_len", "cache_size", "max_batch_size", "chunk_size", "max_prefill_per_step"}
_FLOAT_ARGS = {"rope_scale", "rope_alpha", "gpu_memory_utilization"}
_BOOL_ARGS = {"tensor_parallel", "gpu_split_auto"}


@dataclass(frozen=True)
class RayServeOptions:
    """What `app_builder` / `build_app` take, parsed once: the model's load, access, and the replica layout."""

    model: ModelOptions
    access: AccessOptions = field(default_factory=AccessOptions)
    max_queue: int = DEFAULT_MAX_QUEUE
    replicas: int = 1  # fixed count; ignored when autoscaling (min_replicas/max_replicas) is given
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0  # autoscaling: ongoing requests per replica it aims for
    max_ongoing_requests: int = 64  # per replica; more wait in the proxy (and count for power-of-two choices)
    gpus_per_replica: float = 0.0  # 0: CPU replicas (tests, the demo model)
    cpus_per_replica: float = 1.0
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    # A replica that Ray removes (scaling down, redeploying) stops taking requests and has this long to finish
    # the ones it runs, streams included, before it is killed (exlpy serve's --shutdown-timeout).
    shutdown_timeout_s: float = 30.0
    # Routing and the ingress (ray_router.py, ray_ingress.py).
    router: str = "pow2"  # or "prefix", "rr" (ray_router.POLICIES)
    prefix_chars: int = 1024  # the routing key: this many characters of the prompt (about one 256-token page)
    prefix_imbalance: int = 16  # prefix routing gives way to load past this many more requests than the least
    retries: int = 1  # a request whose replica stopped before answering is sent again this many times
    ingress_replicas: int = 1
    stats_period_s: float = 2.0  # how often Ray polls each replica's metrics (the age bound of /metrics sums)
    name: str = "exlpy"

    @property
    def autoscaling(self) -> dict[str, Any] | None:
        if self.min_replicas is None and self.max_replicas is None:
            return None
        lo = self.min_replicas if self.min_replicas is not None else 1
        hi = self.max_replicas if self.max_replicas is not None else max(lo, self.replicas)
        return {"min_replicas": lo, "max_replicas": hi, "initial_replicas": min(max(self.replicas, lo), hi),
                "target_ongoing_requests": self.target_ongoing_requests}


def _parse(name: str, v: Any, kind: type) -> Any:
    """A value from `serve run`'s `key=value` arguments (strings) or Python (typed); None stays None."""
    if v is None or not isinstance(v, str):
        return v
    if kind is bool:
        low = v.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"ray_app argument {name} must be true or false, got {v!r}")
    try:
        return kind(v)
    except ValueError:
        raise ConfigError(f"ray_app argument {name} must be a{'n integer' if kind is int else ' number'}, "
                          f"got {v!r}") from None


def _keys(v: Any, name: str) -> tuple[str, ...]:
    if v is None:
        return ()
    keys = [k.strip() for k in v.split(",")] if isinstance(v, str) else list(v)
    return _check_keys([k for k in keys if k], name)


def parse_args(args: Mapping[str, Any]) -> RayServeOptions:
    """RayServeOptions from `serve run`'s arguments or build_app's keywords; unknown names are an error."""
    layout = [f.name for f in fields(RayServeOptions) if f.name not in ("model", "access", "name", "router")]
    known = set(MODEL_ARGS) | set(layout) | {"api_key", "admin_key", "disable_auth", "name", "router"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(f"ray_app: unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for k in MODEL_ARGS:
        kind = int if k in _INT_ARGS else float if k in _FLOAT_ARGS else bool if k in _BOOL_ARGS else str
        values[k] = _parse(k, args.get(k), kind)
    model = model_options(values)
    env_key = runtime_options().api_key  # EXLPY_API_KEY where the app is built (a Kubernetes secret, say)
    access = AccessOptions(api_keys=_keys(args.get("api_key"), "api_key") + ((env_key,) if env_key else ()),
                           admin_keys=_keys(args.get("admin_key"), "admin_key"),
                           disable_auth=bool(_parse("disable_auth", args.get("disable_auth"), bool)))
    out: dict[str, Any] = {}
    for k in layout:
        if args.get(k) is None:
            continue
        kind = float if k in ("target_ongoing_requests", "gpus_per_replica", "cpus_per_replica",
                              "health_check_period_s", "health_check_timeout_s", "shutdown_timeout_s",
                              "stats_period_s") else int
        v = _parse(k, args[k], kind)
        low = 0 if k in ("retries", "prefix_imbalance") else 1  # 0 retries / imbalance are meaningful
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (kind is int and v < low) or \
                (k == "stats_period_s" and v <= 0):
            raise ConfigError(f"ray_app argument {k} must be a {'positive integer' if kind is int else 'number >= 0'}"
                              f", got {args[k]!r}")
        out[k] = v
    router = str(args.get("router") or "pow2").strip().lower()
    if router not in POLICIES:
        raise ConfigError(f"ray_app argument router must be one of {', '.join(POLICIES)}, got {args['router']!r}")
    opts = RayServeOptions(model=model, access=access, name=str(args.get("name") or "exlpy"), router=router, **out)
    a = opts.autoscaling
    if a is not None and a["min_replicas"] > a["max_replicas"]:
        raise ConfigError(f"ray_app: min_replicas {a['min_replicas']} > max_replicas {a['max_replicas']}")
    if opts.gpus_per_replica != int(opts.gpus_per_replica):  # a fraction would put two engines on one GPU
        raise ConfigError(f"ray_app: gpus_per_replica must be a whole number of GPUs (replicas never share one), "
                          f"got {opts.gpus_per_replica:g}")
    return opts


def build_app(**kwargs: Any) -> Any:
    """A Ray Serve application (pass it to `serve.run`) from keyword arguments: `model` (a model dir; the bundled
    demo model by default), the load options of `exlpy serve` (max_seq_len, cache_size, cache_mode, gpu_split,
    tensor_parallel, ...), `api_key`/`admin_key` (comma-separated or lists), and the layout: `replicas` or
    `min_replicas`/`max_replicas`/`target_ongoing_requests` (autoscaling), `gpus_per_replica`,
    `cpus_per_replica`, `max_ongoing_requests`; routing: `router` (pow2, prefix or rr), `prefix_chars`,
    `prefix_imbalance`; `retries`, `ingress_replicas`, `stats_period_s`."""
    return bind(parse_args(kwargs))


def bind(opts: RayServeOptions) -> Any:
    from ray.serve.config import RequestRouterConfig

    actor: dict[str, Any] = {"num_cpus": opts.cpus_per_replica}
    if opts.gpus_per_replica:
        actor["num_gpus"] = opts.gpus_per_replica
    layout: dict[str, Any] = {"autoscaling_config": opts.autoscaling} if opts.autoscaling else \
        {"num_replicas": opts.replicas}
    routing = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                  request_router_kwargs={"imbalance": opts.prefix_imbalance},
                                  request_routing_stats_period_s=opts.stats_period_s)
    engine = serve.deployment(ExlpyReplica, name=opts.name, ray_actor_options=actor,
                              max_ongoing_requests=opts.max_ongoing_requests,
                              health_check_period_s=opts.health_check_period_s,
                              health_check_timeout_s=opts.health_check_timeout_s,
                              graceful_shutdown_timeout_s=opts.shutdown_timeout_s,
                              request_router_config=routing, **layout).bind(opts)
    hi = opts.autoscaling["max_replicas"] if opts.autoscaling else opts.replicas
    ingress = IngressOptions(engine=opts.name, router=opts.router, prefix_chars=opts.prefix_chars,
                             retries=opts.retries, metrics_require_key=opts.access.metrics_require_key)
    policy = KeyPolicy(opts.access.api_keys, opts.access.admin_keys, opts.access.disable_auth,
                       opts.access.metrics_require_key)
    # The ingress reserves no CPU (it forwards bytes); it holds every request of the replicas and their queues.
    return serve.deployment(ExlpyIngress, name=f"{opts.name}-ingress", num_replicas=opts.ingress_replicas,
                            ray_actor_options={"num_cpus": 0},
                            max_ongoing_requests=max(1024, 2 * hi * opts.max_ongoing_requests),
                            graceful_shutdown_timeout_s=opts.shutdown_timeout_s).bind(engine, ingress, policy)


def app_builder(args: dict[str, str]) -> Any:
    """Ray's application builder: `serve run exlpy.server.ray_app:app_builder model=DIR replicas=2 ...`."""
    return build_app(**args)
