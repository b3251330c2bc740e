"""exl2_speed part `wide`: prompt chunks of 65-256 rows, the tensor-core dequant GEMM (exl2_tc past 64 rows,
EXLPY_TC_MAX_ROWS) against dequantize + cuBLAS (what such chunks run by default) and an fp16 GEMM of the same
shape, per 8B shape and row count; the crossover in exl2_qmm_plan.CROSSOVER's form and the EXLPY_TC_MAX_ROWS it
suggests. --wide-sweep also times the launch-table alternatives of exl2_tc_plan.CONFIG[128 / 256]."""

from __future__ import annotations

import argparse
import gc
from dataclasses import replace
from typing import Any

import torch

from benchmarks.exl2_speed_parts.common import fmt_us, guarded, log, shape_matrix, timed
from benchmarks.exl2_speed_parts.tc import TC_SHAPES

WIDE_ROWS = [96, 128, 192, 256]

# overrides of exl2_tc_plan.CONFIG[128 / 256] (the first, {}, is the default: one dot over 128-row tiles, BLOCK_N
# 128, 8 warps, KB 4, scales folded); TILE_M 64: 64-row tiles (no spills, but the words decoded once per tile)
WIDE_SWEEP: list[dict[str, int]] = [{}, {"TILE_M": 64}, {"TILE_M": 64, "BLOCK_N": 64, "WARPS": 4}, {"KB": 2},
                                    {"WAVES": 1}, {"WAVES": 4}, {"HALF": 1}, {"GRID": 1}]


def _err(run: Any, ref: torch.Tensor, runs: int = 5) -> float:
    worst = 0.0
    for _ in range(runs):  # repeated: a split-K epilogue race shows only now and then
        worst = max(worst, ((run().float() - ref).abs().max() / ref.abs().max()).item())
    return worst


def _wide_shape(args: argparse.Namespace, res: dict, k: int, n: int, mix: str) -> None:
    from exlpy.kernels import exl2_matmul as km
    from exlpy.kernels import exl2_tc, exl2_tc_plan

    case = shape_matrix("wide", k, n, mix)
    if case is None:
        return
    key, qm, mats = case
    dev = qm.q_weight.device
    groups = [exl2_tc.TcGroup([m], None) for m in mats]  # plans of the 128 and 256 classes (tc_max_rows 256)
    w16 = [torch.randn(k, n, dtype=torch.float16, device=dev) for _ in range(max(1, (300 << 20) // (2 * k * n)))]
    for m in args.wide_rows:
        x = torch.randn(m, k, dtype=torch.float16, device=dev)
        ref = km.dequant_matmul(x, qm).float()
        bm = exl2_tc_plan.block_m(m)
        variants = WIDE_SWEEP if args.wide_sweep else WIDE_SWEEP[:1]
        t_tc: dict[str, float | None] = {}
        base = exl2_tc_plan.SHAPE_CONFIG.get((k, n, bm))
        try:
            for over in variants:
                name = ",".join(f"{a}={b}" for a, b in over.items()) or "default"
                if over:
                    exl2_tc_plan.SHAPE_CONFIG[(k, n, bm)] = dict(over)
                t = guarded(f"tc M={m} {name}", timed, args.reps, len(mats), lambda x=x: [g.run(x) for g in groups])
                err = guarded(f"check tc M={m} {name}", _err, lambda x=x: groups[0].run(x), ref) if t else None
                ok = t is not None and err is not None and err < 2e-3
                t_tc[name] = t * 1e6 if ok else None
                res.setdefault("wide_sweep", {})[f"{key} M{m} {name}"] = {
                    "k": k, "n": n, "mix": mix, "m": m, "over": over, "us": t and t * 1e6, "err": err}
                if over:
                    log(f"    sweep M={m} {name:24s} {fmt_us(t)}  err {err if err is None else f'{err:.1e}'}"
                        + ("" if ok else "  WRONG/FAILED"))
        finally:
            if base is None:
                exl2_tc_plan.SHAPE_CONFIG.pop((k, n, bm), None)
            else:
                exl2_tc_plan.SHAPE_CONFIG[(k, n, bm)] = base
        t_d = guarded(f"dequant M={m}", timed, max(3, args.reps // 4), len(mats),
                      lambda x=x: [km.dequant_matmul(x, q) for q in mats])
        t_h = guarded(f"fp16 M={m}", timed, args.reps, len(w16), lambda x=x: [x @ w for w in w16])
        best = min(((v, name) for name, v in t_tc.items() if v), default=(None, "-"))
        row = {"k": k, "n": n, "mix": mix, "m": m, "bytes": qm.nbytes(), "tc_us": t_tc.get("default"),
               "tc_best_us": best[0], "tc_best": best[1], "dequant_us": t_d and t_d * 1e6,
               "fp16_us": t_h and t_h * 1e6, "tc_err": res["wide_sweep"][f"{key} M{m} default"]["err"]}
        res.setdefault("wide", {})[f"{key} M{m}"] = row
        ratio = (f"{row['tc_us'] / row['dequant_us']:.2f}x of dequant+cuBLAS" if row["tc_us"] and row["dequant_us"]
                 else "-")
        e = row["tc_err"]
        log(f"  M={m:3d} tc {fmt_us(t_tc.get('default') and t_tc['default'] / 1e6)}  dequant+cuBLAS {fmt_us(t_d)}  "
            f"fp16 cuBLAS {fmt_us(t_h)}  tc {ratio}  tc rel_err {e if e is None else f'{e:.1e}'}"
            + (f"  (best tc: {best[1]} {best[0]:.1f} us)" if args.wide_sweep and best[0] else ""))


def wide(args: argparse.Namespace, res: dict) -> None:
    from exlpy.runtime import options, use_options

    with use_options(replace(options(), tc_max_rows=256)):
        for mix in args.mixes or ["4.0", "mixed"]:
            for k, n in TC_SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x"))
                                                             for s in args.shapes]:
                _wide_shape(args, res, k, n, mix)
                gc.collect()
                torch.cuda.empty_cache()
    for line in wide_summary(res):
        log(line)


def wide_summary(res: dict) -> list[str]:
    """The crossover per shape (the fewest measured rows where dequantize + cuBLAS beat exl2_tc's default launch
    table on any layout measured) as exl2_qmm_plan.CROSSOVER entries, and the EXLPY_TC_MAX_ROWS that keeps every
    measured shape on the faster path."""
    rows = list(res.get("wide", {}).values())
    shapes = sorted({(r["k"], r["n"]) for r in rows})
    out = ["wide crossover (first M where dequantize + cuBLAS beats exl2_tc; none: exl2_tc wins at every M measured):"]
    table: dict[tuple[int, int], int] = {}
    lowest_win = None
    for k, n in shapes:
        mine = [r for r in rows if (r["k"], r["n"]) == (k, n)]
        losses = [r["m"] for r in mine if not r["tc_us"] or (r["dequant_us"] and r["dequant_us"] <= r["tc_us"])]
        wins = [r["m"] for r in mine if r["m"] not in losses]
        if losses:
            table[(k, n)] = min(losses)
        if wins:
            lowest_win = min(wins) if lowest_win is None else min(lowest_win, min(wins))
        out.append(f"  {k}x{n}: exl2_tc faster at M {sorted(set(wins))}, dequant+cuBLAS at M {sorted(set(losses))}")
    out.append("CROSSOVER = {" + ", ".join(f"({k}, {n}): {m}" for (k, n), m in table.items()) + "}")
    safe = max((r["m"] for r in rows if all(q["tc_us"] and q["dequant_us"] and q["tc_us"] < q["dequant_us"]
                                             for q in rows if q["m"] <= r["m"])), default=64)
    wins_at = [r["m"] for r in rows if r["m"] < table.get((r["k"], r["n"]), 1 << 30)]
    out.append(f"EXLPY_TC_MAX_ROWS={max(wins_at, default=64)}  # with the CROSSOVER entries above; without them "
               f"EXLPY_TC_MAX_ROWS={safe} (every shape and layout measured won up to there); lowest winning M: "
               f"{lowest_win}")
    return out
