"""exlpy on Ray Serve (issue 36): throughput by replica count, and prefix routing against power of two choices.

    # GPU, two GPUs, under 4 minutes with Ray's start (`bash benchmarks/gpu_session.sh ray` runs this): a tiny EXL2
    # model, 1 and 2 one-GPU replicas, then both routings on the 2 replicas
    PYTHONPATH=. python benchmarks/ray_serve.py --model ../shared/models/tiny-llama-exl2-4.0 --quick \
        --out benchmarks/results/ray_serve.md
    # GPU, the issue's figures: an 8B model, 128 streams, a 2,000-token shared system prompt
    PYTHONPATH=. python benchmarks/ray_serve.py --model /path/to/8b --replicas 1,2 --streams 128 \
        --prompts 100,2000 --max-tokens 256 --system-tokens 2000 --out benchmarks/results/ray_serve.md
    # CPU, scaled down (checks the script, not the speed: two replicas share the cores)
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/ray_serve.py --model exlpy/demo/aidreams260K \
        --gpus-per-replica 0 --streams 8 --prompts 8,40 --max-tokens 32 --cache-size 8192 --max-seq-len 1024 \
        --system-tokens 300 --user-tokens 10,30 --systems 4 --clients 4 --requests-per-client 4 --prefix-max-tokens 4

Part `scaling`: each replica count gets a fresh Serve application on a local Ray (`ray.init` sees the machine's
GPUs); the load is benchmarks/serving_load.py's: `--streams` streamed completions sent at once, random token-id
prompts of random length in `--prompts`, exactly `--max-tokens` tokens each (EOS banned, temperature 0), after
one warm-up request per replica. Reported: total tokens/s over the wall time, TTFT median / p99, inter-token
median, errors, and the speed-up over the first replica count. Routing: power of two choices.

Part `prefix` (on the largest replica count's application, after its scaling run): `--systems` system prompts of
`--system-tokens` random token ids, `--clients` clients each sending `--requests-per-client` streamed requests one
after the other, each a random system prompt plus a random user part of `--user-tokens` tokens, `--prefix-max-tokens`
tokens out. The same workload (fresh system prompts, so no phase finds the other's pages) runs once per routing
policy, chosen per request by the `x-exlpy-routing` header: `pow2` (Ray's default: power of two choices) and
`prefix` (exlpy's prefix affinity, ray_router.py). Reported per policy: the prefix cache hit rate (prompt tokens
found cached / looked up, from the ingress's `/metrics` summed over replicas), TTFT median / p99, tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving_client import Stream, pct, prompt, stream  # noqa: E402

APP = "exlpy-bench"
QUICK = {"replicas": "1,2", "streams": 64, "prompts": "100,1000", "max_tokens": 128, "system_tokens": 2000,
         "user_tokens": "50,200", "systems": 8, "clients": 32, "requests_per_client": 4, "prefix_max_tokens": 32}


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


async def drive(url: str, name: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[Stream], float]:
    http, c = client(url)
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
    for i in range(4 * replicas):  # warm every replica (routing keys of our own reach them all)
        httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=600,
                   headers={"x-exlpy-routing": "prefix", "x-exlpy-routing-key": f"warm{i}"})
    return url, name


def metrics(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for smp in fam.samples:
            out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out


async def prefix_load(url: str, name: str, systems: list[list[int]], args: argparse.Namespace, vocab: int,
                      routing: str, seed: int) -> tuple[list[Stream], float]:
    """`clients` closed-loop clients, each sending requests one after the other: a random system prompt and a
    random user part."""
    http, c = client(url, routing)
    rng = random.Random(seed)
    lo, hi = (int(x) for x in args.user_tokens.split(","))
    plans = [[systems[rng.randrange(len(systems))] + prompt(rng, rng.randint(lo, hi), vocab)
              for _ in range(args.requests_per_client)] for _ in range(args.clients)]
    streams: list[Stream] = []

    async def one_client(prompts: list[list[int]]) -> None:
        for ids in prompts:
            streams.append(await stream(c, name, ids, args.prefix_max_tokens, Stream()))

    t0 = time.perf_counter()
    await asyncio.gather(*[one_client(p) for p in plans])
    wall = time.perf_counter() - t0
    await http.aclose()
    return streams, wall


def prefix_phase(args: argparse.Namespace, url: str, name: str, vocab: int, routing: str,
                 seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    systems = [prompt(rng, args.system_tokens, vocab) for _ in range(args.systems)]
    before = metrics(url)
    streams, wall = asyncio.run(prefix_load(url, name, systems, args, vocab, routing, seed + 1))
    done = before.get("exlpy:request_success_total", 0.0) + len(streams)
    after = metrics(url)
    end = time.monotonic() + 30
    while after.get("exlpy:request_success_total", 0.0) < done and time.monotonic() < end:
        time.sleep(0.5)  # the replicas' metrics reach the ingress every stats period
        after = metrics(url)
    hits = after.get("exlpy:prefix_cache_hits_total", 0.0) - before.get("exlpy:prefix_cache_hits_total", 0.0)
    queries = after.get("exlpy:prefix_cache_queries_total", 0.0) - before.get("exlpy:prefix_cache_queries_total",
                                                                             0.0)
    return {"routing": routing, "hit_rate": hits / queries if queries else float("nan"),
            "requests": len(streams), **summary(streams, wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--parts", default="scaling,prefix")
    ap.add_argument("--quick", action="store_true", help="the preset of the 4-minute GPU run: " + str(QUICK))
    ap.add_argument("--replicas", default="1,2", help="replica counts to compare, e.g. 1,2")
    ap.add_argument("--gpus-per-replica", type=float, default=1.0)
    ap.add_argument("--cpus-per-replica", type=float, default=1.0)
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--prompts", default="100,2000", help="prompt length range LO,HI (tokens)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--user-tokens", default="50,200", help="user part length range LO,HI (tokens)")
    ap.add_argument("--systems", type=int, default=8, help="distinct system prompts per routing phase")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--prefix-max-tokens", type=int, default=64)
    ap.add_argument("--cache-size", type=int, default=None, help="per replica (default: sized from free memory)")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--max-ongoing-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append the tables to this markdown file")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    parts = set(args.parts.split(","))

    import ray
    from ray import serve

    from exlpy.config import ExLlamaV2Config

    t_start = time.perf_counter()
    vocab = ExLlamaV2Config(args.model).vocab_size
    lo, hi = (int(x) for x in args.prompts.split(","))
    rng = random.Random(args.seed)
    prompts = [prompt(rng, rng.randint(lo, hi), vocab) for _ in range(args.streams)]
    counts = [int(x) for x in args.replicas.split(",")]
    port = free_port()
    # The replicas are Ray workers: they import this checkout's exlpy, and whatever else PYTHONPATH names (the GPU
    # session's carried packages).
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH"))
                           if p)
    ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    rows: list[dict[str, Any]] = []
    routed: list[dict[str, Any]] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for n in counts if "scaling" in parts else [max(counts)]:
            url, name = deploy(args, n, port)
            if "scaling" in parts:
                rows.append({"replicas": n, **summary(*asyncio.run(drive(url, name, prompts, args.max_tokens)))})
                print(rows[-1], flush=True)
            if "prefix" in parts and n == max(counts):
                for i, routing in enumerate(("pow2", "prefix")):
                    routed.append(prefix_phase(args, url, name, vocab, routing, args.seed + 100 * (i + 1)))
                    print(routed[-1], flush=True)
            serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
    gpu = f"{args.gpus_per_replica:g} GPU(s) per replica"
    lines = [f"Ray Serve, {Path(args.model).name}, {gpu}; run took {time.perf_counter() - t_start:.0f} s "
             "(Ray's start and model loads included)", ""]
    if rows:
        base = rows[0]["tok_s"]
        lines += [f"Scaling: {args.streams} streams at once, prompts {lo}-{hi} tokens, {args.max_tokens} tokens "
                  "each, power-of-two routing", "",
                  "| replicas | tokens/s | speed-up | TTFT p50 (s) | TTFT p99 (s) | inter-token p50 (ms) | errors |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['replicas']} | {r['tok_s']:.0f} | {r['tok_s'] / base:.2f}x | {r['ttft_p50']:.3f} | "
                         f"{r['ttft_p99']:.3f} | {1000 * r['itl_p50']:.1f} | {r['errors']} |")
        lines.append("")
    if routed:
        ulo, uhi = args.user_tokens.split(",")
        lines += [f"Routing, {max(counts)} replicas: {args.systems} system prompts of {args.system_tokens} tokens, "
                  f"{args.clients} clients x {args.requests_per_client} requests (system prompt + {ulo}-{uhi} "
                  f"user tokens), {args.prefix_max_tokens} tokens out", "",
                  "| routing | prefix cache hit rate | TTFT p50 (s) | TTFT p99 (s) | tokens/s | errors |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in routed:
            lines.append(f"| {r['routing']} | {r['hit_rate']:.1%} | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | "
                         f"{r['tok_s']:.0f} | {r['errors']} |")
        if len(routed) == 2 and routed[0]["ttft_p50"] > 0:
            pw, px = routed
            ratio = px["ttft_p50"] / pw["ttft_p50"]
            lines += ["", f"Prefix routing against power of two choices: TTFT p50 {ratio:.2f}x, "
                          f"hit rate {px['hit_rate']:.1%} vs {pw['hit_rate']:.1%}."]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
