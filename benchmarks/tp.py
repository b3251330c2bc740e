"""Tensor-parallel benchmark: correctness against one GPU, decode / prefill speed, memory over a long run.

    PYTHONPATH=. python benchmarks/tp.py --gpus 2 --out tp2.json
    PYTHONPATH=. python benchmarks/tp.py --gpus 4 --split 40,20,20,10 --out tp4.json

The model is 70B-layer-shaped (hidden 8192, intermediate 28672, 64 Q / 8 KV heads, head_dim 128), 8 layers,
fp16 random weights written once to /tmp. Single-GPU and TP runs happen in the same process, one after the
other. Collective backends are timed first (all-reduce of one decode token and of a 2048-token prefill; on two
GPUs also the copy collective, and how NCCL and the copy collective overlap a GEMM: the OVERLAP line). Prefill
2048 is timed four ways on the default TP model (one chunk or two micro-batches, with the decode backend's
all-reduce or EXLPY_TP_PREFILL_COMM=copy's): the PREFILL line.

Where the time goes (benchmarks/tp_diag.py): `single_phases` times the one-GPU prefill per module kind;
`sync_check` lists host syncs inside a TP prefill and a decode step; `top_kernels` lists the profiler's most
expensive kernels of one prefill (1 GPU and TP). Other collective backends are compared by reloading the
model with `RuntimeOptions(tp_comm=...)`.

It cannot hang: a watchdog writes what was measured so far and exits with status 124 after --timeout
seconds (Python stacks go to stderr first), and the torch.distributed probe has its own 60 s limit.

Each part is a module of benchmarks/tp_parts/ (model, collectives, gemm, timing, single, tp_run, summary); this
script is their command line and runs them in order.
"""


from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # NVLink multicast stays off (shared machines)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tp_diag import flop_model  # noqa: E402
from benchmarks.tp_parts.collectives import time_comm, time_dist, time_overlap  # noqa: E402
from benchmarks.tp_parts.gemm import gemm_shapes  # noqa: E402
from benchmarks.tp_parts.model import build_model  # noqa: E402
from benchmarks.tp_parts.single import single_run  # noqa: E402
from benchmarks.tp_parts.summary import ab_summary, prefill_summary, speedups  # noqa: E402
from benchmarks.tp_parts.tp_run import TPBench  # noqa: E402
from exlpy import ExLlamaV2Config  # noqa: E402
from exlpy.runtime import RuntimeOptions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", default="tp_results.json")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--mem-steps", type=int, default=3000)
    ap.add_argument("--timeout", type=float, default=570.0, help="watchdog: save and exit after this many s")
    ap.add_argument("--no-diag", action="store_true", help="skip the phase timing / sync / profiler diagnostics")
    ap.add_argument("--split", default="", help="uneven gpu_split (GB, comma separated) checked after the main run")
    ap.add_argument("--model", default="/tmp/exlpy_tp70b")
    ap.add_argument("--no-dist", action="store_true")
    ap.add_argument("--profile", action="store_true", help="top kernels of 10 decode steps, b1 and batched")
    ap.add_argument("--batch", type=int, default=32, help="also time batched decode (0: skip)")
    ap.add_argument("--column", action="store_true", help="also time the column (all-gather) layout")
    ap.add_argument("--all-comms", action="store_true", help="also reload with the local and host backends")
    ap.add_argument("--prefill-kernels", action="store_true",
                    help="the profiler's top kernels of one prefill 2048 per way (plain, pipelined, copy, ...)")
    args = ap.parse_args()
    n = args.gpus
    assert torch.cuda.device_count() >= n, f"needs {n} GPUs, {torch.cuda.device_count()} visible"
    res: dict = {"gpus": n, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    def save() -> None:
        Path(args.out).write_text(json.dumps(res, indent=1))

    def watchdog() -> None:
        time.sleep(args.timeout)
        res["timed_out"] = f"watchdog after {args.timeout:.0f} s in phase {res.get('phase')!r}"
        faulthandler.dump_traceback(all_threads=True)
        try:
            save()
            print("RESULT " + json.dumps(res), flush=True)
        finally:
            os._exit(124)

    threading.Thread(target=watchdog, daemon=True).start()

    t = time.perf_counter()
    res["phase"] = "build"
    path = build_model(Path(f"{args.model}_{args.layers}_{args.vocab}"), args.layers, args.vocab)
    res["build_s"] = round(time.perf_counter() - t, 1)
    res["phase"] = "collectives"
    time_comm(n, res)
    try:
        time_overlap(n, res)
        print("OVERLAP " + json.dumps(res.get("overlap_us")), flush=True)
    except Exception as e:  # noqa: BLE001 - a diagnostic must not cost the run
        res["overlap_us"] = f"failed: {e!r}"
    if not args.no_dist:
        time_dist(n, res)
    try:
        gemm_shapes(res, args.batch or 32)
        print("GEMM " + json.dumps(res["gemm_shapes"]), flush=True)
    except Exception as e:  # noqa: BLE001 - a diagnostic must not cost the run
        res["gemm_shapes"] = f"failed: {e!r}"
    print(json.dumps(res), flush=True)
    save()

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, args.vocab, (1, 128), generator=g)
    long_ids = torch.randint(3, args.vocab, (1, 2048), generator=g)

    cfg = ExLlamaV2Config(str(path))
    cfg.max_seq_len, cfg.max_input_len, cfg.max_attention_size = 4096, 2048, 2048**2
    res["flops"] = flop_model(cfg, 2048, n)
    ref = single_run(args, res, cfg, prompt, long_ids, save)
    bench = TPBench(args, res, n, path, prompt, long_ids, ref, save)
    bench.run(None, "tp", True)
    speedups(res, args.batch)
    try:
        res["ab"] = ab_summary(res, args.batch)
        print("AB " + json.dumps(res["ab"]), flush=True)
    except Exception as e:  # noqa: BLE001 - the summary must not cost the run's figures
        res["ab"] = f"summary failed: {e!r}"
    try:  # the prefill A/B (decode backend vs copy collective, one chunk vs two micro-batches) in one line
        res["prefill_ab"] = prefill_summary(res)
        print("PREFILL " + json.dumps(res["prefill_ab"]), flush=True)
    except Exception as e:  # noqa: BLE001 - the summary must not cost the run's figures
        res["prefill_ab"] = f"summary failed: {e!r}"
    save()
    if args.column:
        bench.run(None, "tp_column", False, RuntimeOptions(tp_layout="column"))
    if args.split:
        bench.run([float(x) for x in args.split.split(",")], "tp_uneven", False)
    res["phase"] = "done"
    print("RESULT " + json.dumps(res), flush=True)
    save()


if __name__ == "__main__":
    main()
