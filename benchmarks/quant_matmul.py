"""Quantized matmul on the GPU: correctness at real shapes, block-size sweep, decode GB/s, prefill TFLOP/s.

Run on a CUDA machine from the repo root:  PYTHONPATH=. python benchmarks/quant_matmul.py --out results.md
Decode timings are CUDA-graph replays over rotating copies of the weights (total > L2), so launch overhead and
cache hits are both excluded; bandwidth counts packed bytes read (q_weight, scales, scale max, perm).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch

from exlpy.kernels import exl2_gemv as kg
from exlpy.kernels import exl2_matmul as km
from exlpy.quant.exl2_ref import build_exl2_matrix, dequant_dense
from exlpy.quant.gptq_ref import build_gptq_matrix
from exlpy.quant.layout import QuantMatrix
from exlpy.quant.pack import exl2_group_plan, quantize_gptq, random_exl2

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)]
PLANS = {  # bpw -> (bits, proportion, group size), like the converter's layouts
    2.5: [(3, 0.5, 128), (2, 0.5, 128)],
    4.0: [(4, 1.0, 128)],
    6.0: [(6, 1.0, 128)],
    8.0: [(8, 1.0, 128)],
}


def random_matrix(k: int, n: int, bpw: float, dev: torch.device) -> QuantMatrix:
    """Random packed EXL2 matrix built directly on the GPU (every bit pattern is a valid code)."""
    groups = exl2_group_plan(k, PLANS[bpw])
    words, q_groups = 0, []
    for bits, rows in groups:
        q_groups += [bits, words]
        words += (rows * bits + 31) // 32
    qw = torch.randint(-2**31, 2**31 - 1, (words, n), dtype=torch.int32, device=dev)
    g = len(groups)
    qs = torch.randint(-2**31, 2**31 - 1, (g, n // 8), dtype=torch.int32)
    smax = (torch.rand(g) * 0.01 + 0.002).half()
    inv = torch.randperm(k).to(torch.int32)
    qm = build_exl2_matrix(qw, inv, qs, smax, torch.tensor(q_groups, dtype=torch.int16), k, n, "bench")
    return qm.to(dev)


def graph_time(fn, reps: int = 20) -> float:
    """Median seconds of one call of fn, from CUDA-graph replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def copy_bandwidth(dev: torch.device) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    t = graph_time(lambda: b.copy_(a))
    return 2 * a.numel() / t


def decode_mats(k: int, n: int, bpw: float, dev: torch.device) -> list[QuantMatrix]:
    """Rotating copies of one random matrix, > 400 MB together (L2 is 50 MB): every call streams from HBM."""
    base = random_matrix(k, n, bpw, dev)
    copies = max(1, min(32, (400 << 20) // base.nbytes()))
    return [base] + [_clone(base) for _ in range(copies - 1)]


def decode_bw(k: int, n: int, bpw: float, dev: torch.device, mats: list[QuantMatrix] | None = None) -> float:
    """GB/s of packed bytes (q_weight, scales, scale max, perm) for single-row matmuls, CUDA-graph replays."""
    mats = mats or decode_mats(k, n, bpw, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.float16)
    t = graph_time(lambda: [km.exl2_matmul(x, m) for m in mats]) / len(mats)
    return mats[0].nbytes() / t


def _clone(qm: QuantMatrix) -> QuantMatrix:
    from dataclasses import replace

    return replace(qm, q_weight=qm.q_weight.clone(), scales=qm.scales.clone())


def prefill(k: int, n: int, bpw: float, dev: torch.device) -> tuple[float, float]:
    qm = random_matrix(k, n, bpw, dev)
    x = torch.randn(2048, k, device=dev, dtype=torch.float16)
    w = torch.randn(k, n, device=dev, dtype=torch.float16)
    from triton.testing import do_bench

    tq = do_bench(lambda: km.exl2_matmul(x, qm), return_mode="median") / 1e3
    td = do_bench(lambda: x @ w, return_mode="median") / 1e3
    fl = 2 * 2048 * k * n
    return fl / tq / 1e12, fl / td / 1e12


def check(dev: torch.device, log: list[str]) -> bool:
    """Kernels vs the torch reference at real shapes, every bit width and row count regime, EXL2 and GPTQ."""
    gen = torch.Generator().manual_seed(0)
    ok = True
    cases = [(4096, 4096, [(8, 128), (6, 128)] + [(5, 128)] * 2 + [(4, 128)] * 12 + [(3, 128)] * 8 + [(2, 128)] * 8),
             (576, 1544, [(4, 128)] * 4 + [(4, 64)]), (1536, 576, [(6, 32)] * 8 + [(3, 64)] * 20)]
    for k, n, groups in cases:
        t = random_exl2(k, n, groups, gen)
        qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], k, n,
                               "check")
        w = dequant_dense(qm).to(dev)
        qg = qm.to(dev)
        for m in (1, 3, 17, 32, 33, 300):
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            ref = x.float() @ w
            err = ((km.exl2_matmul(x, qg).float() - ref).abs().max() / ref.abs().max()).item()
            ok &= err < 2e-3
            log.append(f"check exl2 K={k} N={n} M={m}: rel err {err:.2e}")
    for act, v2 in ((False, False), (True, True)):
        wf = torch.randn(4096, 1024, generator=gen) * 0.02
        t, dq = quantize_gptq(wf, 128, gen, act, v2)
        qm = build_gptq_matrix(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), 4096, 1024, "check", v2)
        for m in (1, 8, 256):
            x = torch.randn(m, 4096, device=dev, dtype=torch.float16)
            ref = x.float() @ dq.to(dev)
            err = ((km.exl2_matmul(x, qm.to(dev)).float() - ref).abs().max() / ref.abs().max()).item()
            ok &= err < 2e-3
            log.append(f"check gptq act_order={act} v2={v2} M={m}: rel err {err:.2e}")
    return ok


def check_gemv(dev: torch.device, log: list[str], only: tuple[int, ...] | None = None) -> bool:
    """The decode kernel at real shapes: every width, mixed, odd N, partial last group, both x-gather modes,
    bias, repeated calls (self-cleaning workspace) and CUDA-graph replay against eager."""
    gen = torch.Generator().manual_seed(1)
    ok = True
    cases = [(4096, 4096, [(b, 128)] * 32) for b in (4, 8, 6, 5, 3, 2)]
    cases += [(4096, 1000, [(8, 128), (6, 128)] + [(5, 128)] * 2 + [(4, 128)] * 12 + [(3, 128)] * 8
               + [(2, 128)] * 8), (3990, 4097, [(4, 128)] * 31 + [(4, 22)]),
              (4086, 1001, [(3, 128)] * 31 + [(3, 118)]), (4096, 14336, [(4, 128)] * 32)]
    for ci, (k, n, groups) in enumerate(cases):
        if only is not None and ci not in only:
            continue
        t = random_exl2(k, n, groups, gen)
        qm = build_exl2_matrix(t["q_weight"], t["q_invperm"], t["q_scale"], t["q_scale_max"], t["q_groups"], k, n,
                               "gemv")
        assert kg.supports(qm)
        w = dequant_dense(qm).to(dev)
        qg = qm.to(dev)
        bias = torch.randn(n, device=dev, dtype=torch.float16)
        x = torch.randn(1, k, device=dev, dtype=torch.float16)
        ref = x.float() @ w + bias.float()
        errs = [((km.exl2_matmul(x, qg, bias).float() - ref).abs().max() / ref.abs().max()).item()
                for _ in range(3)]
        ok &= max(errs) < 2e-3
        log.append(f"check gemv K={k} N={n} bits={sorted({b for b, _ in groups})}: rel err {max(errs):.2e} "
                   "over 3 calls")
    y_eager = km.exl2_matmul(x, qg, bias)
    g = torch.cuda.CUDAGraph()
    km.exl2_matmul(x, qg, bias)
    with torch.cuda.graph(g):
        y_graph = km.exl2_matmul(x, qg, bias)
    x.copy_(torch.randn_like(x))
    g.replay()
    ref = x.float() @ w + bias.float()
    err = ((y_graph.float() - ref).abs().max() / ref.abs().max()).item()
    ok &= err < 2e-3 and not torch.equal(y_graph, y_eager)
    log.append(f"check gemv CUDA graph replay with new x: rel err {err:.2e}")
    return ok


TUNE = [  # decode-kernel configs tried on 4.0 bpw (session 1: XPRE 1 + MAXNREG 96 won; the in-loop gather is gone)
    {}, {"MAXNREG": 80, "WORDS": 8}, {"BLOCK_N": 256}, {"WAVES": 8}, {"MAXNREG": 128}, {"WAVES": 2},
]


def tune(dev: torch.device, log: list[str], quick: bool = False) -> None:
    """Time the TUNE configs of the decode kernel (kg.CONFIG) on 4.0 bpw, keep the best."""
    shapes = {(k, n): decode_mats(k, n, 4.0, dev) for k, n in ((4096, 14336), (14336, 4096))}
    base = dict(kg.CONFIG)
    best = None
    for delta in TUNE[:4] if quick else TUNE:
        kg.CONFIG.clear()
        kg.CONFIG.update(base, **delta)
        try:
            bws = [decode_bw(k, n, 4.0, dev, m) for (k, n), m in shapes.items()]
        except Exception as e:  # e.g. a Triton without the maxnreg option
            log.append(f"gemv {delta}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        tot = sum(1 / b for b in bws)
        log.append(f"gemv {delta}: " + " ".join(f"{b / 1e9:.0f}" for b in bws) + " GB/s")
        print(log[-1], flush=True)
        if best is None or tot < best[0]:
            best = (tot, dict(kg.CONFIG))
    assert best is not None
    kg.CONFIG.clear()
    kg.CONFIG.update(best[1])
    log.append(f"tuned gemv: {best[1]}")


def write(path: str, bw: float, rows: list[str], log: list[str]) -> None:
    text = ["# Quantized matmul benchmark\n", f"- device: {torch.cuda.get_device_name()}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- command: `PYTHONPATH=. python {' '.join(sys.argv)}`",
            f"- torch {torch.__version__}, triton {__import__('triton').__version__}",
            f"- device copy bandwidth (1 GiB D2D, read + write): {bw / 1e9:.0f} GB/s",
            "- decode: M = 1 (exl2_gemv), CUDA-graph replay over rotating weight copies (> L2); GB/s of packed "
            "bytes read (q_weight, q_scale, scale max, perm)",
            "- prefill: M = 2048, triton.testing.do_bench median (dequantize to fp16 scratch + cuBLAS)\n",
            "\n".join(rows), "\n## Log\n", "\n".join(f"- {line}" for line in log)]
    with open(path, "w") as f:
        f.write("\n".join(text) + "\n")


def main() -> None:
    """Decode checks, the decode sweep (and checks of the chosen config), copy bandwidth, the table (written
    after every row, so a cut-off run keeps what it has), then the other kernels' checks."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/quant_matmul.md")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--quick-tune", action="store_true", help="only the first four TUNE configs")
    ap.add_argument("--skip-other-checks", action="store_true", help="no M > 1 / GPTQ checks at the end")
    args = ap.parse_args()
    dev = torch.device("cuda")
    log: list[str] = []
    t0 = time.time()
    ok = check_gemv(dev, log)
    log.append(f"decode correctness: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f} s)")
    print("\n".join(log), flush=True)
    if not ok:
        sys.exit(1)
    if not args.no_tune:
        tune(dev, log, args.quick_tune)
        log.append(f"tuning done at {time.time() - t0:.0f} s")
        ok = check_gemv(dev, log, only=(0, 6, 7, 9))
        log.append(f"decode correctness with the tuned config: {'PASS' if ok else 'FAIL'}")
        print("\n".join(log[-16:]), flush=True)
        if not ok:
            sys.exit(1)
    bw = copy_bandwidth(dev)
    rows = ["| K x N | bpw | decode GB/s | % of copy BW | prefill TFLOP/s | fp16 cuBLAS TFLOP/s |",
            "|---|---|---|---|---|---|"]
    order = [(4.0, s) for s in SHAPES] + [(b, s) for b in (8.0, 6.0, 2.5) for s in SHAPES]
    for bpw, (k, n) in order:
        d = decode_bw(k, n, bpw, dev)
        pq, pd = prefill(k, n, bpw, dev)
        rows.append(f"| {k} x {n} | {bpw} | {d / 1e9:.0f} | {100 * d / bw:.0f}% | {pq:.0f} | {pd:.0f} |")
        print(rows[-1], flush=True)
        write(args.out, bw, rows, log)
    log.append(f"table done at {time.time() - t0:.0f} s with gemv config {dict(kg.CONFIG)}")
    if args.skip_other_checks:
        return
    ok = check(dev, log)
    log.append(f"other kernels' correctness: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f} s)")
    print("\n".join(log[-30:]), flush=True)
    write(args.out, bw, rows, log)


if __name__ == "__main__":
    main()
