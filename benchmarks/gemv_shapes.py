"""Batch-1 projection shapes of Llama-3-8B: cuBLAS (F.linear, addmm_ into the residual) vs the Triton GEMV.

Each variant is timed as 20 calls captured in one CUDA graph, so launch costs are out of the picture.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from exlpy.kernels.gemv import linear_add  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "1b gate_up": (16384, 2048), "1b down": (2048, 8192)}


def graph_time(fn, reps: int = 20, iters: int = 10) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * iters)


def bench_shape(n: int, k: int) -> tuple[float, float, float]:
    """TB/s of F.linear, addmm_ and the Triton GEMV; 4 weight copies rotate so L2 holds none of them."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for _ in range(4)]
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    r = torch.randn(1, n, device="cuda", dtype=torch.float16)
    it = iter(range(10**9))
    nxt = lambda: ws[next(it) % len(ws)]
    times = (graph_time(lambda: F.linear(x, nxt())), graph_time(lambda: r.addmm_(x, nxt().t())),
             graph_time(lambda: linear_add(x, nxt(), r)))
    return tuple(n * k * 2 / t / 1e12 for t in times)  # type: ignore[return-value]


def main() -> None:
    print("| shape | N×K | F.linear TB/s | addmm_ TB/s | Triton GEMV (+residual) TB/s |")
    print("|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        a, b, c = bench_shape(n, k)
        print(f"| {name} | {n}×{k} | {a:.2f} | {b:.2f} | {c:.2f} |", flush=True)


if __name__ == "__main__":
    main()
