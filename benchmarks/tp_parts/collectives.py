"""The tensor-parallel benchmark's collective timings: every in-process backend's all-reduce of one decode token
and of a 2048-token prefill (on two GPUs also the copy collective, exlpy/parallel/tp_copy.py), how well NCCL and
the copy collective overlap a GEMM on the same GPUs, and torch.distributed NCCL in one process per GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from benchmarks.tp_parts.timing import sync_all
from exlpy.engine.lockstep import current_streams
from exlpy.parallel.tp_comm import HostComm, LocalComm, NcclComm, host_mem_comm, nccl_usable, peer_comm
from exlpy.parallel.tp_copy import CopyAllReduce


def host_mem_comm_ok(devs: list[torch.device]) -> bool:
    return host_mem_comm(devs, LocalComm()) is not None


def peer_comm_ok(devs: list[torch.device]) -> bool:
    return peer_comm(devs, LocalComm()) is not None


def time_comm(n: int, results: dict) -> None:
    devs = [torch.device("cuda", i) for i in range(n)]
    backends = [LocalComm(), HostComm()] + ([NcclComm()] if nccl_usable(devs) else [])
    peer = peer_comm(devs, NcclComm() if nccl_usable(devs) else LocalComm())
    backends += [peer] if peer is not None else []
    hostmem = host_mem_comm(devs, NcclComm() if nccl_usable(devs) else LocalComm())
    backends += [hostmem] if hostmem is not None else []
    if n == 2:
        try:
            backends.append(CopyAllReduce(devs))
        except Exception as e:  # noqa: BLE001 - no peer access: recorded, the others still timed
            results.setdefault("allreduce_us", {})["copy"] = f"unavailable: {e}"
    for rows, iters in ((1, 300), (2048, 20)):
        for be in backends:
            ts = [torch.randn(rows, 8192, device=d).half() for d in devs]
            for _ in range(3):
                be.all_reduce(ts)
            sync_all(n)
            t0 = time.perf_counter()
            for _ in range(iters):
                be.all_reduce(ts)
            sync_all(n)
            results.setdefault("allreduce_us", {})[f"{be.name}_{rows}x8192"] = round(
                (time.perf_counter() - t0) / iters * 1e6, 1)


def time_overlap(n: int, results: dict, rows: int = 1024, reps: int = 20) -> None:
    """results["overlap_us"]: per repetition on both GPUs, a GEMM of a prefill micro-batch's shape ([rows, 8192] x
    [8192, 3584], about as long as the all-reduce) alone, an all-reduce of [rows, 8192] fp16 alone, and the two
    issued together (the all-reduce on a side stream): NCCL's kernels against the copy collective's copy engines.
    Perfect overlap takes max(gemm, all-reduce); none, their sum."""
    devs = [torch.device("cuda", i) for i in range(n)]
    if n != 2 or not nccl_usable(devs):
        return
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, 8192, generator=g).half().to(d) for d in devs]
    a = [torch.randn(rows, 8192, generator=g).half().to(d) for d in devs]
    w = [torch.randn(8192, 3584, generator=g).half().to(d) for d in devs]
    nccl, side = NcclComm(), {str(d): torch.cuda.Stream(d) for d in devs}
    copy = CopyAllReduce(devs)

    def gemm() -> None:
        for i, d in enumerate(devs):
            with torch.cuda.device(d):
                torch.mm(a[i], w[i])

    def nccl_side() -> None:
        with current_streams(side, join=True):
            nccl.all_reduce(xs)

    def both_nccl() -> None:
        with current_streams(side):
            nccl.all_reduce(xs)
        gemm()
        for d in devs:
            torch.cuda.current_stream(d).wait_stream(side[str(d)])

    def both_copy() -> None:
        pending = copy.start(xs)
        gemm()
        pending.finish()

    def timed(fn) -> float:  # noqa: ANN001
        for _ in range(3):
            fn()
        sync_all(n)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync_all(n)
        return round((time.perf_counter() - t0) / reps * 1e6, 1)

    results["overlap_us"] = {"rows": rows, "gemm": timed(gemm), "nccl": timed(nccl_side),
                             "gemm+nccl": timed(both_nccl), "copy": timed(lambda: copy.all_reduce(xs)),
                             "gemm+copy": timed(both_copy)}


DIST_WORKER = r"""
import os, sys, time, json, datetime, torch, torch.distributed as dist
rank, world = int(sys.argv[1]), int(sys.argv[2])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", rank))
out = {}
for rows, iters in ((1, 300), (2048, 20)):
    t = torch.randn(rows, 8192, device="cuda").half()
    for _ in range(5): dist.all_reduce(t)
    torch.cuda.synchronize(); dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters): dist.all_reduce(t)
    torch.cuda.synchronize()
    out[f"dist_{rows}x8192"] = round((time.perf_counter() - t0) / iters * 1e6, 1)
if rank == 0: print("DIST " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def time_dist(n: int, results: dict) -> None:
    """torch.distributed NCCL, one process per GPU (a 60 s timeout guards against hangs)."""
    procs = [subprocess.Popen([sys.executable, "-c", DIST_WORKER, str(r), str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(n)]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        results["allreduce_us"]["dist"] = "timed out"
        return
    for line in outs[0].splitlines():
        if line.startswith("DIST "):
            results["allreduce_us"].update(json.loads(line[5:]))
            return
    results["allreduce_us"]["dist"] = "failed: " + outs[0][-300:]
