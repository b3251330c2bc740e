"""Launch-parameter sweep of the decode GEMVs, timed where it matters: whole-model batch-1 decode in CUDA graphs.

python benchmarks/gemv_sweep.py [--models 8b,exl2] [--out FILE]
For the fp16 8B model it varies exlpy.kernels.gemv.CONFIG, for the EXL2 4.0 bpw 8B model
exlpy.kernels.exl2_gemv_plan.CONFIG; each setting is applied, the graphs recaptured, 512+128 tokens decoded,
and tokens/s written to a table. The best setting is reported, not applied: defaults change in the code.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_models import write_model  # noqa: E402

from exlpy.cli.bench import load_model, time_decode  # noqa: E402
from exlpy.kernels import exl2_gemv_plan, gemv  # noqa: E402

SWEEPS = {
    "8b": ("llama3-8b", 0, gemv.CONFIG, [{}, {"BLOCK_K": 1024}, {"BLOCK_K": 1024, "WARPS": 8}, {"WARPS": 8},
                                         {"ROWS": 16}, {"ROWS": 4}, {"ROWS_SMALL": 2}, {"BLOCK_K": 256}]),
    "exl2": ("llama3-8b", 4, exl2_gemv_plan.CONFIG, [{}, {"WAVES": 2}, {"WAVES": 8}, {"WORDS": 8},
                                                     {"MAXNREG": 80, "WORDS": 8}, {"MAXNREG": 128},
                                                     {"BLOCK_N": 256}, {"MIN_BLOCK_N": 256}, {"COLS": 2}]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="8b,exl2")
    ap.add_argument("--work", default="/tmp/exlpy_bench")
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--out", default="gemv_sweep.md")
    args = ap.parse_args()
    lines = [f"## GEMV sweep {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on "
             f"{torch.cuda.get_device_name()}", "",
             f"Command: `python benchmarks/gemv_sweep.py --models {args.models} --gen-len {args.gen_len}`", "",
             "| model | setting | tokens/s |", "|---|---|---|"]
    for key in args.models.split(","):
        shape, bits, cfg, deltas = SWEEPS[key]
        d = write_model(os.path.join(args.work, f"{shape}-{bits or 16}"), shape, exl2_bits=bits)
        model = load_model(d, 512 + args.gen_len + 64)
        base = dict(cfg)
        best = (0.0, {})
        for delta in deltas:
            cfg.clear()
            cfg.update(base, **delta)
            model.strategy = None  # recapture with the new launches
            try:
                tps = time_decode(model, 1, 512, args.gen_len).tokens_per_s
            except Exception as e:  # e.g. a setting the compiler rejects
                lines.append(f"| {key} | {delta} | failed: {type(e).__name__}: {str(e)[:120]} |")
                continue
            lines.append(f"| {key} | {delta or 'default'} | {tps:.1f} |")
            print(lines[-1], flush=True)
            best = max(best, (tps, delta), key=lambda b: b[0])
        cfg.clear()
        cfg.update(base)
        lines.append(f"| {key} | best: {best[1] or 'default'} | {best[0]:.1f} |")
        model.unload()
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
