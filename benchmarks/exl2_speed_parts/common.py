"""What the parts of benchmarks/exl2_speed.py share: logging, failure-proof calls, random packed matrices
and their rotating copies, CUDA-graph timing, number formats."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from benchmarks.quant_matmul import graph_time  # (median of CUDA-graph replays)


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


def copies(qm: Any, total_bytes: int) -> list[Any]:
    n = max(1, min(24, total_bytes // qm.nbytes()))
    out = [qm]
    for _ in range(n - 1):
        out.append(replace(qm, q_weight=qm.q_weight.clone(), scales=qm.scales.clone()))
    return out


def timed(reps: int, per: int, fn: Callable[[], Any]) -> float:
    return graph_time(fn, reps) / per


def fmt_us(t: float | None) -> str:
    return f"{t * 1e6:8.1f} us" if t else "       - us"


def us_or_none(t: float | None) -> float | None:
    return t * 1e6 if t else None


def fmt_e(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def fmt_f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def shape_matrix(part: str, k: int, n: int, mix: str) -> tuple[str, Any, list[Any]] | None:
    """(its key "KxN mix", a random packed matrix of the shape on the GPU, its rotating copies over 300 MB) for a
    part's case, announced as `part key`; None when building failed (reported)."""
    key = f"{k}x{n} {mix}"
    log(f"{part} {key}")
    qm = guarded("build", random_matrix, k, n, mix, torch.device("cuda"), mix == "gptq")
    if qm is None:
        return None
    return key, qm, copies(qm, 300 << 20)
