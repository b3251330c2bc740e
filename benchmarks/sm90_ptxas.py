"""Registers and spills of a kernel's PTX as Triton's bundled ptxas reports them for an H100 (sm_90a), no GPU
needed; shared by benchmarks/flash_compile_check.py and benchmarks/lora_compile_check.py."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def ptxas_report(ptx: str) -> dict[str, int]:
    """{"regs": registers per thread, "spill_bytes": spill stores + loads}; -1 where ptxas printed no figure."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                           capture_output=True, text=True)
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    return {"regs": int(regs[0]) if regs else -1,
            "spill_bytes": sum(int(a) + int(b) for a, b in spill) if spill else -1}


_JOBS: list = []  # the pending compiles of `compile_parallel`, inherited by its forked workers


def _run_job(i: int) -> dict:
    fn, args = _JOBS[i]
    return fn(*args)


def compile_parallel(jobs: dict[str, tuple]) -> dict[str, dict]:
    """{name: fn(*args)} for jobs {name: (fn, *args)}, in forked worker processes (EXLPY_COMPILE_WORKERS, default
    one per CPU up to 16). A Triton compile is CPU-bound and single-threaded: a check compiling dozens of variants
    one after another took over 280 s beside a busy test session (H100 x2, 2026-11-27). Kernels are passed by
    index, not pickled: the workers inherit the job list at fork (no CUDA is initialised here)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    names = list(jobs)
    workers = int(os.environ.get("EXLPY_COMPILE_WORKERS") or min(len(names), os.cpu_count() or 1, 16))
    if workers <= 1 or len(names) <= 1:
        return {n: jobs[n][0](*jobs[n][1:]) for n in names}
    _JOBS[:] = [(jobs[n][0], jobs[n][1:]) for n in names]
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
            futures = [ex.submit(_run_job, i) for i in range(len(names))]
            return {n: f.result() for n, f in zip(names, futures)}
    finally:
        _JOBS.clear()
