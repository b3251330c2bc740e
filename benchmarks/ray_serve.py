"""Throughput of exlpy on Ray Serve by replica count (issue 36): the same load against 1 and 2 replicas.

    # GPU (a two-GPU kind): two one-GPU replicas of an 8B model against one, 128 streams
    PYTHONPATH=. python benchmarks/ray_serve.py --model /path/to/8b --replicas 1,2 --gpus-per-replica 1 \\
        --streams 128 --prompts 100,2000 --max-tokens 256 --out benchmarks/results/ray_serve.md
    # CPU, scaled down (checks the script, not the scaling: two replicas share 2 cores)
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/ray_serve.py --model exlpy/demo/aidreams260K \\
        --replicas 1,2 --gpus-per-replica 0 --streams 8 --prompts 8,40 --max-tokens 32 --cache-size 4096

Each replica count gets a fresh Serve application on a local Ray (`ray.init` sees the machine's GPUs); the
load is benchmarks/serving_load.py's: `--streams` streamed completions sent at once, random token-id prompts of
random length in `--prompts`, exactly `--max-tokens` tokens each (EOS banned, temperature 0), after one warm-up
request per replica. Reported: total tokens/s over the wall time, TTFT median / p99, inter-token median, errors,
and the speed-up over the first replica count. Routing is Ray Serve's default (power of two choices on ongoing
requests).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving_client import Stream, pct, prompt, stream  # noqa: E402

APP = "exlpy-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def drive(url: str, name: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[Stream], float]:
    import httpx
    import openai

    http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", http_client=http, max_retries=0)
    streams = [Stream() for _ in prompts]
    t0 = time.perf_counter()
    await asyncio.gather(*[stream(client, name, ids, max_tokens, s) for ids, s in zip(prompts, streams)])
    wall = time.perf_counter() - t0
    await http.aclose()
    return streams, wall


def run_replicas(args: argparse.Namespace, replicas: int, port: int, prompts: list[list[int]]) -> dict[str, Any]:
    import httpx
    from ray import serve

    from exlpy.server.ray_app import build_app

    extra = {"cache_size": args.cache_size} if args.cache_size else {}
    if args.max_seq_len:
        extra["max_seq_len"] = args.max_seq_len
    app = build_app(model=args.model, replicas=replicas, gpus_per_replica=args.gpus_per_replica,
                    cpus_per_replica=args.cpus_per_replica, max_ongoing_requests=args.max_ongoing_requests,
                    max_queue=max(64, args.streams), name=APP, **extra)
    serve.run(app, name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    name = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    for _ in range(2 * replicas):  # warm every replica (random routing: a few requests reach them all)
        httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=600)
    streams, wall = asyncio.run(drive(url, name, prompts, args.max_tokens))
    serve.delete(APP)
    ok = [s for s in streams if s.error is None and s.chunks]
    tokens = sum(s.tokens or len(s.chunks) for s in ok)
    gaps = [g for s in ok for g in s.gaps()]
    return {"replicas": replicas, "tok_s": tokens / wall, "ttft_p50": pct([s.ttft for s in ok], 0.5),
            "ttft_p99": pct([s.ttft for s in ok], 0.99), "itl_p50": pct(gaps, 0.5),
            "errors": len(streams) - len(ok), "wall": wall,
            "first_error": next((s.error for s in streams if s.error), None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--replicas", default="1,2", help="replica counts to compare, e.g. 1,2")
    ap.add_argument("--gpus-per-replica", type=float, default=1.0)
    ap.add_argument("--cpus-per-replica", type=float, default=1.0)
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--prompts", default="100,2000", help="prompt length range LO,HI (tokens)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--cache-size", type=int, default=None, help="per replica (default: sized from free memory)")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--max-ongoing-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    args = ap.parse_args()

    import ray
    from ray import serve

    from exlpy.config import ExLlamaV2Config

    vocab = ExLlamaV2Config(args.model).vocab_size
    lo, hi = (int(x) for x in args.prompts.split(","))
    rng = random.Random(args.seed)
    prompts = [prompt(rng, rng.randint(lo, hi), vocab) for _ in range(args.streams)]
    counts = [int(x) for x in args.replicas.split(",")]
    port = free_port()
    repo = str(Path(__file__).resolve().parent.parent)
    ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": repo}})
    rows = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for n in counts:
            rows.append(run_replicas(args, n, port, prompts))
            print(rows[-1], flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    base = rows[0]["tok_s"]
    lines = [f"Ray Serve, {Path(args.model).name}: {args.streams} streams, prompts {lo}-{hi} tokens, "
             f"{args.max_tokens} tokens each, {args.gpus_per_replica:g} GPU(s) per replica, power-of-two routing",
             "", "| replicas | tokens/s | speed-up | TTFT p50 (s) | TTFT p99 (s) | inter-token p50 (ms) | errors |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['replicas']} | {r['tok_s']:.0f} | {r['tok_s'] / base:.2f}x | {r['ttft_p50']:.3f} | "
                     f"{r['ttft_p99']:.3f} | {1000 * r['itl_p50']:.1f} | {r['errors']} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
