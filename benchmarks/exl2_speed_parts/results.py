"""exl2_speed's results file: the markdown tables of every part's merged figures (a hand-written
"## Analysis" section at its end survives rewrites)."""

from __future__ import annotations

import json
import os

from benchmarks.exl2_speed_parts.common import fmt_e, fmt_f
from benchmarks.exl2_speed_parts.e2e import PREFILL_TARGET, TARGETS
from benchmarks.exl2_speed_parts.micro import crossover
from benchmarks.exl2_speed_parts.quick import QUICK_VARIANTS
from benchmarks.exl2_speed_parts.tc import tc_summary
from benchmarks.exl2_speed_parts.wide import wide_summary


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
            lines.append(f"| {r['k']}x{r['n']} | {r['mix']} | {r['m']} | {fmt_f(f)} | "
                         f"{fmt_f(r['bytes'] / f / 1e3 if f else None, 0)} | {fmt_f(r['dequant_us'])} | "
                         f"{fmt_f(r['fp16_us'])} | "
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
            lines.append(f"| {r['k']}x{r['n']} | {r['m']} | {r['old']} | {fmt_f(o)} | {fmt_f(t)} | "
                         f"{f'{o / t:.2f}x' if o and t else '-'} | {fmt_f(r['bytes'] / t / 1e3 if t else None, 0)} | "
                         f"{fmt_e(r.get('rel_err'))} | " + " | ".join(
                             f"{fmt_f(r.get(f'{tag}_us'))} ({fmt_e(r.get(f'{tag}_err'))})" for tag, _ in QUICK_VARIANTS)
                         + " |")
        lines.append("")
    tc_res = state.get("tc", {})
    if tc_res:
        lines += ["## Tensor-core dequant GEMM (exl2_tc) against exl2_qmm and the GEMV (us per call, CUDA-graph "
                  "replays)", "", "| K x N | layout | M | GEMV us | qmm us | tc us | tc GB/s | qmm err | tc err |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in tc_res.values():
            t = r.get("tc_us")
            lines.append(f"| {r['k']}x{r['n']} | {r['mix']} | {r['m']} | {fmt_f(r.get('gemv_us'))} | "
                         f"{fmt_f(r.get('qmm_us'))} | {fmt_f(t)} | {fmt_f(r['bytes'] / t / 1e3 if t else None, 0)} | "
                         f"{fmt_e(r.get('qmm_err'))} | {fmt_e(r.get('tc_err'))} |")
        lines += ["", *[f"- {x}" for x in tc_summary(state)], ""]
    wd = state.get("wide", {})
    if wd:
        lines += ["## Prompt chunks of 65-256 rows: exl2_tc (EXLPY_TC_MAX_ROWS) against dequantize + cuBLAS (us per "
                  "call, CUDA-graph replays)", "",
                  "| K x N | layout | M | tc us | tc GB/s | dequant+cuBLAS us | fp16 cuBLAS us | tc / dequant | "
                  "tc err | best tc variant |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in wd.values():
            t, d = r.get("tc_us"), r.get("dequant_us")
            lines.append(f"| {r['k']}x{r['n']} | {r['mix']} | {r['m']} | {fmt_f(t)} | "
                         f"{fmt_f(r['bytes'] / t / 1e3 if t else None, 0)} | {fmt_f(d)} | {fmt_f(r.get('fp16_us'))} | "
                         f"{f'{t / d:.2f}' if t and d else '-'} | {fmt_e(r.get('tc_err'))} | "
                         f"{r.get('tc_best', '-')} {fmt_f(r.get('tc_best_us'))} |")
        lines += ["", *[f"- {x}" for x in wide_summary(state)], ""]
    tsw = state.get("tc_sweep", {})
    if tsw:
        lines += ["## exl2_tc launch-parameter sweep (us per call)", "", "| case | us | err |", "|---|---|---|"]
        lines += [f"| {k} | {fmt_f(v['us'])} | {fmt_e(v['err'])} |" for k, v in tsw.items()]
        lines.append("")
    sw = state.get("sweep", {})
    if sw:
        lines += ["## exl2_qmm launch-parameter sweep (us per call)", "", "| case | us |", "|---|---|"]
        lines += [f"| {k} | {fmt_f(v)} |" for k, v in sw.items()]
        lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kept = ""
    if os.path.exists(path):  # a hand-written "## Analysis" section (to the end of the file) survives rewrites
        text = open(path).read()
        at = text.find("\n## Analysis")
        kept = text[at:] if at >= 0 else ""
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n" + kept)
