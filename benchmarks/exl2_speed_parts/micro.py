"""exl2_speed part `micro`: per matrix, the fused kernel (the decode GEMV at one row, exl2_qmm past it) against
dequantize + cuBLAS and an fp16 GEMM; the crossover row count per shape."""

from __future__ import annotations

import argparse
import gc
import json
from typing import Any

import torch

from benchmarks.exl2_speed_parts.common import fmt_us, guarded, log, shape_matrix, timed

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]


ROWS = [1, 2, 4, 8, 16, 32, 64]


GEMV_VARIANTS = [(128, 8), (144, 16), (168, 8), (192, 8), (232, 16), (255, 16)]  # (register cap, words in flight)


def _fused_error(x: torch.Tensor, qm: Any, group: Any, runs: int = 20) -> float:
    """Worst rel_err (max |diff| / max |ref|) of the fused kernel against dequantize + cuBLAS over `runs` calls
    (the split-K epilogue is where GPU-only races showed: repeat to catch an intermittent one)."""
    from exlpy.kernels import exl2_matmul as km

    ref = km.dequant_matmul(x, qm).float()
    worst = 0.0
    for _ in range(runs):
        y = km.exl2_matmul(x, qm) if x.shape[0] == 1 else group.run(x)
        worst = max(worst, ((y.float() - ref).abs().max() / ref.abs().max()).item())
    return worst


def _gemv_error(x: torch.Tensor, qm: Any, runs: int = 10) -> float:
    """Worst rel_err of the multi-row decode GEMV against dequantize + cuBLAS over `runs` calls."""
    from exlpy.kernels import exl2_gemv
    from exlpy.kernels import exl2_matmul as km

    ref = km.dequant_matmul(x, qm).float()
    worst = 0.0
    for _ in range(runs):
        y = exl2_gemv.exl2_gemv(x, qm)
        worst = max(worst, ((y.float() - ref).abs().max() / ref.abs().max()).item())
    return worst


def _micro_shape(args: argparse.Namespace, res: dict, k: int, n: int, mix: str, rows: list[int]) -> None:
    from exlpy.kernels import exl2_gemv, exl2_qmm
    from exlpy.kernels import exl2_matmul as km

    dev = torch.device("cuda")
    case = shape_matrix("micro", k, n, mix)
    if case is None:
        return
    key, qm, mats = case
    groups = [exl2_qmm.QmmGroup([m], None) for m in mats]
    w16 = [torch.randn(k, n, dtype=torch.float16, device=dev) for _ in range(max(1, (300 << 20) // (2 * k * n)))]
    nbytes = qm.nbytes()
    for m in rows:
        x = torch.randn(m, k, dtype=torch.float16, device=dev)
        if m == 1:  # the decode GEMV (through exl2_matmul's dispatch)
            fused = (lambda x=x: [km.exl2_matmul(x, q) for q in mats]) if exl2_gemv.supports(qm) else None
        else:
            fused = lambda x=x: [g.run(x) for g in groups]  # noqa: E731
        t_f = guarded(f"fused M={m}", timed, args.reps, len(mats), fused) if fused else None
        err = guarded(f"check M={m}", _fused_error, x, qm, groups[0]) if fused else None
        t_g = g_err = None
        if 2 <= m <= exl2_gemv.MAX_ROWS and exl2_gemv.supports(qm):  # the decode GEMV over m rows
            t_g = guarded(f"gemv M={m}", timed, args.reps, len(mats),
                          lambda x=x: [exl2_gemv.exl2_gemv(x, q) for q in mats])
            g_err = guarded(f"check gemv M={m}", _gemv_error, x, qm)
            if args.gemv_variants and m in (4, 8):
                base = exl2_gemv.ROWS_CONFIG[m]
                for cfg in GEMV_VARIANTS:
                    exl2_gemv.ROWS_CONFIG[m] = cfg
                    t_v = guarded(f"gemv M={m} {cfg}", timed, args.reps, len(mats),
                                  lambda x=x: [exl2_gemv.exl2_gemv(x, q) for q in mats])
                    res.setdefault("gemv_variants", {})[f"{key} M{m} {cfg}"] = t_v and t_v * 1e6
                    log(f"  M={m:3d} gemv maxnreg/words {cfg}: {fmt_us(t_v)}")
                exl2_gemv.ROWS_CONFIG[m] = base
        t_d = guarded(f"dequant M={m}", timed, max(3, args.reps // 4), len(mats),
                      lambda x=x: [km.dequant_matmul(x, q) for q in mats])
        t_h = guarded(f"fp16 M={m}", timed, args.reps, len(w16), lambda x=x: [x @ w for w in w16])
        res.setdefault("micro", {})[f"{key} M{m}"] = {
            "k": k, "n": n, "mix": mix, "m": m, "bytes": nbytes, "fused_us": t_f and t_f * 1e6,
            "dequant_us": t_d and t_d * 1e6, "fp16_us": t_h and t_h * 1e6, "fused_rel_err": err,
            "gemv_us": t_g and t_g * 1e6, "gemv_rel_err": g_err}
        gbs = f"{nbytes / t_f / 1e9:7.0f} GB/s" if t_f else "      -"
        bad = "  WRONG" if err is not None and err >= 2e-3 else ""
        log(f"  M={m:3d} fused {fmt_us(t_f)} ({gbs})  dequant+cuBLAS {fmt_us(t_d)}  fp16 cuBLAS {fmt_us(t_h)}  "
            f"fused rel_err {err if err is None else f'{err:.1e}'}{bad}")
        if t_g:
            e = "-" if g_err is None else f"{g_err:.1e}" + ("  WRONG" if g_err >= 2e-3 else "")
            log(f"        gemv  {fmt_us(t_g)} ({nbytes / t_g / 1e9:7.0f} GB/s)  rel_err {e}")
    x = torch.randn(2048, k, dtype=torch.float16, device=dev)
    t_p = guarded("prefill", timed, 5, 1, lambda: km.dequant_matmul(x, qm))
    t_p16 = guarded("prefill fp16", timed, 5, 1, lambda: x @ w16[0])
    res.setdefault("micro_prefill", {})[key] = {"dequant_us": t_p and t_p * 1e6, "fp16_us": t_p16 and t_p16 * 1e6}
    if t_p and t_p16:
        log(f"  prefill 2048: dequant+cuBLAS {2 * 2048 * k * n / t_p / 1e12:.0f} TFLOP/s, fp16 "
            f"{2 * 2048 * k * n / t_p16 / 1e12:.0f} TFLOP/s")


def micro(args: argparse.Namespace, res: dict) -> None:
    mixes = args.mixes or (["4.0"] if args.quick else ["4.0", "mixed", "gptq"])
    rows = [1, 8, 32, 64] if args.quick else ROWS
    for mix in mixes:
        for k, n in SHAPES:
            _micro_shape(args, res, k, n, mix, rows)
            gc.collect()
            torch.cuda.empty_cache()
    log("crossover (first M where dequantize + cuBLAS is faster; none: the fused kernel wins up to 64):")
    log("CROSSOVER = " + json.dumps(crossover(res)))


def crossover(res: dict) -> dict[str, int]:
    out = {}
    for r in res.get("micro", {}).values():
        if r["mix"] != "4.0" or r["m"] < 2 or not r["fused_us"] or not r["dequant_us"]:
            continue
        key = f"({r['k']}, {r['n']})"
        if r["dequant_us"] < r["fused_us"] and r["m"] < out.get(key, 1 << 30):
            out[key] = r["m"]
    return out
