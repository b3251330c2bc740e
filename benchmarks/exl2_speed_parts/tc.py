"""exl2_speed part `tc`: the tensor-core dequant GEMM (exl2_tc) against exl2_qmm and the GEMV, with its
launch-parameter sweep and the table suggestions it prints."""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from benchmarks.exl2_speed_parts.common import (
    fmt_us,
    guarded,
    log,
    shape_matrix,
    timed,
    us_or_none,
)

TC_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # q|k|v, o, gate|up, down of the 8B model


TC_ROWS = [1, 2, 4, 8, 16, 32, 64]


# launch-table alternatives per BLOCK_M class (overrides of exl2_tc_plan.CONFIG[bm]); the first is the default
TC_SWEEP: dict[int, list[dict[str, int]]] = {
    16: [{}, {"HALF": 1}, {"KB": 4}, {"BLOCK_N": 64}, {"BLOCK_N": 64, "KB": 4}, {"WAVES": 8}, {"SWAP": 0},
         {"GRID": 2}, {"GRID": 3, "MAXNREG": 168}, {"WARPS": 8}],
    32: [{}, {"HALF": 1}, {"WAVES": 4}, {"WAVES": 12}, {"BLOCK_N": 64, "KB": 4}, {"KB": 4}, {"SWAP": 0}, {"GRID": 2},
         {"FOLD": 1}],
    64: [{}, {"HALF": 1}, {"FOLD": 1}, {"WAVES": 2}, {"WAVES": 8}, {"SWAP": 0}, {"GRID": 2}],
}


def _tc_error(x: torch.Tensor, ref: torch.Tensor, run: Callable[[], torch.Tensor], runs: int = 10) -> float:
    worst = 0.0
    for _ in range(runs):  # repeated: a split-K epilogue race shows only now and then
        worst = max(worst, ((run().float() - ref).abs().max() / ref.abs().max()).item())
    return worst


def _tc_shape(args: argparse.Namespace, res: dict, k: int, n: int, mix: str) -> None:
    from exlpy.kernels import exl2_gemv, exl2_qmm, exl2_tc, exl2_tc_plan
    from exlpy.kernels import exl2_matmul as km
    from exlpy.runtime import options, use_options

    dev = torch.device("cuda")
    case = shape_matrix("tc", k, n, mix)
    if case is None:
        return
    key, qm, mats = case
    nbytes = qm.nbytes()
    qmm_opts = replace(options(), qmm_kernel="qmm")
    with use_options(qmm_opts):
        qgroups = [exl2_qmm.QmmGroup([m], None) for m in mats]
    tgroups = [exl2_tc.TcGroup([m], None) for m in mats]
    for m in args.tc_rows:
        x = torch.randn(m, k, dtype=torch.float16, device=dev)
        ref = km.dequant_matmul(x, qm).float()
        row: dict[str, Any] = {"k": k, "n": n, "mix": mix, "m": m, "bytes": nbytes}
        if m >= 2:
            with use_options(qmm_opts):
                row["qmm_us"] = us_or_none(guarded(f"qmm M={m}", timed, args.reps, len(mats),
                                                    lambda x=x: [g.run(x) for g in qgroups]))
                row["qmm_err"] = guarded(f"check qmm M={m}", _tc_error, x, ref, lambda x=x: qgroups[0].run(x))
        if m <= 4 and exl2_gemv.supports(qm):
            row["gemv_us"] = us_or_none(guarded(f"gemv M={m}", timed, args.reps, len(mats),
                                                 lambda x=x: [exl2_gemv.exl2_gemv(x, q) for q in mats]))
        row["tc_us"] = us_or_none(guarded(f"tc M={m}", timed, args.reps, len(mats),
                                           lambda x=x: [g.run(x) for g in tgroups]))
        row["tc_err"] = guarded(f"check tc M={m}", _tc_error, x, ref, lambda x=x: tgroups[0].run(x))
        res.setdefault("tc", {})[f"{key} M{m}"] = row
        cells = "  ".join(f"{name} {row[f'{name}_us']:7.1f} us ({nbytes / row[f'{name}_us'] / 1e3:5.0f} GB/s)"
                          for name in ("gemv", "qmm", "tc") if row.get(f"{name}_us"))
        errs = "  ".join(f"{name} err {row[f'{name}_err']:.1e}" + ("  WRONG" if row[f"{name}_err"] >= 2e-3 else "")
                         for name in ("qmm", "tc") if row.get(f"{name}_err") is not None)
        log(f"  M={m:3d}  {cells}  {errs}")
        bm = exl2_tc_plan.block_m(m)
        if args.tc_sweep and m in args.tc_sweep_rows and (k, n, mix) in _sweep_cases(args):
            base = exl2_tc_plan.SHAPE_CONFIG.get((k, n, bm))
            try:
                for over in TC_SWEEP[bm][1:]:
                    exl2_tc_plan.SHAPE_CONFIG[(k, n, bm)] = dict(over)
                    groups = [exl2_tc.TcGroup([q], None) for q in mats]
                    t = guarded(f"tc {over}", timed, args.reps, len(mats), lambda x=x, g=groups: [a.run(x) for a in g])
                    err = guarded("check", _tc_error, x, ref, lambda x=x, g=groups: g[0].run(x), 3) if t else None
                    name = ",".join(f"{a}={b}" for a, b in over.items())
                    res.setdefault("tc_sweep", {})[f"{key} M{m} {name}"] = {
                        "k": k, "n": n, "mix": mix, "m": m, "bm": bm, "over": over, "us": us_or_none(t), "err": err}
                    log(f"    sweep M={m} {name:28s} {fmt_us(t)}" + (f" {nbytes / t / 1e9:6.0f} GB/s" if t else "")
                        + (f"  err {err:.1e}" + ("  WRONG" if err >= 2e-3 else "") if err is not None else ""))
            finally:
                if base is None:
                    exl2_tc_plan.SHAPE_CONFIG.pop((k, n, bm), None)
                else:
                    exl2_tc_plan.SHAPE_CONFIG[(k, n, bm)] = base


def _sweep_cases(args: argparse.Namespace) -> set[tuple[int, int, str]]:
    if args.tc_sweep == "full":
        return {(k, n, mix) for mix in args.mixes or ["4.0", "mixed"] for k, n in tc_shapes(args)}
    return {(4096, 28672, "4.0"), (14336, 4096, "mixed")}


def tc_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else TC_SHAPES  # type: ignore


def tc(args: argparse.Namespace, res: dict) -> None:
    for mix in args.mixes or ["4.0", "mixed"]:
        for k, n in tc_shapes(args):
            _tc_shape(args, res, k, n, mix)
            gc.collect()
            torch.cuda.empty_cache()
    log("tc table (per shape and row count, the faster of tc and qmm; TC_ROWS / SHAPE_CONFIG suggestions):")
    for line in tc_summary(res):
        log("  " + line)


def tc_summary(res: dict) -> list[str]:
    """Per (shape, mix): rows where tc beat qmm (and the GEMV at 1-4 rows), and the sweep's best config per
    BLOCK_M class where it beat the default by more than 3%."""
    out = []
    by: dict[tuple[int, int, str], list[dict]] = {}
    for r in res.get("tc", {}).values():
        by.setdefault((r["k"], r["n"], r["mix"]), []).append(r)
    for (k, n, mix), rows in sorted(by.items()):
        wins = []
        for r in sorted(rows, key=lambda r: r["m"]):
            other = [v for v in (r.get("qmm_us"), r.get("gemv_us")) if v]
            if r.get("tc_us") and other and r["tc_us"] < min(other) and (r.get("tc_err") or 1) < 2e-3:
                wins.append(r["m"])
        out.append(f"{k}x{n} {mix}: tc faster at rows {wins}")
    best: dict[tuple[int, int, str, int], tuple[float, dict]] = {}
    for r in res.get("tc_sweep", {}).values():
        if r["us"] and (r["err"] or 1) < 2e-3:
            key = (r["k"], r["n"], r["mix"], r["bm"])
            if key not in best or r["us"] < best[key][0]:
                best[key] = (r["us"], r["over"])
    for (k, n, mix, bm), (us, over) in sorted(best.items()):
        base = [r["tc_us"] for r in res.get("tc", {}).values()
                if (r["k"], r["n"], r["mix"]) == (k, n, mix) and r.get("tc_us") and _bm(r["m"]) == bm]
        if base and us < 0.97 * min(base):
            out.append(f"SHAPE_CONFIG[({k}, {n}, {bm})] = {over}  # {mix}: {us:.1f} us against {min(base):.1f}")
    return out


def _bm(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64
