"""Batch-1 decode fusions at Llama-3-8B shapes: unfused vs fused ops, each timed inside a CUDA graph.

apply_rope + store_kv vs rope_store_kv, and norm_linear(gate|up) + silu_mul vs norm_linear_swiglu; prints
microseconds per call and the largest error of the fused result against the unfused one.
Run on a GPU: `PYTHONPATH=. python benchmarks/decode_fusions.py`.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gemv_shapes import graph_time  # noqa: E402
from exlpy.kernels.activation import silu_mul  # noqa: E402
from exlpy.kernels.gemv import norm_linear, norm_linear_swiglu  # noqa: E402
from exlpy.kernels.kv_store import store_kv  # noqa: E402
from exlpy.kernels.rope import apply_rope, rope_store_kv  # noqa: E402


def rope_case() -> None:
    dev, dt, hq, hk, d = "cuda", torch.float16, 32, 8, 128
    qkv = torch.randn(1, 1, (hq + 2 * hk) * d, device=dev, dtype=dt)
    q = qkv[..., :hq * d].view(1, 1, hq, d)
    k = qkv[..., hq * d:(hq + hk) * d].view(1, 1, hk, d)
    v = qkv[..., (hq + hk) * d:].view(1, 1, hk, d)
    # Real rotations (|cos|, |sin| <= 1): the timing loops rotate q and k in place hundreds of times.
    ang = torch.rand(8192, d // 2, device=dev) * 6.28
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)
    pos = torch.tensor([[1234]], device=dev)
    slots = torch.tensor([[1234]], device=dev)
    kc, vc = torch.zeros(1, 8192, hk, d, device=dev, dtype=dt), torch.zeros(1, 8192, hk, d, device=dev, dtype=dt)

    def unfused() -> None:
        q2, k2 = apply_rope(q, k, cos, sin, pos)
        store_kv(kc, vc, slots, k2, v)

    base = qkv.clone()
    t0 = graph_time(unfused)
    t1 = graph_time(lambda: rope_store_kv(q, k, v, cos, sin, pos, kc, vc, slots))
    # Same input for both results: rope rotates in place, so start each from the saved copy.
    qkv.copy_(base)
    unfused()
    ref_q, ref_k = q.clone(), kc[0, 1234].clone()
    qkv.copy_(base)
    rope_store_kv(q, k, v, cos, sin, pos, kc, vc, slots)
    err = max((q - ref_q).abs().max().item(), (kc[0, 1234] - ref_k).abs().max().item())
    print(f"rope+store_kv: unfused {t0 * 1e6:.2f} us, fused {t1 * 1e6:.2f} us, max abs diff {err:.3g}")


def swiglu_case() -> None:
    dev, dt, hidden, inter = "cuda", torch.float16, 4096, 14336
    ws = [torch.randn(2 * inter, hidden, device=dev, dtype=dt) * 0.02 for _ in range(4)]  # L2 holds none
    x = torch.randn(1, 1, hidden, device=dev, dtype=dt)
    nw = torch.rand(hidden, device=dev, dtype=dt) + 0.5
    it = iter(range(10**9))
    nxt = lambda: ws[next(it) % len(ws)]

    def unfused(w: torch.Tensor) -> torch.Tensor:
        g, u = norm_linear(x, nw, 1e-5, w).chunk(2, dim=-1)
        return silu_mul(g, u)

    t0 = graph_time(lambda: unfused(nxt()))
    t1 = graph_time(lambda: norm_linear_swiglu(x, nw, 1e-5, nxt()))
    err = (norm_linear_swiglu(x, nw, 1e-5, ws[0]) - unfused(ws[0])).abs().max().item()
    tb = 2 * inter * hidden * 2 / t1 / 1e12
    print(f"gate|up+silu_mul: unfused {t0 * 1e6:.2f} us, fused {t1 * 1e6:.2f} us ({tb:.2f} TB/s), "
          f"max abs diff {err:.3g}")


if __name__ == "__main__":
    rope_case()
    swiglu_case()
