"""Which multi-GPU CUDA-graph capture schemes work on this machine (each case in its own process: a failed
capture can abort the process). Prints one line per case; used to pick the TP whole-step capture scheme.

    CUDA_VISIBLE_DEVICES=0,1 python benchmarks/capture_probe.py
"""

from __future__ import annotations

import subprocess
import sys

CASE = r'''
import sys, traceback, torch, torch.cuda.nccl as nccl
case, mode = sys.argv[1], sys.argv[2]
devs = [torch.device("cuda", i) for i in range(2)]
xs = [torch.full((4, 8192), float(i + 1), device=d, dtype=torch.float16) for i, d in enumerate(devs)]
nccl.all_reduce(xs)  # communicators exist before capture
for d in devs: torch.cuda.synchronize(d)
streams = [torch.cuda.Stream(d) for d in devs]
graphs = [torch.cuda.CUDAGraph() for _ in devs]
prev = [torch.cuda.current_stream(d) for d in devs]
try:
    if case in ("two_graphs", "two_graphs_nccl"):
        for g, d, s in zip(graphs, devs, streams):
            with torch.cuda.device(d):
                torch.cuda.set_stream(s)
                g.capture_begin(capture_error_mode=mode)
        for x, d in zip(xs, devs):
            with torch.cuda.device(d):
                x.mul_(2)
        if case == "two_graphs_nccl":
            nccl.all_reduce(xs)
        for x, d in zip(xs, devs):
            with torch.cuda.device(d):
                x.add_(1)
        for g, d in zip(graphs, devs):
            with torch.cuda.device(d):
                g.capture_end()
        for d, p in zip(devs, prev):
            with torch.cuda.device(d):
                torch.cuda.set_stream(p)
        for x in xs: x.fill_(1.0)
        for g, d in zip(graphs, devs):
            with torch.cuda.device(d):
                g.replay()
        for d in devs: torch.cuda.synchronize(d)
        want = 5.0 if case == "two_graphs_nccl" else 3.0
        print("RESULT", case, mode, "ok" if all(float(x[0, 0]) == want for x in xs) else
              f"wrong {[float(x[0, 0]) for x in xs]}", flush=True)
except Exception as e:
    print("RESULT", case, mode, "error", repr(e)[:400], flush=True)
'''


def main() -> None:
    for case in ("two_graphs", "two_graphs_nccl"):
        for mode in ("global", "thread_local", "relaxed"):
            r = subprocess.run([sys.executable, "-c", CASE, case, mode], capture_output=True, text=True, timeout=60)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
            print(lines[0] if lines else f"RESULT {case} {mode} rc={r.returncode} {r.stderr[-600:]}", flush=True)


if __name__ == "__main__":
    main()
