"""What Ray Serve's path costs per token (issue 36's GPU cap): the same streamed load against `exlpy serve` and
against one replica of exlpy on Ray Serve (exlpy/server/ray_app.py), same model, same client, on CPU.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/ray_overhead.py --streams 64 --max-tokens 128

Reported per run: tokens/s, TTFT p50, inter-token p50 (between SSE events with text, as benchmarks/ray_serve.py
measures it: ~0 inside a message carrying several tokens), per-stream ms/token p50 (a stream's time from its first
to its last token / its tokens - 1), tokens per burst (SSE events reaching the client less than 1 ms apart count
as one burst: about the tokens per message), and the CPU time each process spent per generated token (from
/proc, over the load only): the `exlpy serve` process; under Ray the engine replica, the ingress replica and Ray's
HTTP proxy. The CPU milliseconds per token of the busiest single-threaded relay bound the throughput of the whole
path: 1,000 / (ms per token) tokens per second, whatever the GPU does, which is what capped the 8B GPU run at
~2,000 tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ray_serve import drive, free_port, summary  # noqa: E402
from benchmarks.serving_client import prompt, start_server  # noqa: E402

APP = "exlpy-overhead"
DEMO = str(Path(__file__).resolve().parent.parent / "exlpy" / "demo" / "aidreams260K")


def cpu_s(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        try:
            t = p.cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            out[name] = float("nan")
    return out


def ray_processes() -> dict[str, psutil.Process]:
    """Ray's processes of the application by role, found by their process titles."""
    roles = {f"ServeReplica:{APP}:{APP}-ingress": "ingress", f"ServeReplica:{APP}:{APP}": "replica",
             "ProxyActor": "proxy"}
    found: dict[str, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        for title, role in roles.items():  # the ingress's title contains the replica's: test it first
            if f"ray::{title}" in line and role not in found:
                found[role] = p
                break
    return found


def measure(url: str, name: str, prompts: list[list[int]], max_tokens: int,
            procs: dict[str, psutil.Process]) -> dict[str, Any]:
    before = cpu_s(procs)
    streams, wall = asyncio.run(drive(url, name, prompts, max_tokens))
    after = cpu_s(procs)
    row = summary(streams, wall)
    tokens = row["tok_s"] * wall
    row["cpu_ms_per_token"] = {k: 1000 * (after[k] - before[k]) / max(tokens, 1) for k in procs}
    # SSE events that reached the client together came in one message (gaps under a millisecond)
    msgs = sum(1 + sum(g > 1e-3 for g in st.gaps()) for st in streams if st.chunks)
    row["tok_per_msg"] = tokens / max(msgs, 1)
    row["cpu_util"] = {k: (after[k] - before[k]) / wall for k in procs}
    return row


def fmt(label: str, r: dict[str, Any]) -> str:
    cpu = ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_per_token"].items())
    util = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["cpu_util"].items())
    return (f"| {label} | {r['tok_s']:.0f} | {r['ttft_p50']:.3f} | {1000 * r['itl_p50']:.1f} | "
            f"{1000 * r['tpot_p50']:.1f} | {r['tok_per_msg']:.1f} | {cpu} | {util} | {r['errors']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEMO)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompts", default="8,40")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cache-size", type=int, default=32768)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--modes", default="direct,ray")
    ap.add_argument("--messages-per-s", default="0,default",
                    help="the app's stream_messages_per_s, one Ray deployment each (0: a message per token; "
                         "default: the app's default)")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    args = ap.parse_args()
    from exlpy.config import ExLlamaV2Config

    vocab = ExLlamaV2Config(args.model).vocab_size
    lo, hi = (int(x) for x in args.prompts.split(","))
    rng = random.Random(0)
    sets = [[prompt(rng, rng.randint(lo, hi), vocab) for _ in range(args.streams)] for _ in range(args.repeats + 1)]
    rows: list[str] = []
    modes = args.modes.split(",")
    if "direct" in modes:
        port = free_port()
        proc = start_server(args.model, port, args.cache_size, args.max_seq_len, "/tmp/ray_overhead_direct.log",
                            ["--max-batch-size", str(args.streams)])
        try:
            url = f"http://127.0.0.1:{port}"
            import httpx

            name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            procs = {"serve": psutil.Process(proc.pid)}
            measure(url, name, sets[0], 16, procs)  # warm-up
            for i in range(args.repeats):
                r = measure(url, name, sets[i + 1], args.max_tokens, procs)
                rows.append(fmt("exlpy serve", r))
                print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait()
    if "ray" in modes:
        import httpx
        import ray
        from ray import serve

        from exlpy.server.ray_app import build_app

        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        repo = str(Path(__file__).resolve().parent.parent)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                     p for p in (repo, os.environ.get("PYTHONPATH")) if p)}})
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            for rate in args.messages_per_s.split(","):
                given = {} if rate == "default" else {"stream_messages_per_s": float(rate)}
                serve.run(build_app(model=args.model, replicas=1, gpus_per_replica=0, cpus_per_replica=1,
                                    max_ongoing_requests=256, max_queue=max(64, args.streams), name=APP,
                                    cache_size=args.cache_size, max_seq_len=args.max_seq_len,
                                    max_batch_size=args.streams, **given),
                          name=APP, route_prefix="/")
                url = f"http://127.0.0.1:{port}"
                name = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
                procs = ray_processes()
                print("ray processes:", {k: p.pid for k, p in procs.items()}, flush=True)
                measure(url, name, sets[0], 16, procs)
                for i in range(args.repeats):
                    r = measure(url, name, sets[i + 1], args.max_tokens, procs)
                    rows.append(fmt(f"Ray Serve, 1 replica, stream_messages_per_s={rate}", r))
                    print(rows[-1], flush=True)
                serve.delete(APP)
        finally:
            serve.shutdown()
            ray.shutdown()
    table = ["| path | tokens/s | TTFT p50 (s) | inter-token p50 (ms) | per-stream ms/token p50 "
             "| tokens per burst | CPU ms per token | CPU use | errors |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|", *rows]
    print("\n".join(table))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(table) + "\n\n")


if __name__ == "__main__":
    main()
