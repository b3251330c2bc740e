"""The tensor-parallel benchmark's GEMM check: cuBLAS on the 70B layer's shapes, whole and as one TP x2 rank
holds them."""

from __future__ import annotations

import time

import torch


def gemm_shapes(results: dict, rows: int = 32) -> None:
    """cuBLAS at batched decode: GB/s of the 70B layer's GEMMs at `rows` rows, whole (one GPU) and as one TP x2
    rank holds them (q|k|v and gate|up with N halved, o_proj and down_proj with K halved), each timed over
    50 calls in a CUDA graph; the one-row GEMV kernel (ops.linear_add) beside them. Says whether the halved
    shapes lose efficiency (a TP rank's share of the step's matmul time then exceeds half)."""
    from exlpy.kernels import ops

    shapes = {"qkv": (10240, 8192), "gate_up": (57344, 8192), "o": (8192, 8192), "down": (8192, 28672)}
    out: dict = {}
    dev = torch.device("cuda", 0)
    for name, (N, K) in shapes.items():
        for tag, (n, k) in (("full", (N, K)), ("rank", (N // 2, K) if name in ("qkv", "gate_up") else (N, K // 2))):
            w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.01
            for r in (rows, 1):
                x = torch.randn(r, k, device=dev, dtype=torch.float16)
                fn = (lambda x=x, w=w: torch.nn.functional.linear(x, w)) if r > 1 else \
                    (lambda x=x, w=w: ops.linear_add(x, w))
                fn()
                torch.cuda.synchronize(dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(50):
                        fn()
                g.replay()
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                g.replay()
                torch.cuda.synchronize(dev)
                us = (time.perf_counter() - t0) / 50 * 1e6
                out[f"{name}_{tag}_m{r}"] = {"us": round(us, 1), "GBps": round(w.nbytes / us / 1e3, 0)}
            del w
    results["gemm_shapes"] = out
