"""Launch-parameter sweep of the flash attention kernel on one GPU.

python benchmarks/flash_sweep.py [--quick] [--out FILE]
Prefill: every (BLOCK_M, BLOCK_N, num_warps, num_stages) of a small grid, per head_dim (128 and 64, GQA 4:1),
timed on a one-shot 8,192-token causal block and on the last 2,048-token chunk of a 32,768-token sequence in
a paged cache; TFLOP/s of the causal FLOP count. Decode: (BLOCK_N, num_warps, num_stages) for the fp16 and the
Q4 cache at 32k context (batch 1, one token). Settings the compiler rejects (shared memory, registers) are
listed as failed. The best settings are reported, not applied: paste them into PREFILL_CONFIGS /
DECODE_CONFIGS in exlpy/kernels/flash_attention.py (or try one for a whole run with
EXLPY_FLASH_CONFIG="BM,BN,warps,stages").
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.attention_micro import (  # noqa: E402
    PAGE,
    bench,
    causal_flops,
    flash_last_chunk,
    flash_one_shot,
    prefill_case,
)
from benchmarks.gemv_shapes import graph_time  # noqa: E402
from exlpy.kernels import flash_attention as fa  # noqa: E402


def prefill_sweep(d: int, quick: bool) -> tuple[list[str], tuple]:
    lines = [f"| D {d}: BM, BN, warps, stages, TMA | one-shot 8k TFLOP/s | last 2k chunk of 32k TFLOP/s |",
             "|---|---|---|"]
    short, long_ = prefill_case(32, 8, d, 8192), prefill_case(32, 8, d, 8192 if quick else 32768, seed=1)
    f_short, L = causal_flops(32, d, 0, 8192), long_["q"].shape[1]
    f_chunk = causal_flops(32, d, L - 2048, 2048)
    grid = itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3, 4], [False, True])
    if quick:
        grid = itertools.product([128], [64, 128], [8], [3], [False, True])
    best = (0.0, None)
    for *cfg, tma in grid:
        cfg = tuple(cfg)
        try:
            a = f_short / bench(flash_one_shot(short, cfg, tma)) / 1e9
            b = f_chunk / bench(flash_last_chunk(long_, 2048, cfg, tma)) / 1e9
        except Exception as e:  # out of shared memory / registers for this tile
            lines.append(f"| {cfg}, {tma} | failed: {type(e).__name__}: {str(e)[:80]} | |")
            continue
        lines.append(f"| {cfg}, {tma} | {a:.0f} | {b:.0f} |")
        print(lines[-1], flush=True)
        best = max(best, (a + b, (cfg, tma)), key=lambda x: x[0])
    lines.append(f"| best (sum) | {best[1]} | table now: {fa.PREFILL_CONFIGS.get(d)} |")
    del short, long_
    torch.cuda.empty_cache()
    return lines, best[1]


def decode_sweep(quick: bool) -> list[str]:
    hq, hk, d, ctx = 32, 8, 128, 8192 if quick else 32768
    pages = ctx // PAGE
    copies = 4
    bt = torch.randperm(pages, device="cuda").int().view(1, pages)
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    pos = torch.tensor([[ctx - 1]], device="cuda")
    q = torch.randn(1, 1, hq, d, device="cuda", dtype=torch.float16)
    plain = [(fa.plain_operand(torch.randn(pages, PAGE, hk, d, device="cuda", dtype=torch.float16)),
              fa.plain_operand(torch.randn(pages, PAGE, hk, d, device="cuda", dtype=torch.float16)))
             for _ in range(copies)]
    q4 = []
    for _ in range(copies):
        codes = [torch.randint(0, 255, (pages, PAGE, hk * d // 2), device="cuda", dtype=torch.uint8) for _ in "kv"]
        scales = [torch.rand(pages, PAGE, hk * d // 32, device="cuda").half() for _ in "kv"]
        q4.append((fa.quant_operand(codes[0], scales[0], 4), fa.quant_operand(codes[1], scales[1], 4)))
    lines = [f"| decode {ctx // 1024}k, BN, warps, stages | fp16 µs | Q4 µs |", "|---|---|---|"]
    grid = itertools.product([32, 64, 128], [2, 4, 8], [2, 3, 4])
    if quick:
        grid = itertools.product([64, 128], [4], [2, 3])
    for bn, w, st in grid:
        res = []
        for sets in (plain, q4):
            it = iter(range(10**9))

            def step(sets: list = sets, it=it, cfg=(16, bn, w, st)) -> object:
                k, v = sets[next(it) % copies]
                return fa.flash_attention_launch(q, k, v, bt, PAGE, lens, ctx, pos, d ** -0.5, config=cfg)

            try:
                res.append(f"{graph_time(step) * 1e6:.1f}")
            except Exception as e:
                res.append(f"failed: {type(e).__name__}")
        lines.append(f"| {bn}, {w}, {st} | {res[0]} | {res[1]} |")
        print(lines[-1], flush=True)
    lines.append(f"| table now | {fa.DECODE_CONFIGS} | |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few settings, D 128 only, 8k contexts")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "flash_sweep_run.md"))
    args = ap.parse_args()
    lines = [f"## Flash attention sweep, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
             f"{torch.cuda.get_device_name()}", "", f"Command: `python benchmarks/flash_sweep.py "
             f"{' '.join(sys.argv[1:])}`", ""]
    best = {}
    for d in [128] if args.quick else [128, 64]:
        rows, best[d] = prefill_sweep(d, args.quick)
        lines += rows + [""]
    lines += decode_sweep(args.quick)
    lines += ["", f"Suggested PREFILL_CONFIGS entries ((config), TMA): {best}"]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
