"""Where `exlpy serve` spends its CPU under streaming load: CPU seconds per generated token for each thread of
the server process (from /proc: the event loop's main thread, the `exlpy-generator` bridge thread, torch's
threads), and optionally a yappi profile of every thread (CPU clock) of the same run.

    # per-thread CPU only (no profiler overhead), 3 rounds:
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/serving_profile.py --model exlpy/demo/aidreams260K \\
        --streams 64 --prompts 8,60 --max-tokens 64 --cache-size 16384 --rounds 3
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


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per thread name of a process; threads of one name are summed."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def start(model: str, port: int, cache: int, log: str, prof: str | None) -> subprocess.Popen:
    args = ["serve", "--model", model, "--port", str(port), "--cache-size", str(cache), "--max-queue", "1024",
            "--log-level", "warning"]
    cmd = [sys.executable, __file__, "--_serve", prof or "", "--", *args]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    t0 = time.time()
    while time.time() - t0 < 300:
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

    run = bridge.GeneratorBridge._run

    def named_run(self: bridge.GeneratorBridge) -> None:
        _name_os_thread(b"exlpy-generator")  # so /proc shows the bridge thread apart from the event loop
        run(self)

    bridge.GeneratorBridge._run = named_run  # type: ignore[method-assign]
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


def _name_os_thread(name: bytes) -> None:
    import ctypes

    try:
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME (Linux)
    except (OSError, AttributeError):
        pass


def main() -> None:
    if "--_serve" in sys.argv:
        i = sys.argv.index("--_serve")
        sys.exit(_serve_profiled(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompts", default="8,60")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache-size", type=int, default=16384)
    ap.add_argument("--port", type=int, default=8767)
    ap.add_argument("--rounds", type=int, default=1, help="loads per server (the first one after start-up)")
    ap.add_argument("--yappi", default=None, help="write a per-thread yappi profile (CPU clock) to this file")
    ap.add_argument("--top", type=int, default=20, help="functions per thread to print from the profile")
    args = ap.parse_args()
    from exlpy import ExLlamaV2Config

    lo, hi = (int(x) for x in args.prompts.split(","))
    load = Load(args.streams, (lo, hi), args.max_tokens)
    vocab = ExLlamaV2Config(args.model).vocab_size
    name = os.path.basename(os.path.normpath(args.model))
    proc = start(args.model, args.port, args.cache_size, "/tmp/exlpy_serve_profile.log", args.yappi)
    per_token: list[float] = []
    try:
        for k in range(args.rounds):
            load.seed = k
            before = thread_cpu(proc.pid)
            fig = asyncio.run(_drive_server(args.port, name, load.prompt_ids(vocab), load.max_tokens, vocab,
                                            proc.pid))
            after = thread_cpu(proc.pid)
            ms = {t: (after[t] - before.get(t, 0.0)) * 1e3 / max(fig.tokens, 1) for t in after}
            per_token.append(fig.cpu * 1e3 / max(fig.tokens, 1))
            split = ", ".join(f"{t} {v:.3f}" for t, v in sorted(ms.items(), key=lambda x: -x[1]) if v > 0.0005)
            print(f"round {k}: {fig.line()}\n  CPU ms per token by thread: {split}", flush=True)
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
