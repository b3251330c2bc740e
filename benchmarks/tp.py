"""Tensor-parallel benchmark: correctness against one GPU, decode / prefill speed, memory over a long run.

    PYTHONPATH=. python benchmarks/tp.py --gpus 2 --out tp2.json
    PYTHONPATH=. python benchmarks/tp.py --gpus 4 --split 40,20,20,10 --out tp4.json

The model is 70B-layer-shaped (hidden 8192, intermediate 28672, 64 Q / 8 KV heads, head_dim 128), 8 layers,
fp16 random weights written once to /tmp. Single-GPU and TP runs happen in the same process, one after the
other. Collective backends are timed first (all-reduce of one decode token and of a 2048-token prefill).

Where the time goes (benchmarks/tp_diag.py): `single_phases` times the one-GPU prefill per module kind;
`sync_check` lists host syncs inside a TP prefill and a decode step; `top_kernels` lists the profiler's most
expensive kernels of one prefill (1 GPU and TP). Other collective backends are compared by reloading the
model with `RuntimeOptions(tp_comm=...)`.

It cannot hang: a watchdog writes what was measured so far and exits with status 124 after --timeout
seconds (Python stacks go to stderr first), and the torch.distributed probe has its own 60 s limit.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # NVLink multicast stays off (shared machines)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tp_diag import flop_model, single_phases, sync_check, top_kernels  # noqa: E402
from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config  # noqa: E402
from exlpy.cache.tp import ExLlamaV2Cache_TP  # noqa: E402
from exlpy.model.parallel_linear import RowParallel  # noqa: E402
from exlpy.parallel.tp_comm import (  # noqa: E402
    HostComm,
    LocalComm,
    NcclComm,
    host_mem_comm,
    nccl_usable,
    peer_comm,
)
from exlpy.runtime import RuntimeOptions  # noqa: E402


def build_model(path: Path, layers: int, vocab: int, hidden: int = 8192, inter: int = 28672, heads: int = 64,
                kv: int = 8, hd: int = 128) -> Path:
    from safetensors.torch import save_file

    if (path / "done").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator(device="cuda:0").manual_seed(0)

    def r(*shape: int, std: float = 0.01) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda:0", dtype=torch.float16) * std).cpu()

    # One random layer reused for every layer keeps the build fast; the benchmark only needs the shapes.
    layer = {"input_layernorm.weight": torch.ones(hidden, dtype=torch.float16),
             "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.float16),
             "self_attn.q_proj.weight": r(heads * hd, hidden), "self_attn.k_proj.weight": r(kv * hd, hidden),
             "self_attn.v_proj.weight": r(kv * hd, hidden), "self_attn.o_proj.weight": r(hidden, heads * hd),
             "mlp.gate_proj.weight": r(inter, hidden), "mlp.up_proj.weight": r(inter, hidden),
             "mlp.down_proj.weight": r(hidden, inter, std=0.006)}
    wmap = {}
    for i in range(layers):
        name = f"layer{i}.safetensors"
        save_file({f"model.layers.{i}.{k}": v for k, v in layer.items()}, str(path / name))
        wmap.update({f"model.layers.{i}.{k}": name for k in layer})
    save_file({"model.embed_tokens.weight": r(vocab, hidden, std=1.0), "model.norm.weight":
               torch.ones(hidden, dtype=torch.float16), "lm_head.weight": r(vocab, hidden)},
              str(path / "outer.safetensors"))
    wmap.update({k: "outer.safetensors" for k in ("model.embed_tokens.weight", "model.norm.weight",
                                                  "lm_head.weight")})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (path / "done").write_text("ok")
    return path


def host_mem_comm_ok(devs: list[torch.device]) -> bool:
    return host_mem_comm(devs, LocalComm()) is not None


def peer_comm_ok(devs: list[torch.device]) -> bool:
    return peer_comm(devs, LocalComm()) is not None


def sync_all(n: int) -> None:
    for i in range(n):
        torch.cuda.synchronize(i)


def time_comm(n: int, results: dict) -> None:
    devs = [torch.device("cuda", i) for i in range(n)]
    backends = [LocalComm(), HostComm()] + ([NcclComm()] if nccl_usable(devs) else [])
    peer = peer_comm(devs, NcclComm() if nccl_usable(devs) else LocalComm())
    backends += [peer] if peer is not None else []
    hostmem = host_mem_comm(devs, NcclComm() if nccl_usable(devs) else LocalComm())
    backends += [hostmem] if hostmem is not None else []
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


def gemm_shapes(results: dict, rows: int = 32) -> None:
    """cuBLAS at batched decode: GB/s of the 70B layer's GEMMs at `rows` rows, whole (one GPU) and as one TP x2
    rank holds them (q|k|v and gate|up with N halved, o_proj and down_proj with K halved), each timed over
    50 calls in a CUDA graph; the one-row GEMV kernel (ops.linear_add) beside them. Says whether the halved
    shapes lose efficiency (a TP rank's share of the step's matmul time then exceeds half)."""
    from exlpy.kernels import ops

    shapes = {"qkv": (10240, 8192), "gate_up": (57344, 8192), "o": (8192, 8192), "down": (8192, 28672)}
    out: dict = {}
    dev = torch.device("cuda", 0)
    for name, (N, K) in shapes.items():
        for tag, (n, k) in (("full", (N, K)), ("rank", (N // 2, K) if name in ("qkv", "gate_up") else (N, K // 2))):
            w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.01
            for r in (rows, 1):
                x = torch.randn(r, k, device=dev, dtype=torch.float16)
                fn = (lambda x=x, w=w: torch.nn.functional.linear(x, w)) if r > 1 else \
                    (lambda x=x, w=w: ops.linear_add(x, w))
                fn()
                torch.cuda.synchronize(dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(50):
                        fn()
                g.replay()
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                g.replay()
                torch.cuda.synchronize(dev)
                us = (time.perf_counter() - t0) / 50 * 1e6
                out[f"{name}_{tag}_m{r}"] = {"us": round(us, 1), "GBps": round(w.nbytes / us / 1e3, 0)}
            del w
    results["gemm_shapes"] = out


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


def decode_ms(model: ExLlamaV2, cache, prompt: torch.Tensor, steps: int, n: int) -> float:
    """ms per decode step of prompt.shape[0] rows, the argmax taken on the GPU and read back every step."""
    cache.current_seq_len = 0
    logits = model.forward(prompt, cache, last_id_only=True)
    tok = logits[:, -1:].argmax(-1).cpu()
    for _ in range(3):
        model.forward(tok, cache)
    sync_all(n)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = model.forward(tok, cache)[:, -1:].argmax(-1).cpu()  # a real sampling loop reads the token back
    sync_all(n)
    return (time.perf_counter() - t0) / steps * 1e3


def decode_fed_ms(model: ExLlamaV2, cache, prompt: torch.Tensor, steps: int, n: int) -> float:
    """ms per decode step when each step's argmax stays on the GPU and is the next step's input, the host
    reading every token one step late: the generators' overlapped loop (sampling on the device)."""
    cache.current_seq_len = 0
    tok = model.forward(prompt, cache, last_id_only=True)[:, -1:].argmax(-1)
    for _ in range(3):
        tok = model.forward(tok, cache)[:, -1:].argmax(-1)
    sync_all(n)
    t0 = time.perf_counter()
    prev = None
    for _ in range(steps):
        nxt = model.forward(tok, cache)[:, -1:].argmax(-1)
        if prev is not None:
            prev.cpu()  # step k-1's token, while step k runs
        prev, tok = tok, nxt
    sync_all(n)
    return (time.perf_counter() - t0) / steps * 1e3


def prefill_ms(model: ExLlamaV2, cache, ids: torch.Tensor, n: int) -> float:
    cache.current_seq_len = 0
    model.forward(ids, cache, preprocess_only=True)
    sync_all(n)
    best = 1e9
    for _ in range(3):
        cache.current_seq_len = 0
        sync_all(n)
        t0 = time.perf_counter()
        model.forward(ids, cache, last_id_only=True)
        sync_all(n)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def profile_steps(model: ExLlamaV2, cache, prompt: torch.Tensor, n: int, steps: int = 10) -> list[dict]:
    """The most expensive kernels of `steps` captured decode steps (device-fed), summed over the GPUs."""
    cache.current_seq_len = 0
    tok = model.forward(prompt, cache, last_id_only=True)[:, -1:].argmax(-1)
    tok = model.forward(tok, cache)[:, -1:].argmax(-1)

    def run() -> None:
        t = tok
        for _ in range(steps):
            t = model.forward(t, cache)[:, -1:].argmax(-1)

    return top_kernels(run, n, rows=16)


def ab_summary(res: dict, batch: int) -> dict:
    """Per collective backend of the TP run (the default one chosen at load, then each reloaded one): decode
    b1 (read each step / fed), decode b`batch` and prefill 2048 in ms, with the speed-up over one GPU."""
    tp = res["tp"]
    keys = {"b1": ("decode_ms_graphs", "decode_ms_{}", "single_decode_ms"),
            "b1_fed": ("decode_fed_ms", "decode_fed_ms_{}", "single_decode_fed_ms"),
            f"b{batch}": (f"decode_b{batch}_ms", f"decode_b{batch}_ms_{{}}", f"single_decode_b{batch}_ms"),
            "prefill2048": ("prefill2048_ms", "prefill2048_ms_{}", "single_prefill2048_ms"),
            "prefill2048_pipelined": ("prefill2048_ms_pipelined", "-", "single_prefill2048_ms")}
    names = [tp["comm"]] + [k[len("decode_ms_"):] for k in tp if k.startswith("decode_ms_")
                            and k not in ("decode_ms_graphs", "decode_ms_eager")]
    out: dict = {"default": tp["comm"], "load_timings_us": tp.get("comm_timings_us")}
    for name in names:
        row = {}
        for label, (own, other, single) in keys.items():
            v = tp.get(own if name == tp["comm"] else other.format(name) if other != "-" else "-")
            if v is not None and res.get(single):
                row[label] = [v, round(res[single] / v, 2)]
        out[name] = row
    return out


def ctx_devs(ctx) -> list[torch.device]:  # noqa: ANN001
    return [ctx.all_devs[s] for s in ctx.all_devices()]


def mem(n: int) -> list[dict]:
    return [{"alloc_MiB": round(torch.cuda.memory_allocated(i) / 2**20, 1),
             "max_MiB": round(torch.cuda.max_memory_allocated(i) / 2**20, 1)} for i in range(n)]


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
    res["phase"] = "single"
    single = ExLlamaV2(cfg)
    single.load([200])
    ref = single.forward(prompt[:, :64]).float()
    cache = ExLlamaV2Cache(single, max_seq_len=4096)
    res["single_decode_ms"] = round(decode_ms(single, cache, prompt, args.steps, 1), 3)
    res["single_prefill2048_ms"] = round(prefill_ms(single, cache, long_ids, 1), 2)
    res["single_decode_fed_ms"] = round(decode_fed_ms(single, cache, prompt, args.steps, 1), 3)
    if args.profile:
        res["single_b1_kernels"] = profile_steps(single, cache, prompt, 1)
    if args.batch:
        cb = ExLlamaV2Cache(single, batch_size=args.batch, max_seq_len=512)
        res[f"single_decode_b{args.batch}_ms"] = round(decode_ms(single, cb, prompt.repeat(args.batch, 1),
                                                                 args.steps // 2, 1), 3)
        res[f"single_decode_fed_b{args.batch}_ms"] = round(decode_fed_ms(single, cb, prompt.repeat(args.batch, 1),
                                                                         args.steps // 2, 1), 3)
        if args.profile:
            res[f"single_b{args.batch}_kernels"] = profile_steps(single, cb, prompt.repeat(args.batch, 1), 1)
        del cb
    if not args.no_diag:
        res["single_prefill_phases"] = single_phases(single, cache, long_ids)
        res["single_prefill_top_kernels"] = top_kernels(
            lambda c=cache: single.forward(long_ids, c, last_id_only=True), 1)
        cache.current_seq_len = 0
    print(json.dumps(res), flush=True)
    save()
    del cache
    single.unload()
    torch.cuda.empty_cache()

    def tp_diag(m: ExLlamaV2, c: ExLlamaV2Cache_TP, out: dict) -> None:
        """Per-stage timing of prefill (eager loop) and graph decode, host syncs, top kernels."""

        def prefill() -> None:
            c.current_seq_len = 0
            m.forward(long_ids, c, last_id_only=True)

        res["phase"] = "tp_diag"
        c.current_seq_len = 0
        m.forward(prompt, c, preprocess_only=True)
        tok = prompt[:, -1:]
        m.forward(tok, c)  # graphs captured

        def step() -> None:
            m.forward(tok, c)

        out["sync_check_prefill"] = sync_check(prefill, n)
        out["sync_check_decode"] = sync_check(step, n)
        out["prefill_top_kernels"] = top_kernels(prefill, n)

    def load(split: list[float] | None, opts: RuntimeOptions | None = None) -> ExLlamaV2:
        cfg2 = ExLlamaV2Config(str(path))
        cfg2.max_seq_len, cfg2.max_input_len, cfg2.max_attention_size = 4096, 2048, 2048**2
        m = ExLlamaV2(cfg2)
        m.load_tp(split, expect_cache_tokens=4096, options=opts)
        return m

    def tp_run(split: list[float] | None, tag: str, full: bool, opts: RuntimeOptions | None = None) -> None:
        res["phase"] = tag
        m = load(split, opts)
        ctx = m.tp_context
        closer = m.strategy.stages[0].lanes[0].modules[1].o_proj
        out = {"kv_split": ctx.kv_split, "id_split": ctx.id_split, "vc_split": ctx.vc_split,
               "comm": ctx.comm.name, "mode": "row" if isinstance(closer, RowParallel) else "column",
               "graphs": m.strategy.graph_safe}
        res[tag] = out  # filled in as it goes: a watchdog exit still saves the partial figures
        tp_logits = m.forward(prompt[:, :64]).float()
        out["max_abs_diff"] = round((tp_logits.cpu() - ref.cpu()).abs().max().item(), 4)
        out["ref_absmax"] = round(ref.abs().max().item(), 3)
        out["argmax_agree"] = float((tp_logits.argmax(-1).cpu() == ref.argmax(-1).cpu()).float().mean())
        c = ExLlamaV2Cache_TP(m, max_seq_len=4096)
        try:
            out["decode_ms_graphs"] = round(decode_ms(m, c, prompt, args.steps, n), 3)
        except Exception:  # noqa: BLE001 - record and go on with eager decode
            import traceback

            out["graph_error"] = traceback.format_exc()[-1500:]
            print(out["graph_error"], flush=True)
            m.config.no_graphs = True
            out["decode_ms_graphs"] = round(decode_ms(m, c, prompt, args.steps, n), 3)
        # Graph decode equals eager decode (same cache state, same token).
        c.current_seq_len = 0
        m.forward(prompt, c, preprocess_only=True)
        tok = prompt[:, -1:]
        lg = m.forward(tok, c)
        c.current_seq_len -= 1
        no_graphs, m.config.no_graphs = m.config.no_graphs, True
        le = m.forward(tok, c)
        out["graph_vs_eager_maxdiff"] = round((lg - le).abs().max().item(), 4)
        if full:
            out["decode_ms_eager"] = round(decode_ms(m, c, prompt, args.steps // 2, n), 3)
        m.config.no_graphs = no_graphs
        out["prefill2048_ms"] = round(prefill_ms(m, c, long_ids, n), 2)
        # A/B: the same model with its prefill chunks as two overlapped micro-batches (EXLPY_TP_PIPELINE),
        # and the last position's logits of both ways (they differ only by summation order).
        overlap = m.strategy.overlap_prefill
        try:
            c.current_seq_len = 0
            m.strategy.overlap_prefill = False
            plain_last = m.forward(long_ids, c, last_id_only=True).float()
            m.strategy.overlap_prefill = True
            out["prefill2048_ms_pipelined"] = round(prefill_ms(m, c, long_ids, n), 2)
            c.current_seq_len = 0
            piped_last = m.forward(long_ids, c, last_id_only=True).float()
            out["pipelined_vs_plain_maxdiff"] = round((piped_last - plain_last).abs().max().item(), 4)
        except Exception:  # noqa: BLE001 - record and go on
            import traceback

            out["pipeline_error"] = traceback.format_exc()[-1500:]
            print(out["pipeline_error"], flush=True)
        finally:
            m.strategy.overlap_prefill = overlap
        out["decode_fed_ms"] = round(decode_fed_ms(m, c, prompt, args.steps, n), 3)
        if args.profile and full:
            out["b1_kernels"] = profile_steps(m, c, prompt, n)
        if args.batch:
            cb = ExLlamaV2Cache_TP(m, batch_size=args.batch, max_seq_len=512)
            out[f"decode_b{args.batch}_ms"] = round(decode_ms(m, cb, prompt.repeat(args.batch, 1), args.steps // 2,
                                                              n), 3)
            out[f"decode_fed_b{args.batch}_ms"] = round(decode_fed_ms(m, cb, prompt.repeat(args.batch, 1),
                                                                      args.steps // 2, n), 3)
            if args.profile and full:
                out[f"b{args.batch}_kernels"] = profile_steps(m, cb, prompt.repeat(args.batch, 1), n)
            del cb
            # A/B of the next norm fused into the all-reduce (host-memory backend): unlinked, graphs recaptured
            closers = [cl for lane in m.strategy.stages[0].lanes for mod in lane.modules
                       for cl in (getattr(mod, "o_proj", None), getattr(mod, "down_proj", None))
                       if isinstance(cl, RowParallel) and cl.next_norm is not None]
            out["fused_norm_closers"] = len(closers)
            if closers:
                links = [c.next_norm for c in closers]
                for cl in closers:
                    cl.next_norm = None
                try:
                    cb = ExLlamaV2Cache_TP(m, batch_size=args.batch, max_seq_len=512)
                    out[f"decode_b{args.batch}_ms_unfused_norm"] = round(
                        decode_ms(m, cb, prompt.repeat(args.batch, 1), args.steps // 4, n), 3)
                    del cb
                finally:
                    for cl, link in zip(closers, links):
                        cl.next_norm = link
        out["comm_timings_us"] = {k: round(v * 1e6, 1) for k, v in (ctx.comm.timings or {}).items()}
        print(json.dumps({tag: out}), flush=True)
        save()
        if full and not args.no_diag:
            try:
                tp_diag(m, c, out)
            except Exception:  # noqa: BLE001 - diagnostics must not cost the speed figures
                import traceback

                out["diag_error"] = traceback.format_exc()[-1500:]
            print(json.dumps({tag: out}), flush=True)
            save()
            res["phase"] = tag
        if full:
            # A/B in the same process: the same model reloaded with each other backend that works here (the
            # old default NCCL against the host-memory / peer kernels), decode b1 and batched, and prefill.
            default = ctx.comm.name
            devs = ctx_devs(ctx)
            others = [x for x, ok in (("nccl", nccl_usable(devs)), ("hostmem", host_mem_comm_ok(devs)),
                                      ("peer", peer_comm_ok(devs))) if ok and x != default]
            others += ["local", "host"] if args.all_comms else []
            for name in others:
                m2 = None
                try:
                    del c
                    m.unload()
                    m2 = load(split, RuntimeOptions(tp_comm=name))
                    c2 = ExLlamaV2Cache_TP(m2, max_seq_len=4096)
                    out[f"decode_ms_{name}"] = round(decode_ms(m2, c2, prompt, args.steps // 2, n), 3)
                    out[f"decode_fed_ms_{name}"] = round(decode_fed_ms(m2, c2, prompt, args.steps // 2, n), 3)
                    out[f"prefill2048_ms_{name}"] = round(prefill_ms(m2, c2, long_ids, n), 2)
                    del c2
                    if args.batch:
                        cb = ExLlamaV2Cache_TP(m2, batch_size=args.batch, max_seq_len=512)
                        out[f"decode_b{args.batch}_ms_{name}"] = round(
                            decode_ms(m2, cb, prompt.repeat(args.batch, 1), args.steps // 4, n), 3)
                        del cb
                    print(json.dumps({tag: out}), flush=True)
                    save()
                finally:
                    if m2 is not None:
                        m2.unload()
                m = load(split, opts)
                c = ExLlamaV2Cache_TP(m, max_seq_len=4096)
            if args.mem_steps:
                c.current_seq_len = 0
                m.forward(prompt, c)
                tok = prompt[:, -1:]
                m.forward(tok, c)
                sync_all(n)
                for i in range(n):
                    torch.cuda.reset_peak_memory_stats(i)
                start = mem(n)
                t0 = time.perf_counter()
                for _ in range(args.mem_steps):
                    if c.current_seq_len >= 4000:
                        c.current_seq_len = 128  # wrap inside the cache: the step itself is what is measured
                    tok = m.forward(tok, c)[:, -1:].argmax(-1).cpu()
                sync_all(n)
                out["mem_steps"] = args.mem_steps
                out["mem_steps_s"] = round(time.perf_counter() - t0, 1)
                out["mem_start"], out["mem_end"] = start, mem(n)
        res[tag] = out
        print(json.dumps({tag: out}), flush=True)
        save()
        del c
        m.unload()
        torch.cuda.empty_cache()

    tp_run(None, "tp", True)
    res["speedup_decode"] = round(res["single_decode_ms"] / res["tp"]["decode_ms_graphs"], 2)
    res["speedup_prefill"] = round(res["single_prefill2048_ms"] / res["tp"]["prefill2048_ms"], 2)
    if args.batch and f"decode_b{args.batch}_ms" in res["tp"]:
        res[f"speedup_decode_b{args.batch}"] = round(res[f"single_decode_b{args.batch}_ms"]
                                                     / res["tp"][f"decode_b{args.batch}_ms"], 2)
    res["speedup_decode_fed"] = round(res["single_decode_fed_ms"] / res["tp"]["decode_fed_ms"], 2)
    if args.batch and f"decode_fed_b{args.batch}_ms" in res["tp"]:
        res[f"speedup_decode_fed_b{args.batch}"] = round(res[f"single_decode_fed_b{args.batch}_ms"]
                                                         / res["tp"][f"decode_fed_b{args.batch}_ms"], 2)
    try:
        res["ab"] = ab_summary(res, args.batch)
        print("AB " + json.dumps(res["ab"]), flush=True)
    except Exception as e:  # noqa: BLE001 - the summary must not cost the run's figures
        res["ab"] = f"summary failed: {e!r}"
    save()
    if args.column:
        tp_run(None, "tp_column", False, RuntimeOptions(tp_layout="column"))
    if args.split:
        tp_run([float(x) for x in args.split.split(",")], "tp_uneven", False)
    res["phase"] = "done"
    print("RESULT " + json.dumps(res), flush=True)
    save()


if __name__ == "__main__":
    main()
