"""Time of the fused sampling kernel (exlpy/kernels/sample_top.py) on a Llama-3 vocabulary against the torch
reference on the same GPU (the host chain's sort of the whole vocabulary), and whether their tokens agree.

    PYTHONPATH=. python benchmarks/sample_top_speed.py            (GPU, ~1 min)

Rows of 128,256 logits at batch 1 and 64: "peaked" (randn * 4: ~8,600 tokens above
1e-6) and "flat" (randn: ~120k of them, the whole-vocabulary kernel's worst case), each under top-p 0.9 over the
whole vocabulary (top_k 0, what the OpenAI server sends) and min-p 0.02, host points r. Prints per setting the
kernel's and the reference's milliseconds per call (CUDA events, median of 20 after 3 warm-up calls) and how many
tokens equal the reference's (all, except where a point lies within fp32 error of a boundary).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exlpy.kernels import reference  # noqa: E402
from exlpy.kernels.sample_top import sample_top  # noqa: E402

V = 128256
K_MAX = 128


def timed(fn, *args, reps: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    g = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, vocabulary {V}")
    print(f"{'setting':28s} {'batch':>5s} {'kernel ms':>10s} {'torch ms':>10s} {'same tokens':>12s}")
    for shape, scale in (("peaked", 4.0), ("flat", 1.0)):
        for name, top_p, min_p in (("top-p 0.9", 0.9, 0.0), ("min-p 0.02", 2.0, 0.02)):
            for batch in (1, 64):
                x = (torch.randn(batch, V, generator=g) * scale).cuda()
                points = torch.rand(batch, generator=g)
                params = torch.tensor([[1.0, float(V), top_p, 0.0, min_p, 1.0, float(r)] for r in points]).cuda()
                rng = torch.zeros(batch, 2, dtype=torch.int64).cuda()
                tok, _ = sample_top(x, params, rng, K_MAX)
                ref, _ = reference.sample_top(x, params, rng, K_MAX)
                same = int((tok == ref).sum())
                k_ms = timed(sample_top, x, params, rng, K_MAX)
                t_ms = timed(reference.sample_top, x, params, rng, K_MAX)
                print(f"{shape + ' ' + name:28s} {batch:5d} {k_ms:10.3f} {t_ms:10.3f} {same:>7d}/{batch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
