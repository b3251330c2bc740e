"""exl2_speed part `sweep`: exl2_qmm launch parameters on gate|up-sized 4-bit and down-sized mixed matrices."""

from __future__ import annotations

import argparse
import gc

import torch

from benchmarks.exl2_speed_parts.common import copies, fmt_us, guarded, log, random_matrix, timed


def _sweep_shape(args: argparse.Namespace, res: dict, k: int, n: int, mix: str, configs: list[dict]) -> None:
    from exlpy.kernels import exl2_qmm

    base = dict(exl2_qmm.CONFIG)
    qm = guarded("build", random_matrix, k, n, mix, torch.device("cuda"))
    if qm is None:
        return
    mats = copies(qm, 300 << 20)
    try:
        for m in (8, 32, 64):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            for cfg in configs:
                exl2_qmm.CONFIG.clear()
                exl2_qmm.CONFIG.update({**base, **cfg})
                groups = [exl2_qmm.QmmGroup([q], None) for q in mats]
                t = guarded(f"{cfg}", timed, args.reps, len(mats),
                            lambda x=x, groups=groups: [g.run(x) for g in groups])
                name = ",".join(f"{a}={b}" for a, b in cfg.items()) or "default"
                res.setdefault("sweep", {})[f"{k}x{n} {mix} M{m} {name}"] = t and t * 1e6
                log(f"sweep {k}x{n} {mix} M={m} {name:28s} {fmt_us(t)}"
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
