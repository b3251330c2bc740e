"""Where `exlpy serve` spends its CPU under streaming load: CPU milliseconds per generated token for each thread
of the server process (from /proc: the event loop's main thread, the `exlpy-generator` bridge thread, the
rest), and optionally a yappi profile of every thread (CPU clock) of the same run.

    # per-thread CPU only (no profiler overhead), 3 rounds:
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/serving_profile.py --model exlpy/demo/aidreams260K \\
        --streams 64 --prompts 8,60 --max-tokens 64 --cache-size 16384 --rounds 3
    # GPU, the issue-29 load on the 8B fp16 model benchmarks/serving.py writes (4 client processes):
    PYTHONPATH=. python benchmarks/serving_profile.py --model /tmp/exlpy_bench/llama3-8b-fp16 --streams 64 \
        --prompts 100,2000 --max-tokens 256 --max-seq-len 20480 --clients 4 --rounds 2
    # plus a yappi profile per thread (pip install yappi), top 25 functions by own time:
    ... --yappi /tmp/serve.prof --top 25

The server runs as a real `exlpy serve` process (uvicorn, the server extra's event loop and HTTP parser); the
load comes from benchmarks/serving_load.py's openai client in this process (its CPU is not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving_load import Load, _drive_server  # noqa: E402


def start(model: str, port: int, cache: int | None, max_seq_len: int | None, log: str, prof: str | None,
          extra: list[str] | None = None) -> subprocess.Popen:
    args = ["serve", "--model", model, "--port", str(port), "--max-queue", "1024", "--log-level", "warning"]
    args += ["--cache-size", str(cache)] if cache else []  # else the server's default (free GPU memory)
    args += ["--max-seq-len", str(max_seq_len)] if max_seq_len else []
    args += extra or []
    cmd = [sys.executable, __file__, "--_serve", prof or "", "--", *args]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    t0 = time.time()
    while time.time() - t0 < 900:  # an 8B model's load and warm-up on a GPU take minutes
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if b'"ok"' in r.read():
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not come up; see {log}")


def _serve_profiled(prof: str, argv: list[str]) -> int:
    """The server process: `exlpy serve` under yappi when `prof` names an output file."""
    import exlpy.server.bridge as bridge
    from exlpy.cli.main import main

    if not prof:
        return main(argv)
    import yappi

    yappi.set_clock_type("cpu")
    started = False

    # Profile only the load: start at the first request after the health check (the driver's warm-up request
    # still counts, it is small).
    submit = bridge.GeneratorBridge.submit

    async def profiled_submit(self: bridge.GeneratorBridge, job: object) -> object:
        nonlocal started
        if not started:
            started = True
            yappi.start(profile_threads=True)
        return await submit(self, job)

    bridge.GeneratorBridge.submit = profiled_submit  # type: ignore[method-assign]
    try:
        return main(argv)
    finally:
        yappi.stop()
        with open(prof, "w") as f:
            for t in yappi.get_thread_stats():
                f.write(f"=== thread {t.name} (id {t.id}): {t.ttot:.3f} s CPU\n")
                stats = yappi.get_func_stats(filter={"ctx_id": t.id})
                stats.sort("tsub", "desc")
                for s in stats:
                    f.write(f"{s.tsub:.4f}\t{s.ttot:.4f}\t{s.ncall}\t{s.module}:{s.lineno} {s.name}\n")


def main() -> None:
    if "--_serve" in sys.argv:
        i = sys.argv.index("--_serve")
        sys.exit(_serve_profiled(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompts", default="8,60")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache-size", type=int, default=None, help="default: the server's own")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--port", type=int, default=8767)
    ap.add_argument("--server-args", default="", help="more `exlpy serve` arguments, e.g. "
                    "\"--max-prefill-per-step 2048\"")
    ap.add_argument("--clients", type=int, default=1, help="client processes sharing the streams")
    ap.add_argument("--rounds", type=int, default=1, help="loads per server (the first one after start-up)")
    ap.add_argument("--yappi", default=None, help="write a per-thread yappi profile (CPU clock) to this file")
    ap.add_argument("--top", type=int, default=20, help="functions per thread to print from the profile")
    args = ap.parse_args()
    from exlpy import ExLlamaV2Config

    lo, hi = (int(x) for x in args.prompts.split(","))
    load = Load(args.streams, (lo, hi), args.max_tokens)
    vocab = ExLlamaV2Config(args.model).vocab_size
    name = os.path.basename(os.path.normpath(args.model))
    proc = start(args.model, args.port, args.cache_size, args.max_seq_len, "/tmp/exlpy_serve_profile.log",
                 args.yappi, args.server_args.split())
    per_token: list[float] = []
    try:
        for k in range(args.rounds):
            load.seed = k
            fig = asyncio.run(_drive_server(args.port, name, load.prompt_ids(vocab), load.max_tokens, vocab,
                                            proc.pid, args.clients))
            per_token.append(fig.cpu * 1e3 / max(fig.tokens, 1))
            print(f"round {k}: {fig.line()}", flush=True)
    finally:
        # uvicorn re-raises the signal it stopped on: SIGINT becomes KeyboardInterrupt, so the profile is written.
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    if len(per_token) > 1:
        print(f"server CPU ms per token: median {statistics.median(per_token):.3f} over {len(per_token)} rounds "
              f"({', '.join(f'{v:.3f}' for v in per_token)})")
    if args.yappi:
        for line in _top(Path(args.yappi).read_text(), args.top):
            print(line)


def _top(text: str, n: int) -> list[str]:
    out, left = [], 0
    for line in text.splitlines():
        if line.startswith("==="):
            out.append(line)
            left = n
        elif left:
            out.append("  " + line)
            left -= 1
    return out


if __name__ == "__main__":
    random.seed(0)
    main()
