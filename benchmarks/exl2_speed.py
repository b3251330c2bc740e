"""EXL2 at every batch size (issue 27): per-matrix micro-benchmark of the quantized matmuls and end-to-end decode /
prefill of 8B models (EXL2 converter-like mixed ~4.0 bpw, EXL2 uniform 4-bit, fp16, GPTQ 4-bit), side by side.

Run on a CUDA machine from the repo root (each part prints as it goes and fits one 10-minute command):

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --quick          # ~2 min first check
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts micro    # kernel vs cuBLAS, crossover
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts sweep    # launch-parameter sweep
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts e2e      # the four 8B models
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts quick    # old vs exl2_tc, ~1 min
    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/exl2_speed.py --parts tc --tc-sweep small  # exl2_tc in full

Parts:
- micro: for K x N in 4096x4096, 4096x14336, 14336x4096 and M in 1..64 rows: the fused kernel (M = 1: the decode
  GEMV, else exl2_qmm), dequantize + cuBLAS, and an fp16 cuBLAS GEMM of the same shape; CUDA-graph replays over
  rotating weight copies (> L2), GB/s of packed bytes read. Prints the crossover row count per shape (the first
  M where dequantize + cuBLAS wins) as a `exl2_qmm_plan.CROSSOVER` table.
- sweep: exl2_qmm launch parameters (BLOCK_N, STAGES, ONE_LAUNCH, WAVES, KB, warps) on gate|up-sized 4-bit
  and down-sized mixed (8/4/3-bit) matrices at M = 8, 32 and 64.
- e2e: writes the models once under --models-dir (random weights: speed depends on shapes only), then per
  model decode tok/s at each --batches size (CUDA graphs, `exlpy bench`'s timing) and prefill of --prefill
  tokens. A failing variant or size is reported and skipped.

Every run merges its figures into --json (default benchmarks/results/raw/exl2_speed.json, keyed by part and
case, with device, date and command) and rewrites --out (default benchmarks/results/exl2_speed.md, with the
merged JSON beside it) from all of them, so runs of different parts add up to one results file. On a lent
machine whose output folder starts empty per command: --json /tmp/exl2_speed.json --out $OUT/exl2_speed.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.quant_matmul import graph_time  # noqa: E402  (median of CUDA-graph replays)

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
ROWS = [1, 2, 4, 8, 16, 32, 64]
VARIANTS = ("exl2-mixed", "exl2-4.0", "fp16", "gptq-4")
TARGETS = {1: 500, 8: 2500, 32: 5000, 64: 7000}  # tok/s, issue 27 (H100)
PREFILL_TARGET = 37000


def log(msg: str) -> None:
    print(msg, flush=True)


def guarded(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or None after printing the error: one failing case never stops the run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a benchmark run reports every failure and goes on
        log(f"  !! {what} failed: {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(limit=3)
        torch.cuda.synchronize()
        return None


# --- micro ----------------------------------------------------------------------------------------------------

def random_matrix(k: int, n: int, mix: str, dev: torch.device, gptq: bool = False) -> Any:
    """A packed matrix built on the GPU: uniform 4-bit g128, a converter-like mixed layout, or GPTQ 4-bit g128."""
    from benchmarks import make_models
    from exlpy.quant.exl2_ref import build_exl2_matrix
    from exlpy.quant.gptq_ref import build_gptq_matrix

    if gptq:
        t = make_models._gptq("m", k, n)
        return build_gptq_matrix(t["m.qweight"], t["m.qzeros"], t["m.scales"], None, k, n, "m").to(dev)
    if mix == "4.0":
        groups: list[tuple[int, int]] | int = 4
    else:  # the down_proj / gate|up layouts of the converter's 4.0 bpw MLP row (spec §4.4): 8 / 4 / 3 bits
        from exlpy.convert.qparams import qp

        groups = (qp((8, 0.05, 32), (4, 0.25, 128), (3, 0.7, 128)) if k > n else
                  qp((5, 0.1, 128), (4, 0.6, 128), (3, 0.3, 128))).groups(k)
    t = make_models._exl2("m", k, n, groups)
    return build_exl2_matrix(t["m.q_weight"], t["m.q_invperm"], t["m.q_scale"], t["m.q_scale_max"], t["m.q_groups"],
                             k, n, "m").to(dev)


def _copies(qm: Any, total_bytes: int) -> list[Any]:
    n = max(1, min(24, total_bytes // qm.nbytes()))
    out = [qm]
    for _ in range(n - 1):
        out.append(replace(qm, q_weight=qm.q_weight.clone(), scales=qm.scales.clone()))
    return out


def _timed(reps: int, per: int, fn: Callable[[], Any]) -> float:
    return graph_time(fn, reps) / per


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


GEMV_VARIANTS = [(128, 8), (144, 16), (168, 8), (192, 8), (232, 16), (255, 16)]  # (register cap, words in flight)


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
    key = f"{k}x{n} {mix}"
    log(f"micro {key}")
    qm = guarded("build", random_matrix, k, n, mix, dev, mix == "gptq")
    if qm is None:
        return
    mats = _copies(qm, 300 << 20)
    groups = [exl2_qmm.QmmGroup([m], None) for m in mats]
    w16 = [torch.randn(k, n, dtype=torch.float16, device=dev) for _ in range(max(1, (300 << 20) // (2 * k * n)))]
    nbytes = qm.nbytes()
    for m in rows:
        x = torch.randn(m, k, dtype=torch.float16, device=dev)
        if m == 1:  # the decode GEMV (through exl2_matmul's dispatch)
            fused = (lambda x=x: [km.exl2_matmul(x, q) for q in mats]) if exl2_gemv.supports(qm) else None
        else:
            fused = lambda x=x: [g.run(x) for g in groups]  # noqa: E731
        t_f = guarded(f"fused M={m}", _timed, args.reps, len(mats), fused) if fused else None
        err = guarded(f"check M={m}", _fused_error, x, qm, groups[0]) if fused else None
        t_g = g_err = None
        if 2 <= m <= exl2_gemv.MAX_ROWS and exl2_gemv.supports(qm):  # the decode GEMV over m rows
            t_g = guarded(f"gemv M={m}", _timed, args.reps, len(mats),
                          lambda x=x: [exl2_gemv.exl2_gemv(x, q) for q in mats])
            g_err = guarded(f"check gemv M={m}", _gemv_error, x, qm)
            if args.gemv_variants and m in (4, 8):
                base = exl2_gemv.ROWS_CONFIG[m]
                for cfg in GEMV_VARIANTS:
                    exl2_gemv.ROWS_CONFIG[m] = cfg
                    t_v = guarded(f"gemv M={m} {cfg}", _timed, args.reps, len(mats),
                                  lambda x=x: [exl2_gemv.exl2_gemv(x, q) for q in mats])
                    res.setdefault("gemv_variants", {})[f"{key} M{m} {cfg}"] = t_v and t_v * 1e6
                    log(f"  M={m:3d} gemv maxnreg/words {cfg}: {_us(t_v)}")
                exl2_gemv.ROWS_CONFIG[m] = base
        t_d = guarded(f"dequant M={m}", _timed, max(3, args.reps // 4), len(mats),
                      lambda x=x: [km.dequant_matmul(x, q) for q in mats])
        t_h = guarded(f"fp16 M={m}", _timed, args.reps, len(w16), lambda x=x: [x @ w for w in w16])
        res.setdefault("micro", {})[f"{key} M{m}"] = {
            "k": k, "n": n, "mix": mix, "m": m, "bytes": nbytes, "fused_us": t_f and t_f * 1e6,
            "dequant_us": t_d and t_d * 1e6, "fp16_us": t_h and t_h * 1e6, "fused_rel_err": err,
            "gemv_us": t_g and t_g * 1e6, "gemv_rel_err": g_err}
        gbs = f"{nbytes / t_f / 1e9:7.0f} GB/s" if t_f else "      -"
        bad = "  WRONG" if err is not None and err >= 2e-3 else ""
        log(f"  M={m:3d} fused {_us(t_f)} ({gbs})  dequant+cuBLAS {_us(t_d)}  fp16 cuBLAS {_us(t_h)}  "
            f"fused rel_err {err if err is None else f'{err:.1e}'}{bad}")
        if t_g:
            e = "-" if g_err is None else f"{g_err:.1e}" + ("  WRONG" if g_err >= 2e-3 else "")
            log(f"        gemv  {_us(t_g)} ({nbytes / t_g / 1e9:7.0f} GB/s)  rel_err {e}")
    x = torch.randn(2048, k, dtype=torch.float16, device=dev)
    t_p = guarded("prefill", _timed, 5, 1, lambda: km.dequant_matmul(x, qm))
    t_p16 = guarded("prefill fp16", _timed, 5, 1, lambda: x @ w16[0])
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


def _us(t: float | None) -> str:
    return f"{t * 1e6:8.1f} us" if t else "       - us"


# --- sweep ----------------------------------------------------------------------------------------------------

def _sweep_shape(args: argparse.Namespace, res: dict, k: int, n: int, mix: str, configs: list[dict]) -> None:
    from exlpy.kernels import exl2_qmm

    base = dict(exl2_qmm.CONFIG)
    qm = guarded("build", random_matrix, k, n, mix, torch.device("cuda"))
    if qm is None:
        return
    mats = _copies(qm, 300 << 20)
    try:
        for m in (8, 32, 64):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            for cfg in configs:
                exl2_qmm.CONFIG.clear()
                exl2_qmm.CONFIG.update({**base, **cfg})
                groups = [exl2_qmm.QmmGroup([q], None) for q in mats]
                t = guarded(f"{cfg}", _timed, args.reps, len(mats),
                            lambda x=x, groups=groups: [g.run(x) for g in groups])
                name = ",".join(f"{a}={b}" for a, b in cfg.items()) or "default"
                res.setdefault("sweep", {})[f"{k}x{n} {mix} M{m} {name}"] = t and t * 1e6
                log(f"sweep {k}x{n} {mix} M={m} {name:28s} {_us(t)}"
                    + (f" {qm.nbytes() / t / 1e9:6.0f} GB/s" if t else ""))
    finally:
        exl2_qmm.CONFIG.clear()
        exl2_qmm.CONFIG.update(base)


def sweep(args: argparse.Namespace, res: dict) -> None:
    configs = [{}, {"STAGES_16": 1, "STAGES_32": 1}, {"STAGES_16": 3, "STAGES_32": 3}, {"STAGES_MIXED": 2},
               {"BLOCK_N_16": 64, "BLOCK_N_32": 64}, {"WAVES": 3}, {"WAVES": 12}, {"ONE_LAUNCH": 0},
               {"ONE_LAUNCH": 0, "STAGES_16": 1, "STAGES_32": 1}, {"KB": 2}, {"WARPS_16": 8, "WARPS_32": 8},
               {"BLOCK_N_16": 64, "BLOCK_N_32": 64, "STAGES_16": 1, "STAGES_32": 1}]
    if args.quick:
        configs = configs[:4]
    for (k, n), mix in (((4096, 14336), "4.0"), ((14336, 4096), "mixed")):
        _sweep_shape(args, res, k, n, mix, configs)
        gc.collect()
        torch.cuda.empty_cache()


# --- tc: the tensor-core dequant GEMM against exl2_qmm, with its launch-parameter sweep -----------------------

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
    key = f"{k}x{n} {mix}"
    log(f"tc {key}")
    qm = guarded("build", random_matrix, k, n, mix, dev, mix == "gptq")
    if qm is None:
        return
    mats = _copies(qm, 300 << 20)
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
                row["qmm_us"] = _us_or_none(guarded(f"qmm M={m}", _timed, args.reps, len(mats),
                                                    lambda x=x: [g.run(x) for g in qgroups]))
                row["qmm_err"] = guarded(f"check qmm M={m}", _tc_error, x, ref, lambda x=x: qgroups[0].run(x))
        if m <= 4 and exl2_gemv.supports(qm):
            row["gemv_us"] = _us_or_none(guarded(f"gemv M={m}", _timed, args.reps, len(mats),
                                                 lambda x=x: [exl2_gemv.exl2_gemv(x, q) for q in mats]))
        row["tc_us"] = _us_or_none(guarded(f"tc M={m}", _timed, args.reps, len(mats),
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
                    t = guarded(f"tc {over}", _timed, args.reps, len(mats), lambda x=x, g=groups: [a.run(x) for a in g])
                    err = guarded("check", _tc_error, x, ref, lambda x=x, g=groups: g[0].run(x), 3) if t else None
                    name = ",".join(f"{a}={b}" for a, b in over.items())
                    res.setdefault("tc_sweep", {})[f"{key} M{m} {name}"] = {
                        "k": k, "n": n, "mix": mix, "m": m, "bm": bm, "over": over, "us": _us_or_none(t), "err": err}
                    log(f"    sweep M={m} {name:28s} {_us(t)}" + (f" {nbytes / t / 1e9:6.0f} GB/s" if t else "")
                        + (f"  err {err:.1e}" + ("  WRONG" if err >= 2e-3 else "") if err is not None else ""))
            finally:
                if base is None:
                    exl2_tc_plan.SHAPE_CONFIG.pop((k, n, bm), None)
                else:
                    exl2_tc_plan.SHAPE_CONFIG[(k, n, bm)] = base


def _us_or_none(t: float | None) -> float | None:
    return t * 1e6 if t else None


def _sweep_cases(args: argparse.Namespace) -> set[tuple[int, int, str]]:
    if args.tc_sweep == "full":
        return {(k, n, mix) for mix in args.mixes or ["4.0", "mixed"] for k, n in _tc_shapes(args)}
    return {(4096, 28672, "4.0"), (14336, 4096, "mixed")}


def _tc_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else TC_SHAPES  # type: ignore


def tc(args: argparse.Namespace, res: dict) -> None:
    for mix in args.mixes or ["4.0", "mixed"]:
        for k, n in _tc_shapes(args):
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


# --- quick: old against new in about a minute ----------------------------------------------------------------

QUICK_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
QUICK_ROWS = [1, 2, 4, 8, 16, 32]
# exl2_tc's launch-table alternatives the quick part times with the time left, in this order
QUICK_VARIANTS = [("half", {"HALF": 1}), ("sk", {"GRID": 2, "HALF": 1})]


def fast_matrix(k: int, n: int, dev: torch.device, gen: torch.Generator) -> Any:
    """A uniform 4-bit g128 EXL2 matrix of random packed words (every word is valid codes; no bit packing, so an
    8B-sized matrix takes milliseconds), moved to `dev`."""
    from exlpy.quant.exl2_ref import build_exl2_matrix

    g = k // 128
    rnd = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)  # noqa: E731
    groups = torch.tensor([v for i in range(g) for v in (4, 16 * i)], dtype=torch.int16)
    qm = build_exl2_matrix(rnd(k // 8, n), torch.randperm(k, generator=gen).to(torch.int32), rnd(g, n // 8),
                           (0.01 * (0.5 + torch.rand(g, generator=gen))).half(), groups, k, n, "quick")
    return qm.to(dev)


def quick(args: argparse.Namespace, res: dict) -> None:
    """4-bit 8B shapes at 1-32 rows: the kernels before exl2_tc (EXLPY_QMM_KERNEL=qmm: the GEMV up to
    EXLPY_GEMV_ROWS rows, exl2_qmm past them) against exl2_tc's default launch table, then, with the time left,
    exl2_tc's QUICK_VARIANTS; one table. Each tc output is checked against the old kernel's (rel_err under 2e-3).
    No new case starts after --budget seconds (compiles included)."""
    from exlpy.kernels import exl2_tc_plan
    from exlpy.runtime import options

    t0 = time.time()
    gen = torch.Generator().manual_seed(0)
    rows = args.tc_rows if args.tc_rows != TC_ROWS else QUICK_ROWS
    shapes = _tc_shapes(args) if args.shapes else QUICK_SHAPES
    cases = [_QuickShape(k, n, gen) for k, n in shapes]
    out = res.setdefault("quick", {})
    for c in cases:  # first: the old kernel against exl2_tc's defaults, every case
        for m in rows:
            if time.time() - t0 > args.budget:
                break
            r = out[f"{c.k}x{c.n} M{m}"] = c.compare(args, m)
            log(f"  [{time.time() - t0:3.0f} s] {c.k}x{c.n} M={m}: {r['old']} {_f(r['old_us'])} us, tc "
                f"{_f(r.get('tc_us'))} us")
    for tag, over in QUICK_VARIANTS:  # then, while time is left: exl2_tc's alternatives
        for c in cases:
            for m in rows:
                key = f"{c.k}x{c.n} M{m}"
                if time.time() - t0 > args.budget or key not in out:
                    break
                bm = exl2_tc_plan.block_m(m)
                exl2_tc_plan.SHAPE_CONFIG[(c.k, c.n, bm)] = dict(over)
                try:
                    out[key].update(c.variant(args, m, tag))
                finally:
                    exl2_tc_plan.SHAPE_CONFIG.pop((c.k, c.n, bm), None)
    log(f"{'K x N':>11} {'M':>3} {'old kernel':>10} {'old us':>8} {'tc us':>8} {'speed-up':>8} {'tc GB/s':>8} "
        f"{'rel_err':>8}" + "".join(f" {'tc-' + tag + ' us':>11}" for tag, _ in QUICK_VARIANTS))
    for r in out.values():
        o, t = r.get("old_us"), r.get("tc_us")
        up = f"{o / t:7.2f}x" if o and t else "       -"
        gbs = f"{r['bytes'] / t / 1e3:8.0f}" if t else "       -"
        err = r.get("rel_err")
        bad = "".join(f"  WRONG ({name})" for name, e in (("tc", err), *((tag, r.get(f"{tag}_err"))
                                                                         for tag, _ in QUICK_VARIANTS))
                      if e is not None and e >= 2e-3)
        log(f"{r['k']:>5}x{r['n']:<5} {r['m']:>3} {r['old']:>10} {_f(o):>8} {_f(t):>8} {up:>8} {gbs:>8} "
            f"{_e(err):>8}" + "".join(f" {_f(r.get(f'{tag}_us')):>11}" for tag, _ in QUICK_VARIANTS) + bad)
    log(f"[{time.time() - t0:.0f} s] old = EXLPY_QMM_KERNEL=qmm (the GEMV up to EXLPY_GEMV_ROWS={options().gemv_rows} "
        "rows, exl2_qmm past them); tc = exl2_tc's default launch table (EXLPY_QMM_KERNEL=tc); "
        + "; ".join(f"tc-{tag} = exl2_tc with {over}" for tag, over in QUICK_VARIANTS))
    for line in quick_summary(out):
        log(line)


def quick_summary(out: dict) -> list[str]:
    """Where exl2_tc (its fastest correct variant per case) beat the old kernel, as exl2_tc_plan tables."""
    best: dict[int, dict[str, int]] = {}  # row count -> wins per variant
    rows: dict[tuple[int, int], list[int]] = {}
    for r in out.values():
        cands = [("tc", r.get("tc_us"), r.get("rel_err"))] + [(tag, r.get(f"{tag}_us"), r.get(f"{tag}_err"))
                                                             for tag, _ in QUICK_VARIANTS]
        ok = [(us, tag) for tag, us, err in cands if us and err is not None and err < 2e-3]
        if ok and r.get("old_us") and min(ok)[0] < r["old_us"]:
            rows.setdefault((r["k"], r["n"]), []).append(r["m"])
            tag = min(ok)[1]
            best.setdefault(r["m"], {}).setdefault(tag, 0)
            best[r["m"]][tag] += 1
    lines = [f"exl2_tc faster at: {json.dumps({f'{k}x{n}': ms for (k, n), ms in sorted(rows.items())})}"]
    for m, wins in sorted(best.items()):
        lines.append(f"  M={m}: fastest variant (cases won) {wins}")
    return lines


class _QuickShape:
    """One shape of the quick comparison: rotating copies of a random 4-bit matrix and both kernels' groups."""

    def __init__(self, k: int, n: int, gen: torch.Generator) -> None:
        from exlpy.kernels import exl2_qmm, exl2_tc
        from exlpy.runtime import options, use_options

        self.k, self.n = k, n
        self.qm = fast_matrix(k, n, torch.device("cuda"), gen)
        self.mats = _copies(self.qm, 256 << 20)
        self.old_opts = replace(options(), qmm_kernel="qmm")
        with use_options(self.old_opts):
            self.qgroups = [exl2_qmm.QmmGroup([q], None) for q in self.mats]
        self.tgroups = [exl2_tc.TcGroup([q], None) for q in self.mats]
        self.y_old: dict[int, torch.Tensor] = {}
        self.x: dict[int, torch.Tensor] = {}

    def compare(self, args: argparse.Namespace, m: int) -> dict[str, Any]:
        from exlpy.kernels import exl2_gemv
        from exlpy.runtime import use_options

        x = self.x[m] = torch.randn(m, self.k, dtype=torch.float16, device="cuda")
        with use_options(self.old_opts):
            if exl2_gemv.gemv_takes(m, self.n):
                name, old = "gemv", lambda: [exl2_gemv.exl2_gemv(x, q) for q in self.mats]
            else:
                name, old = "qmm", lambda: [g.run(x) for g in self.qgroups]
            t_old = guarded(f"{name} M={m}", _timed, args.reps, len(self.mats), old)
            self.y_old[m] = old()[0].float()
        row = {"k": self.k, "n": self.n, "m": m, "old": name, "old_us": _us_or_none(t_old), "bytes": self.qm.nbytes()}
        for key, v in self.variant(args, m, "tc", self.tgroups).items():
            row[key.replace("tc_err", "rel_err")] = v
        return row

    def variant(self, args: argparse.Namespace, m: int, tag: str, groups: list | None = None) -> dict[str, Any]:
        """exl2_tc under the launch table in force: {tag}_us and {tag}_err against the old kernel's output."""
        from exlpy.kernels import exl2_tc

        groups = groups or [exl2_tc.TcGroup([q], None) for q in self.mats]
        x, y = self.x[m], self.y_old[m]
        t = guarded(f"{tag} M={m}", _timed, args.reps, len(self.mats), lambda: [g.run(x) for g in groups])
        err = guarded("check", lambda: ((groups[0].run(x).float() - y).abs().max() / y.abs().max()).item())
        return {f"{tag}_us": _us_or_none(t), f"{tag}_err": err}


# --- e2e ------------------------------------------------------------------------------------------------------

def model_dir(args: argparse.Namespace, variant: str) -> str:
    from benchmarks.make_models import write_model

    path = os.path.join(args.models_dir, f"llama3-8b-{variant}")
    t0 = time.time()
    kw = {"exl2-mixed": {"exl2_mix": "converter"}, "exl2-4.0": {"exl2_bits": 4}, "fp16": {},
          "gptq-4": {"gptq": True}}[variant]
    write_model(path, "llama3-8b", **kw)
    if time.time() - t0 > 1:
        log(f"  wrote {path} in {time.time() - t0:.0f} s")
    return path


def _e2e_variant(args: argparse.Namespace, res: dict, variant: str) -> None:
    from exlpy.cli.bench import load_model, time_decode, time_prefill
    from exlpy.runtime import options, use_options

    log(f"e2e {variant}")
    path = guarded("write model", model_dir, args, variant)
    if path is None:
        return
    seq = max(args.prompt_len + args.gen_len + 16, args.prefill)
    # loaded under EXLPY_QMM_KERNEL=tc when any run wants it: the groups then make exl2_tc's plans too (the option
    # in force at each decode picks the kernel)
    kern = "tc" if "tc" in (args.qmm_kernels or []) else options().qmm_kernel
    with use_options(replace(options(), qmm_kernel=kern)):
        model = guarded("load", load_model, path, seq, max(args.batches))
    if model is None:
        return
    out = res.setdefault("e2e", {}).setdefault(variant, {})
    out["weights_gb"] = sum(m.weight_bytes() for m in model.modules[1:]) / 1e9
    for kern in args.qmm_kernels or [None]:
        opts = options() if kern is None else replace(options(), qmm_kernel=kern)
        tag = "" if kern is None else f" [{kern}]"
        slot = out if kern is None else out.setdefault(kern, {})
        with use_options(opts):
            for b in args.batches:
                r = guarded(f"decode batch {b}{tag}", time_decode, model, b, args.prompt_len, args.gen_len)
                if r is not None:
                    slot[f"b{b}"] = r.tokens_per_s
                    log(f"  batch {b:3d}{tag}: {r.tokens_per_s:9.1f} tok/s  ({1e3 * r.seconds / r.gen_len:.2f} "
                        f"ms/step, {r.bandwidth() / 1e12:.2f} TB/s)")
    if args.prefill:
        t = guarded("prefill", time_prefill, model, args.prefill)
        if t is not None:
            out["prefill"] = t
            log(f"  prefill {args.prefill}: {t:,.0f} tok/s")
    guarded("unload", model.unload)


def e2e(args: argparse.Namespace, res: dict) -> None:
    for variant in [v for v in args.variants if v in VARIANTS]:
        _e2e_variant(args, res, variant)
        gc.collect()
        torch.cuda.empty_cache()


# --- results --------------------------------------------------------------------------------------------------

def write_md(state: dict, path: str) -> None:
    lines = ["# EXL2 at every batch size (issue 27)", ""]
    for run in state.get("runs", []):
        lines.append(f"- {run['date']} on {run['device']} (torch {run['torch']}, triton {run['triton']}): "
                     f"`{run['command']}`")
    lines.append("")
    e2e_res = state.get("e2e", {})
    if e2e_res:
        runs = [r for v in e2e_res.values() for r in (v, *(x for x in v.values() if isinstance(x, dict)))]
        batches = sorted({int(k[1:]) for r in runs for k in r if k.startswith("b")})
        lines += ["## Decode and prefill, 8B (Llama-3 shape, random weights), tok/s total", "",
                  "| model | weights GB | " + " | ".join(f"batch {b}" for b in batches) + " | prefill 2048 |",
                  "|---|---|" + "---|" * len(batches) + "---|"]
        for v, r in e2e_res.items():
            cells = [f"{r[f'b{b}']:,.0f}" if f"b{b}" in r else "-" for b in batches]
            pre = f"{r['prefill']:,.0f}" if "prefill" in r else "-"
            lines.append(f"| {v} | {r.get('weights_gb', 0):.2f} | " + " | ".join(cells) + f" | {pre} |")
            for kern in ("qmm", "tc", "auto"):  # --qmm-kernels runs: one row per kernel
                if isinstance(r.get(kern), dict):
                    cells = [f"{r[kern][f'b{b}']:,.0f}" if f"b{b}" in r[kern] else "-" for b in batches]
                    lines.append(f"| {v} (EXLPY_QMM_KERNEL={kern}) | | " + " | ".join(cells) + " | |")
        lines.append("| target (EXL2 4.0 bpw) | | " + " | ".join(f"{TARGETS.get(b, 0):,}" for b in batches)
                     + f" | {PREFILL_TARGET:,} |")
        lines.append("")
    micro_res = state.get("micro", {})
    if micro_res:
        lines += ["## Per matrix: fused kernel vs dequantize + cuBLAS (us per call, CUDA-graph replays, weights "
                  "streamed from HBM)", "",
                  "M = 1: the decode GEMV; M >= 2: exl2_qmm. GB/s: packed bytes (q_weight, scales, perm) / time.", "",
                  "fused rel_err: worst max |diff| / max |ref| of 20 fused calls against dequantize + cuBLAS (under "
                  "2e-3).", "",
                  "| K x N | layout | M | fused us | fused GB/s | dequant+cuBLAS us | fp16 cuBLAS us | fused rel_err |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in micro_res.values():
            f = r["fused_us"]
            err = r.get("fused_rel_err")
            lines.append(f"| {r['k']}x{r['n']} | {r['mix']} | {r['m']} | {_f(f)} | "
                         f"{_f(r['bytes'] / f / 1e3 if f else None, 0)} | {_f(r['dequant_us'])} | {_f(r['fp16_us'])} | "
                         f"{'-' if err is None else f'{err:.1e}'} |")
        lines += ["", f"Crossover (first M where dequantize + cuBLAS wins): `{json.dumps(crossover(state))}`", ""]
    q = state.get("quick", {})
    if q:
        lines += ["## Quick: EXLPY_QMM_KERNEL=qmm (GEMV, exl2_qmm) against exl2_tc, 4-bit (us per call, CUDA-graph "
                  "replays)", "",
                  "| K x N | M | old kernel | old us | tc us | speed-up | tc GB/s | rel_err tc vs old | "
                  + " | ".join(f"tc {over} us (rel_err)" for _, over in QUICK_VARIANTS) + " |",
                  "|---|---|---|---|---|---|---|---|" + "---|" * len(QUICK_VARIANTS)]
        for r in q.values():
            o, t = r.get("old_us"), r.get("tc_us")
            lines.append(f"| {r['k']}x{r['n']} | {r['m']} | {r['old']} | {_f(o)} | {_f(t)} | "
                         f"{f'{o / t:.2f}x' if o and t else '-'} | {_f(r['bytes'] / t / 1e3 if t else None, 0)} | "
                         f"{_e(r.get('rel_err'))} | " + " | ".join(
                             f"{_f(r.get(f'{tag}_us'))} ({_e(r.get(f'{tag}_err'))})" for tag, _ in QUICK_VARIANTS)
                         + " |")
        lines.append("")
    tc_res = state.get("tc", {})
    if tc_res:
        lines += ["## Tensor-core dequant GEMM (exl2_tc) against exl2_qmm and the GEMV (us per call, CUDA-graph "
                  "replays)", "", "| K x N | layout | M | GEMV us | qmm us | tc us | tc GB/s | qmm err | tc err |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in tc_res.values():
            t = r.get("tc_us")
            lines.append(f"| {r['k']}x{r['n']} | {r['mix']} | {r['m']} | {_f(r.get('gemv_us'))} | "
                         f"{_f(r.get('qmm_us'))} | {_f(t)} | {_f(r['bytes'] / t / 1e3 if t else None, 0)} | "
                         f"{_e(r.get('qmm_err'))} | {_e(r.get('tc_err'))} |")
        lines += ["", *[f"- {x}" for x in tc_summary(state)], ""]
    tsw = state.get("tc_sweep", {})
    if tsw:
        lines += ["## exl2_tc launch-parameter sweep (us per call)", "", "| case | us | err |", "|---|---|---|"]
        lines += [f"| {k} | {_f(v['us'])} | {_e(v['err'])} |" for k, v in tsw.items()]
        lines.append("")
    sw = state.get("sweep", {})
    if sw:
        lines += ["## exl2_qmm launch-parameter sweep (us per call)", "", "| case | us |", "|---|---|"]
        lines += [f"| {k} | {_f(v)} |" for k, v in sw.items()]
        lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kept = ""
    if os.path.exists(path):  # a hand-written "## Analysis" section (to the end of the file) survives rewrites
        text = open(path).read()
        at = text.find("\n## Analysis")
        kept = text[at:] if at >= 0 else ""
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n" + kept)


def _e(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


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
                      f"EXLPY_QMM_KERNEL={options().qmm_kernel} python "
                      + " ".join(shlex.quote(a) for a in sys.argv)}
    state.setdefault("runs", []).append(run)
    log(f"{run['device']}, torch {run['torch']}, triton {run['triton']}: {run['command']}")
    t0 = time.time()
    for part in parts:
        fn = {"micro": micro, "sweep": sweep, "e2e": e2e, "tc": tc, "quick": quick}.get(part)
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
