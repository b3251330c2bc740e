"""exl2_speed part `quick`: the kernels before exl2_tc against exl2_tc's launch table (and its variants, with the
time left) on 4-bit 8B shapes, in about a minute."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from typing import Any

import torch

from benchmarks.exl2_speed_parts.common import copies, fmt_e, fmt_f, guarded, log, timed, us_or_none
from benchmarks.exl2_speed_parts.tc import TC_ROWS, tc_shapes

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
    shapes = tc_shapes(args) if args.shapes else QUICK_SHAPES
    cases = [_QuickShape(k, n, gen) for k, n in shapes]
    out = res.setdefault("quick", {})
    for c in cases:  # first: the old kernel against exl2_tc's defaults, every case
        for m in rows:
            if time.time() - t0 > args.budget:
                break
            r = out[f"{c.k}x{c.n} M{m}"] = c.compare(args, m)
            log(f"  [{time.time() - t0:3.0f} s] {c.k}x{c.n} M={m}: {r['old']} {fmt_f(r['old_us'])} us, tc "
                f"{fmt_f(r.get('tc_us'))} us")
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
        log(f"{r['k']:>5}x{r['n']:<5} {r['m']:>3} {r['old']:>10} {fmt_f(o):>8} {fmt_f(t):>8} {up:>8} {gbs:>8} "
            f"{fmt_e(err):>8}" + "".join(f" {fmt_f(r.get(f'{tag}_us')):>11}" for tag, _ in QUICK_VARIANTS) + bad)
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
        self.mats = copies(self.qm, 256 << 20)
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
            t_old = guarded(f"{name} M={m}", timed, args.reps, len(self.mats), old)
            self.y_old[m] = old()[0].float()
        row = {"k": self.k, "n": self.n, "m": m, "old": name, "old_us": us_or_none(t_old), "bytes": self.qm.nbytes()}
        for key, v in self.variant(args, m, "tc", self.tgroups).items():
            row[key.replace("tc_err", "rel_err")] = v
        return row

    def variant(self, args: argparse.Namespace, m: int, tag: str, groups: list | None = None) -> dict[str, Any]:
        """exl2_tc under the launch table in force: {tag}_us and {tag}_err against the old kernel's output."""
        from exlpy.kernels import exl2_tc

        groups = groups or [exl2_tc.TcGroup([q], None) for q in self.mats]
        x, y = self.x[m], self.y_old[m]
        t = guarded(f"{tag} M={m}", timed, args.reps, len(self.mats), lambda: [g.run(x) for g in groups])
        err = guarded("check", lambda: ((groups[0].run(x).float() - y).abs().max() / y.abs().max()).item())
        return {f"{tag}_us": us_or_none(t), f"{tag}_err": err}
