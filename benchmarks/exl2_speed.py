"""EXL2 at every batch size (issue 27): per-matrix micro-benchmark of the quantized matmuls and end-to-end decode /
prefill of 8B models (EXL2 converter-like mixed ~4.0 bpw, EXL2 uniform 4-bit, fp16, GPTQ 4-bit), side by side.

Run on a CUDA machine from the repo root (each part prints as it goes and fits one 10-minute command):

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --quick          # ~2 min first check
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts micro    # kernel vs cuBLAS, crossover
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts sweep    # launch-parameter sweep
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts e2e      # the four 8B models
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts quick    # old vs exl2_tc, ~1 min
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts tc --tc-sweep small  # exl2_tc in full
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts wide     # 65-256 rows: tc vs cuBLAS

Parts:
- micro: for K x N in 4096x4096, 4096x14336, 14336x4096 and M in 1..64 rows: the fused kernel (M = 1: the decode
  GEMV, else exl2_qmm), dequantize + cuBLAS, and an fp16 cuBLAS GEMM of the same shape; CUDA-graph replays over
  rotating weight copies (> L2), GB/s of packed bytes read. Prints the crossover row count per shape (the first
  M where dequantize + cuBLAS wins) as a `exl2_qmm_plan.CROSSOVER` table.
- sweep: exl2_qmm launch parameters (BLOCK_N, STAGES, ONE_LAUNCH, WAVES, KB, warps) on gate|up-sized 4-bit
  and down-sized mixed (8/4/3-bit) matrices at M = 8, 32 and 64.
- wide: prompt chunks of --wide-rows (default 96 128 192 256) rows on the 8B model's fused shapes (q|k|v, o,
  gate|up, down), uniform 4-bit and converter-mixed: exl2_tc's 65-256-row classes (EXLPY_TC_MAX_ROWS) against
  dequantize + cuBLAS and an fp16 GEMM; prints the crossover as `exl2_qmm_plan.CROSSOVER` entries and the
  EXLPY_TC_MAX_ROWS it suggests. --wide-sweep also times the launch-table alternatives of CONFIG[128 / 256].
- e2e: writes the models once under --models-dir (random weights: speed depends on shapes only), then per
  model decode tok/s at each --batches size (CUDA graphs, `exlpy bench`'s timing) and prefill of --prefill
  tokens. A failing variant or size is reported and skipped.

Every run merges its figures into --json (default benchmarks/results/raw/exl2_speed.json, keyed by part and
case, with device, date and command) and rewrites --out (default benchmarks/results/exl2_speed.md, with the
merged JSON beside it) from all of them, so runs of different parts add up to one results file. On a lent
machine whose output folder starts empty per command: --json /tmp/exl2_speed.json --out $OUT/exl2_speed.md.

Each part is a module of benchmarks/exl2_speed_parts/ (micro, sweep, tc, quick, e2e; what they share in common.py,
the results file in results.py); this script is their command line.
"""


from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.exl2_speed_parts.common import guarded, log  # noqa: E402
from benchmarks.exl2_speed_parts.e2e import VARIANTS, e2e  # noqa: E402
from benchmarks.exl2_speed_parts.micro import micro  # noqa: E402
from benchmarks.exl2_speed_parts.quick import quick  # noqa: E402
from benchmarks.exl2_speed_parts.results import write_md  # noqa: E402
from benchmarks.exl2_speed_parts.sweep import sweep  # noqa: E402
from benchmarks.exl2_speed_parts.tc import TC_ROWS, tc  # noqa: E402
from benchmarks.exl2_speed_parts.wide import WIDE_ROWS, wide  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="micro,e2e", help="comma list of micro, sweep, tc, quick, e2e (default "
                    "micro,e2e)")
    ap.add_argument("--budget", type=float, default=40.0, help="quick: seconds after which no new case starts")
    ap.add_argument("--quick", action="store_true", help="~2 minutes: 4-bit micro at M 1/8/32/64, EXL2 4-bit and "
                    "fp16 models at batch 1 and 8")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"e2e models, of {', '.join(VARIANTS)}")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048, help="prefill tokens to time (0: skip)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays per micro timing")
    ap.add_argument("--gemv-variants", action="store_true", help="micro: also time the multi-row GEMV's "
                    "register-cap / words-in-flight alternatives at 4 and 8 rows")
    ap.add_argument("--mixes", nargs="+", default=None, help="micro layouts (default 4.0 mixed gptq; tc: 4.0 mixed)")
    ap.add_argument("--shapes", nargs="+", default=None, help="tc part: KxN shapes (default the 8B model's fused "
                    "q|k|v, o, gate|up, down)")
    ap.add_argument("--tc-rows", type=int, nargs="+", default=TC_ROWS, help="tc part: row counts")
    ap.add_argument("--tc-sweep", choices=("small", "full"), default=None, help="tc part: also time the launch-table "
                    "alternatives (small: 4-bit gate|up and mixed down; full: every shape)")
    ap.add_argument("--tc-sweep-rows", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--wide-rows", type=int, nargs="+", default=WIDE_ROWS, help="wide part: row counts (65-256)")
    ap.add_argument("--wide-sweep", action="store_true", help="wide part: also the CONFIG[128 / 256] alternatives")
    ap.add_argument("--qmm-kernels", nargs="+", choices=("qmm", "tc", "auto"), default=None,
                    help="e2e: decode once per EXLPY_QMM_KERNEL value (same loaded model)")
    ap.add_argument("--models-dir", default=os.environ.get("EXLPY_BENCH_MODELS", "/tmp/exlpy_bench_models"))
    ap.add_argument("--out", default="benchmarks/results/exl2_speed.md")
    ap.add_argument("--json", default="benchmarks/results/raw/exl2_speed.json")
    ap.add_argument("--fresh", action="store_true", help="start the JSON over instead of merging into it")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("needs a CUDA device")
        return 2
    parts = args.parts.split(",")
    if args.quick:
        args.variants = [v for v in args.variants if v in ("exl2-4.0", "fp16")] if args.variants == list(VARIANTS) \
            else args.variants
        args.batches = [b for b in args.batches if b in (1, 8)] if args.batches == [1, 8, 32, 64] else args.batches
        args.gen_len = min(args.gen_len, 64)
        args.reps = min(args.reps, 10)
        args.prefill = min(args.prefill, 2048)
    import triton

    from exlpy.runtime import options

    state: dict = {}
    if os.path.exists(args.json) and not args.fresh:
        with open(args.json) as f:
            state = json.load(f)
    run = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           # EXLPY_GEMV_ROWS / EXLPY_QUANT_ROWS decide which kernel e2e batches of 2-64 rows run
           "command": f"EXLPY_GEMV_ROWS={options().gemv_rows} EXLPY_QUANT_ROWS={options().quant_rows} "
                      f"EXLPY_QMM_KERNEL={options().qmm_kernel} EXLPY_TC_MAX_ROWS={options().tc_max_rows} python "
                      + " ".join(shlex.quote(a) for a in sys.argv)}
    state.setdefault("runs", []).append(run)
    log(f"{run['device']}, torch {run['torch']}, triton {run['triton']}: {run['command']}")
    t0 = time.time()
    for part in parts:
        fn = {"micro": micro, "sweep": sweep, "e2e": e2e, "tc": tc, "quick": quick, "wide": wide}.get(part)
        if fn is None:
            log(f"unknown part {part!r}")
            continue
        guarded(part, fn, args, state)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(state, f, indent=1)
        write_md(state, args.out)
        beside = os.path.splitext(args.out)[0] + ".json"  # the figures travel with the markdown too
        if os.path.abspath(beside) != os.path.abspath(args.json):
            with open(beside, "w") as f:
                json.dump(state, f, indent=1)
        log(f"[{time.time() - t0:.0f} s] {part} done; wrote {args.out} and {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
