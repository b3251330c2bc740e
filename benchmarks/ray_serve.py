"""exlpy on Ray Serve (issue 36): throughput by replica count, and prefix routing against round-robin and power
of two choices.

    # GPU, two GPUs, the issue's figures in ~5 minutes (`bash benchmarks/gpu_session.sh ray8b` runs this): a
    # random-weight Llama-3-8B-shaped fp16 model (built once under --work: `--model 8b --build-only` builds it
    # alone, e.g. in an earlier device call), 1 and 2 one-GPU replicas under 128 streams, then round-robin, power
    # of two choices and prefix routing on the 2 replicas with 2,000-token system prompts
    PYTHONPATH=. python benchmarks/ray_serve.py --model 8b --preset 8b --out benchmarks/results/ray_serve.md
    # GPU, two GPUs, under 4 minutes with Ray's start (`bash benchmarks/gpu_session.sh ray`): a tiny EXL2 model
    PYTHONPATH=. python benchmarks/ray_serve.py --model ../shared/models/tiny-llama-exl2-4.0 --quick \
        --out benchmarks/results/ray_serve.md
    # CPU, scaled down (checks the script, not the speed: two replicas share the cores)
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/ray_serve.py --model exlpy/demo/aidreams260K \
        --gpus-per-replica 0 --cpus-per-replica 0.5 --streams 8 --prompts 8,40 --max-tokens 32 --cache-size 8192 \
        --max-seq-len 1024 --system-tokens 300 --user-tokens 10,30 --systems 4,1 --clients 4 \
        --requests-per-client 4 --prefix-max-tokens 4

Part `scaling`: each replica count gets a fresh Serve application on a local Ray (`ray.init` sees the machine's
GPUs); the load is benchmarks/serving_load.py's: `--streams` streamed completions sent at once, random token-id
prompts of random length in `--prompts`, exactly `--max-tokens` tokens each (EOS banned, temperature 0), after two
requests per replica and an unmeasured warm-up load (the same streams and prompt lengths, other prompts, 32 tokens
each: Triton compiles and graph captures happen there, not in the first replica count's timing while the later ones
find the kernel cache warm); `--repeats` measured runs per replica count, each on fresh prompts (the same sets for
every count). Reported per run: total tokens/s over the wall time, TTFT median / p99, inter-token median, errors,
requests per replica (from /metrics/replicas) and the speed-up over the first replica count's mean; then the
speed-up of the means. Routing: `--scaling-routing`, power of two choices by default.

Part `prefix` (on the largest replica count's application, after its scaling run): for each count S in `--systems`
(e.g. `1,32`), S system prompts of `--system-tokens` random token ids, `--clients` clients each sending
`--requests-per-client` streamed requests one after the other, each a random system prompt plus a random user part
of `--user-tokens` tokens, `--prefix-max-tokens` tokens out. The same workload (fresh system prompts, so no phase
finds another's pages) runs once per routing policy of `--policies`, chosen per request by the `x-exlpy-routing`
header: `rr` (round-robin, what a plain load balancer does), `pow2` (Ray's default: power of two choices) and
`prefix` (exlpy's prefix affinity, ray_router.py). Reported per policy: the prefix cache hit rate (prompt tokens
found cached / looked up, from the ingress's `/metrics` summed over replicas), TTFT median / p99, tokens/s, requests
per replica. An unmeasured warm-up (each client one request on system prompts of its own) comes first, so the first
policy does not pay for compiling the long prompts' shapes. Why several S: one shared system prompt is prefilled
once per replica under any policy and hits the cache afterwards, so policies differ by one prefill per replica; with
many system prompts (tenants, agents) and few requests each, round-robin prefills each prompt on every replica while
prefix routing prefills it once.

`--model` is a model directory, or `8b` / `small` (benchmarks/serving.py's random-weight Llama-3-8B-shaped and
SmolLM2-135M-shaped fp16 models, built under `--work` the first time). The markdown written to `--out` starts with
the date, device, versions and this command, and each table is appended as soon as its part ends (a run cut short
keeps what it measured).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving_client import Stream, pct, prompt, stream  # noqa: E402

APP = "exlpy-bench"
PRESETS: dict[str, dict[str, Any]] = {
    # the tiny model's 4-minute check of the whole path
    "quick": {"replicas": "1,2", "streams": 64, "prompts": "100,1000", "max_tokens": 128, "system_tokens": 2000,
              "user_tokens": "50,200", "systems": "8", "clients": 32, "requests_per_client": 4,
              "prefix_max_tokens": 32},
    # the figures on an 8B model in ~5 minutes: 128 streams (one request each, 256 tokens out, two runs
    # per replica count), then 2,000-token system prompts: 32 prompts shared by ~4 requests each, and one prompt
    # shared by all
    "8b": {"replicas": "1,2", "streams": 128, "prompts": "100,1000", "max_tokens": 256, "repeats": 2,
           "system_tokens": 2000, "user_tokens": "50,200", "systems": "32,1", "clients": 32,
           "requests_per_client": 4, "prefix_max_tokens": 32},
}
MODEL_KEYS = ("8b", "small")  # benchmarks/serving.py's random-weight models that --model may name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client(url: str, routing: str | None = None) -> tuple[Any, Any]:
    import httpx
    import openai

    http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
    headers = {"x-exlpy-routing": routing} if routing else None
    return http, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", http_client=http, max_retries=0,
                                    default_headers=headers)


async def drive(url: str, name: str, prompts: list[list[int]], max_tokens: int,
                routing: str | None = None) -> tuple[list[Stream], float]:
    http, c = client(url, routing)
    streams = [Stream() for _ in prompts]
    t0 = time.perf_counter()
    await asyncio.gather(*[stream(c, name, ids, max_tokens, s) for ids, s in zip(prompts, streams)])
    wall = time.perf_counter() - t0
    await http.aclose()
    return streams, wall


def summary(streams: list[Stream], wall: float) -> dict[str, Any]:
    ok = [s for s in streams if s.error is None and s.chunks]
    tokens = sum(s.tokens or len(s.chunks) for s in ok)
    gaps = [g for s in ok for g in s.gaps()]
    return {"tok_s": tokens / wall, "ttft_p50": pct([s.ttft for s in ok], 0.5),
            "ttft_p99": pct([s.ttft for s in ok], 0.99), "itl_p50": pct(gaps, 0.5),
            "errors": len(streams) - len(ok), "wall": wall,
            "first_error": next((s.error for s in streams if s.error), None)}


def deploy(args: argparse.Namespace, replicas: int, port: int) -> tuple[str, str]:
    import httpx
    from ray import serve

    from exlpy.server.ray_app import build_app

    extra = {"cache_size": args.cache_size} if args.cache_size else {}
    if args.max_seq_len:
        extra["max_seq_len"] = args.max_seq_len
    app = build_app(model=args.model, replicas=replicas, gpus_per_replica=args.gpus_per_replica,
                    cpus_per_replica=args.cpus_per_replica, max_ongoing_requests=args.max_ongoing_requests,
                    max_queue=max(64, args.streams, args.clients), name=APP, stats_period_s=1.0, **extra)
    serve.run(app, name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    name = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    ANSWERED[url] = 0  # a fresh application: its counters start at zero
    for _ in range(2 * replicas):  # every replica answers twice (round-robin) before anything is measured
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=600,
                       headers={"x-exlpy-routing": "rr"})
        ANSWERED[url] += r.status_code == 200
    return url, name


SUCCESS = "exlpy:request_success_total"


def metrics(url: str) -> dict[Any, float]:
    """The ingress's /metrics summed over replicas and labels, by sample name; and, under ("replica", ID), each
    replica's finished requests (from /metrics/replicas)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Any, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for smp in fam.samples:
            out[smp.name] = out.get(smp.name, 0.0) + smp.value
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics/replicas", timeout=60).text):
        for smp in fam.samples:
            if smp.name == SUCCESS and "replica" in smp.labels:
                key = ("replica", smp.labels["replica"])
                out[key] = out.get(key, 0.0) + smp.value
    return out


ANSWERED: dict[str, int] = {}  # requests the application answered so far, by URL (as this client saw them)


def settled(url: str) -> dict[Any, float]:
    """The ingress's metrics once they count every request answered so far (the replicas' figures reach the
    ingress every stats period), or after 30 s."""
    end = time.monotonic() + 30
    out = metrics(url)
    while out.get(SUCCESS, 0.0) < ANSWERED.get(url, 0) and time.monotonic() < end:
        time.sleep(0.5)
        out = metrics(url)
    return out


def run_load(url: str, load: Any) -> tuple[list[Stream], float]:
    """Run the coroutine `load` (a drive or prefix_load): its streams and wall time; counts its answers."""
    streams, wall = asyncio.run(load)
    ANSWERED[url] = ANSWERED.get(url, 0) + sum(s.error is None for s in streams)
    return streams, wall


def measured(url: str, load: Any) -> tuple[tuple[list[Stream], float], dict[Any, float]]:
    """run_load's result, and the change of the ingress's metrics over it (neither end counting earlier loads'
    late figures into it)."""
    before = settled(url)
    result = run_load(url, load)
    after = settled(url)
    return result, {k: v - before.get(k, 0.0) for k, v in after.items()}


def split(delta: dict[Any, float]) -> str:
    """Finished requests per replica, largest first, e.g. "66/62"."""
    counts = sorted((v for k, v in delta.items() if isinstance(k, tuple) and k[0] == "replica"), reverse=True)
    return "/".join(f"{v:.0f}" for v in counts) or "n/a"


async def prefix_load(url: str, name: str, systems: list[list[int]], args: argparse.Namespace, vocab: int,
                      routing: str, seed: int, per_client: int | None = None) -> tuple[list[Stream], float]:
    """`clients` closed-loop clients, each sending requests one after the other: a random system prompt and a
    random user part."""
    http, c = client(url, routing)
    rng = random.Random(seed)
    lo, hi = (int(x) for x in args.user_tokens.split(","))
    plans = [[systems[rng.randrange(len(systems))] + prompt(rng, rng.randint(lo, hi), vocab)
              for _ in range(per_client or args.requests_per_client)] for _ in range(args.clients)]
    streams: list[Stream] = []

    async def one_client(prompts: list[list[int]]) -> None:
        for ids in prompts:
            streams.append(await stream(c, name, ids, args.prefix_max_tokens, Stream()))

    t0 = time.perf_counter()
    await asyncio.gather(*[one_client(p) for p in plans])
    wall = time.perf_counter() - t0
    await http.aclose()
    return streams, wall


def prefix_phase(args: argparse.Namespace, url: str, name: str, vocab: int, routing: str, n_systems: int,
                 seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    systems = [prompt(rng, args.system_tokens, vocab) for _ in range(n_systems)]
    (streams, wall), delta = measured(url, prefix_load(url, name, systems, args, vocab, routing, seed + 1))
    hits = delta.get("exlpy:prefix_cache_hits_total", 0.0)
    queries = delta.get("exlpy:prefix_cache_queries_total", 0.0)
    return {"routing": routing, "systems": n_systems, "hit_rate": hits / queries if queries else float("nan"),
            "requests": len(streams), "split": split(delta), **summary(streams, wall)}


def model_path(args: argparse.Namespace) -> str:
    """--model as a directory: benchmarks/serving.py's random-weight model for a key (built the first time)."""
    if args.model not in MODEL_KEYS:
        return args.model
    from benchmarks.serving import model_dir

    t0 = time.perf_counter()
    path = model_dir(args.work, args.model)
    print(f"model {args.model}: {path} ({time.perf_counter() - t0:.0f} s to build or find)", flush=True)
    return path


def prewarm(args: argparse.Namespace) -> None:
    """Load the model as a replica does (on one GPU, the same options) and run its warm-up, then exit: Triton's
    compiles land in its on-disk cache, which the replicas of a later call on the same machine then find."""
    from exlpy.server.loading import load_generator
    from exlpy.server.options import model_options

    values: dict[str, Any] = {"model": args.model_dir}
    if args.cache_size:
        values["cache_size"] = args.cache_size
    if args.max_seq_len:
        values["max_seq_len"] = args.max_seq_len
    t0 = time.perf_counter()
    generator, _ = load_generator(model_options(values))
    print(f"prewarm: loaded and warmed up in {time.perf_counter() - t0:.0f} s "
          f"(batch up to {generator.max_batch_size})", flush=True)


def gpu_names() -> list[str]:
    """The GPUs' names from nvidia-smi (this process creates no CUDA context next to the replicas')."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()] if out.returncode == 0 else []


def header(args: argparse.Namespace) -> list[str]:
    """Date, device, versions and command of this run: the first lines of its markdown."""
    import subprocess

    import ray
    import torch

    names = gpu_names()
    if names:
        device = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    else:
        device = f"CPU ({os.cpu_count()} cores)"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        rev = "unknown"
    return [f"## Ray Serve, {Path(args.model_dir).name}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
            f"- device: {device}; {args.gpus_per_replica:g} GPU(s) per replica",
            f"- versions: torch {torch.__version__}, ray {ray.__version__}, Python {sys.version.split()[0]}, "
            f"exlpy commit {rev}",
            f"- command: `python {' '.join(sys.argv)}`", ""]


def emit(args: argparse.Namespace, lines: list[str]) -> None:
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


def scaling_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    lo, hi = args.prompts.split(",")
    counts = list(dict.fromkeys(r["replicas"] for r in rows))
    mean = {n: statistics.mean(r["tok_s"] for r in rows if r["replicas"] == n) for n in counts}
    base = mean[counts[0]]
    lines = [f"Scaling: {args.streams} streams at once, prompts {lo}-{hi} tokens, {args.max_tokens} tokens "
             f"each, routing {args.scaling_routing}; {args.repeats} run(s) per replica count, fresh prompts each", "",
             "| replicas | run | tokens/s | speed-up | TTFT p50 (s) | TTFT p99 (s) | inter-token p50 (ms) | wall (s) "
             "| requests per replica | errors |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['replicas']} | {r['run']} | {r['tok_s']:.0f} | {r['tok_s'] / base:.2f}x | "
                     f"{r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | {1000 * r['itl_p50']:.1f} | {r['wall']:.1f} | "
                     f"{r['split']} | {r['errors']} |")
    lines += [""] + [f"Speed-up of {n} replicas over {counts[0]} (mean tokens/s of the runs): "
                     f"{mean[n] / base:.2f}x ({mean[n]:.0f} vs {base:.0f} tokens/s)." for n in counts[1:]]
    return lines + [""]


def routing_table(args: argparse.Namespace, replicas: int, n_systems: int, routed: list[dict[str, Any]]) -> list[str]:
    ulo, uhi = args.user_tokens.split(",")
    lines = [f"Routing, {replicas} replicas: {n_systems} system prompt(s) of {args.system_tokens} tokens, "
             f"{args.clients} clients x {args.requests_per_client} requests (system prompt + {ulo}-{uhi} "
             f"user tokens), {args.prefix_max_tokens} tokens out", "",
             "| routing | prefix cache hit rate | TTFT p50 (s) | TTFT p99 (s) | tokens/s | requests per replica "
             "| errors |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for r in routed:
        lines.append(f"| {r['routing']} | {r['hit_rate']:.1%} | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | "
                     f"{r['tok_s']:.0f} | {r['split']} | {r['errors']} |")
    by = {r["routing"]: r for r in routed}
    px = by.get("prefix")
    for other in ("rr", "pow2"):
        o = by.get(other)
        if px and o and o["ttft_p50"] > 0:
            name = {"rr": "round-robin", "pow2": "power of two choices"}[other]
            r = px["ttft_p50"] / o["ttft_p50"]
            lines += ["", f"Prefix routing against {name}: TTFT p50 {px['ttft_p50']:.3f} s vs {o['ttft_p50']:.3f} s "
                          f"({r:.2f}x: {abs(1 - r):.0%} {'lower' if r < 1 else 'higher'}), "
                          f"hit rate {px['hit_rate']:.1%} vs {o['hit_rate']:.1%}."]
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory, or 8b / small (built under --work)")
    ap.add_argument("--work", default="/tmp/exlpy_bench", help="where --model 8b is built (reused)")
    ap.add_argument("--build-only", action="store_true", help="build --model 8b and exit (no Ray)")
    ap.add_argument("--prewarm", action="store_true",
                    help="with --build-only: also load the model on GPU 0 and warm it up (fills Triton's cache)")
    ap.add_argument("--parts", default="scaling,prefix")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="defaults for a profile (options given explicitly win): " + str(PRESETS))
    ap.add_argument("--quick", action="store_true", help="= --preset quick")
    ap.add_argument("--replicas", default="1,2", help="replica counts to compare, e.g. 1,2")
    ap.add_argument("--gpus-per-replica", type=float, default=1.0)
    ap.add_argument("--cpus-per-replica", type=float, default=1.0)
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--prompts", default="100,2000", help="prompt length range LO,HI (tokens)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="measured runs of the scaling load per replica count")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--user-tokens", default="50,200", help="user part length range LO,HI (tokens)")
    ap.add_argument("--systems", default="8", help="distinct system prompts per routing phase; a list runs each")
    ap.add_argument("--policies", default="rr,pow2,prefix", help="routing policies compared (ray_router.POLICIES)")
    ap.add_argument("--scaling-routing", default="pow2", help="the routing policy of the scaling part")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--prefix-max-tokens", type=int, default=64)
    ap.add_argument("--cache-size", type=int, default=None, help="per replica (default: sized from free memory)")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--max-ongoing-requests", type=int, default=256)
    ap.add_argument("--object-store-mb", type=int, default=2048, help="Ray's object store (requests are small)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the unmeasured warm-up loads (Triton compiles and graph captures happen there)")
    ap.add_argument("--out", default=None, help="append the tables to this markdown file")
    args = ap.parse_args()
    preset = "quick" if args.quick and args.preset is None else args.preset
    if preset:
        for k, v in PRESETS[preset].items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    parts = set(args.parts.split(","))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    system_counts = [int(x) for x in str(args.systems).split(",")]
    if args.build_only and args.prewarm:  # one GPU, as a replica sees it (the build draws its weights there too)
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    args.model_dir = model_path(args)
    if args.build_only:
        if args.prewarm:
            prewarm(args)
        return

    import ray
    from ray import serve

    from exlpy.config import ExLlamaV2Config
    from exlpy.server.ray_router import POLICIES

    bad = [p for p in policies + [args.scaling_routing] if p not in POLICIES]
    if bad:
        sys.exit(f"ray_serve: unknown routing policy {bad} (known: {', '.join(POLICIES)})")
    args.model = args.model_dir  # what the replicas load
    t_start = time.perf_counter()
    vocab = ExLlamaV2Config(args.model).vocab_size
    lo, hi = (int(x) for x in args.prompts.split(","))
    rng = random.Random(args.seed)
    warm_prompts = [prompt(rng, rng.randint(lo, hi), vocab) for _ in range(args.streams)]
    prompt_sets = [[prompt(rng, rng.randint(lo, hi), vocab) for _ in range(args.streams)]
                   for _ in range(args.repeats)]
    counts = [int(x) for x in args.replicas.split(",")]
    port = free_port()
    # The replicas are Ray workers: they import this checkout's exlpy, and whatever else PYTHONPATH names (the GPU
    # session's carried packages, Ray itself there); the GPU machine's NCCL settings go with them.
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH"))
                           if p)
    env = {"PYTHONPATH": path, **{k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                             "NVSHMEM_DISABLE_NVLS") if k in os.environ}}
    emit(args, header(args))
    # Ray's memory monitor kills workers when the node's used memory nears its total; the GPU machines' memory
    # reads small at start and grows as it is used, so two replicas' 16 GB of weights in flight could look like
    # a shortage to it. What the replicas need is known here: the monitor is off unless the caller set it.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    t_ray = time.perf_counter()
    gpus = {"num_gpus": len(gpu_names())} if args.gpus_per_replica else {}  # as nvidia-smi sees them
    ray.init(include_dashboard=False, object_store_memory=args.object_store_mb * 2**20,
             runtime_env={"env_vars": env}, **gpus)
    print(f"ray.init: {time.perf_counter() - t_ray:.1f} s; resources {ray.cluster_resources()}", flush=True)
    rows: list[dict[str, Any]] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for n in counts if "scaling" in parts else [max(counts)]:
            t_dep = time.perf_counter()
            url, name = deploy(args, n, port)
            print(f"{n} replica(s) deployed and warm in {time.perf_counter() - t_dep:.0f} s", flush=True)
            if "scaling" in parts:
                if args.warmup:  # the same load, shorter: every prefill and batch shape compiled before timing
                    w, wall = run_load(url, drive(url, name, warm_prompts, min(32, args.max_tokens),
                                                  args.scaling_routing))
                    print(f"warm-up load: {wall:.1f} s, {sum(s.error is not None for s in w)} errors", flush=True)
                for run, prompts in enumerate(prompt_sets, 1):  # fresh prompts: no run hits another's pages
                    load = drive(url, name, prompts, args.max_tokens, args.scaling_routing)
                    (streams, wall), delta = measured(url, load)
                    rows.append({"replicas": n, "run": run, "split": split(delta), **summary(streams, wall)})
                    print(rows[-1], flush=True)
                if n == counts[-1]:
                    emit(args, scaling_table(args, rows))
            if "prefix" in parts and n == max(counts):
                if args.warmup:  # long system prompts' shapes, on system prompts no phase uses
                    rng_w = random.Random(args.seed + 7)
                    warm_systems = [prompt(rng_w, args.system_tokens, vocab) for _ in range(max(system_counts))]
                    w, wall = run_load(url, prefix_load(url, name, warm_systems, args, vocab, "pow2", args.seed + 8,
                                                        1))
                    print(f"warm-up of the routing part: {wall:.1f} s, {sum(s.error is not None for s in w)} errors",
                          flush=True)
                for j, n_systems in enumerate(system_counts):
                    routed = []
                    for i, routing in enumerate(policies):
                        seed = args.seed + 1000 * (j + 1) + 100 * (i + 1)
                        routed.append(prefix_phase(args, url, name, vocab, routing, n_systems, seed))
                        print(routed[-1], flush=True)
                    emit(args, routing_table(args, n, n_systems, routed))
            serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
    emit(args, [f"Run took {time.perf_counter() - t_start:.0f} s (Ray's start and model loads included).", ""])


if __name__ == "__main__":
    main()
