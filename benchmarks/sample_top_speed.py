"""Time of the fused sampling kernel (exlpy/kernels/sample_top.py) on a Llama-3 vocabulary against the torch
reference on the same GPU (the host chain's sort of the whole vocabulary), and whether their tokens agree.

    PYTHONPATH=. python benchmarks/sample_top_speed.py            (GPU, ~1 min)

Rows of 128,256 logits at batch 1 and 64: "peaked" (randn * 4: ~8,600 tokens above
1e-6) and "flat" (randn: ~120k of them, the whole-vocabulary kernel's worst case), each under top-p 0.9 over the
whole vocabulary (top_k 0, what the OpenAI server sends) and min-p 0.02, host points r. Prints per setting the
kernel's milliseconds per call replayed in a CUDA graph (as the captured sampler runs it: no launch overhead) and
launched eagerly, the reference's (torch's sort of the whole vocabulary, eager), all CUDA events, median of 20
after 3 warm-up calls; then how the kernel's tokens compare: rows past the candidates draw the reference
distribution in vocabulary order (kernels/sample_whole.py), so "same dist" counts tokens equal to that draw at
the row's point, or to the reference's own token for rows within the K_MAX candidates (all, except where a
point lies within fp32 error of a boundary), and "survivors" is the reference's survivors per row (mean).
Targets (issue 30, H100, flat rows): graph <= 0.15 ms at batch 1, <= 0.6 ms at 64.
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


def graphed(fn, *args):
    """fn(*args) captured once in a CUDA graph: the replay, for `timed`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args)
    return g.replay


def id_order(x: torch.Tensor, params: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the vocabulary-order token of the reference distribution at r, the survivors per row)."""
    _, _, q, ids = reference.sorted_draw(x, params, r)
    final = torch.zeros_like(q).scatter_(1, ids, q / q.sum(-1, keepdim=True))
    cum = final.double().cumsum(-1)
    tok = (cum <= r.double().view(-1, 1) * cum[:, -1:]).sum(-1)
    last = torch.where(final > 0, torch.arange(x.shape[1], device=x.device), 0).amax(-1)
    return torch.minimum(tok, last), (final > 0).sum(-1)


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    g = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, vocabulary {V}")
    print(f"{'setting':28s} {'batch':>5s} {'graph ms':>9s} {'eager ms':>9s} {'torch ms':>9s} {'same dist':>10s} "
          f"{'survivors':>10s}")
    for shape, scale in (("peaked", 4.0), ("flat", 1.0)):
        for name, top_p, min_p in (("top-p 0.9", 0.9, 0.0), ("min-p 0.02", 2.0, 0.02)):
            for batch in (1, 64):
                x = (torch.randn(batch, V, generator=g) * scale).cuda()
                points = torch.rand(batch, generator=g)
                params = torch.tensor([[1.0, float(V), top_p, 0.0, min_p, 1.0, float(r)] for r in points]).cuda()
                rng = torch.zeros(batch, 2, dtype=torch.int64).cuda()
                tok, _ = sample_top(x, params, rng, K_MAX)
                want, survivors = id_order(x, params, points.cuda())
                ref, _ = reference.sample_top(x, params, rng, K_MAX)
                want = torch.where(survivors > K_MAX, want, ref)  # within the candidates: descending order
                same = int((tok == want).sum())
                g_ms = timed(graphed(sample_top, x, params, rng, K_MAX))
                k_ms = timed(sample_top, x, params, rng, K_MAX)
                t_ms = timed(reference.sample_top, x, params, rng, K_MAX)
                print(f"{shape + ' ' + name:28s} {batch:5d} {g_ms:9.3f} {k_ms:9.3f} {t_ms:9.3f} {same:>6d}/{batch:<3d} "
                      f"{float(survivors.float().mean()):10.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
