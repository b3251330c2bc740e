"""Decode/prefill benchmark on one GPU: exlpy vs HF transformers on random-weight models of real shapes.

python benchmarks/decode.py --work /tmp/exlpy_bench --out results.md [--models 8b,1b,exl2,smol]
    [--hf eager,compile] [--smollm DIR] [--profile]
Builds the models on the GPU machine (safetensors shards under --work, reused when present), checks that
graph replay equals the eager step, times exlpy and then HF (each HF mode in a subprocess with a time cap),
and writes a markdown table: tokens/s and the fraction of the measured copy-bandwidth limit.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_models import write_model  # noqa: E402
from paged import time_paged_decode  # noqa: E402

from exlpy.cli.bench import copy_bandwidth, load_model, time_decode, time_prefill  # noqa: E402

MODELS = {  # key: (shape, EXL2 bits or 0 for fp16, label)
    "8b": ("llama3-8b", 0, "Llama-3-8B shape, fp16"),
    "1b": ("llama3.2-1b", 0, "Llama-3.2-1B shape, fp16"),
    "exl2": ("llama3-8b", 4, "Llama-3-8B shape, EXL2 4.0 bpw (head 6)"),
    "smol": ("smollm2-135m", 4, "SmolLM2-135M shape, EXL2 4.0 bpw (head 6), random codes"),
}


def graph_matches_eager(model, prompt_len: int = 64, steps: int = 4) -> float:
    """Max |logits| difference between graph replay and the eager step over a few greedy steps."""
    from exlpy import ExLlamaV2Cache

    caches = [ExLlamaV2Cache(model, batch_size=2, max_seq_len=prompt_len + steps) for _ in range(2)]
    ids = torch.randint(0, model.config.vocab_size, (2, prompt_len), device="cuda")
    for c in caches:
        model.forward(ids, c, preprocess_only=True)
    tok, worst = ids[:, -1:], 0.0
    for _ in range(steps):
        model.config.no_graphs = True
        ref = model.forward(tok, caches[0])
        model.config.no_graphs = False
        out = model.forward(tok, caches[1])
        worst = max(worst, (out - ref).abs().max().item() / ref.abs().max().item())
        tok = ref[:, -1].argmax(-1, keepdim=True)
    return worst


def profile_step(model, label: str, batch: int = 1, ctx: int = 512) -> str:
    """Top GPU kernels of 5 eager and 5 graph decode steps (where the time goes)."""
    from torch.profiler import ProfilerActivity, profile

    from exlpy import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, batch_size=batch, max_seq_len=ctx + 16)
    cache.current_seq_len = ctx
    tok = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    out = []
    for graphs in (False, True):
        model.config.no_graphs = not graphs
        for _ in range(3):
            model.forward(tok, cache)
            cache.current_seq_len = ctx
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                model.forward(tok, cache)
                cache.current_seq_len = ctx
            torch.cuda.synchronize()
        out.append(f"--- {label} batch {batch} {'graph' if graphs else 'eager'} (5 steps)\n"
                   + prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    model.config.no_graphs = False
    return "\n".join(out)


def run_hf(model_dir: str, mode: str, prompt_len: int, gen_len: int, timeout: int) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "hf_bench.py"), "--model", model_dir, "--mode", mode,
           "--prompt-len", str(prompt_len), "--gen-len", str(gen_len)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {timeout} s (capped)"}
    if p.returncode != 0:
        return {"mode": mode, "error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "failed"}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["wall_s"] = time.perf_counter() - t0
    return r


def bench_model(key: str, d: str, label: str, args: argparse.Namespace, row, lines: list[str],
                extra: list[str]) -> None:
    model = load_model(d, max(args.prompt_len + args.gen_len + 64, args.prefill), max(1, args.batched))
    try:
        err = graph_matches_eager(model)
        extra.append(f"- {label}: graph replay vs eager step, max |Δlogits| / max |logits| = {err:.2e}")
        r = time_decode(model, 1, args.prompt_len, args.gen_len)
        row(label, f"decode b1, {args.prompt_len}+{args.gen_len}, graphs", r)
        model.config.no_graphs = True
        r = time_decode(model, 1, args.prompt_len, min(args.gen_len, 64))
        row(label, f"decode b1, {args.prompt_len}+{min(args.gen_len, 64)}, eager", r)
        model.config.no_graphs = False
        if key in ("8b", "1b") and args.prefill:
            tps = time_prefill(model, args.prefill)
            lines.append(f"| {label} | prefill {args.prefill} tokens | {tps:,.0f} | – | – | – | one forward |")
            print(lines[-1], flush=True)
        if key == "8b" and args.batched:
            r = time_paged_decode(model, args.batched, args.prompt_len, 64)
            row(label, f"paged decode b{args.batched}, ctx {args.prompt_len}+64, graphs", r,
                "total tokens/s; K/V of all sequences counted")
        if args.profile and key in ("8b", "exl2"):
            extra.append("```\n" + profile_step(model, label) + "\n```")
    finally:
        model.unload()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/exlpy_bench")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "decode_run.md"))
    ap.add_argument("--models", default="8b,1b,exl2,smol")
    ap.add_argument("--hf", default="eager,compile", help="HF modes for the 8B fp16 model ('' for none)")
    ap.add_argument("--hf-gen-len", type=int, default=64, help="HF eager tokens (it runs ~14 tok/s)")
    ap.add_argument("--hf-timeout", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--batched", type=int, default=32, help="concurrent sequences for the paged decode (0: skip)")
    ap.add_argument("--smollm", default=None, help="a real SmolLM2-135M EXL2 directory to time as well")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    bw = copy_bandwidth()
    dev_name = torch.cuda.get_device_name()
    lines = [f"## Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {dev_name}", "",
             f"Command: `python benchmarks/decode.py {' '.join(sys.argv[1:])}`  ",
             f"torch {torch.__version__}; measured copy bandwidth {bw / 1e12:.2f} TB/s (the limit used below).",
             "", "| model | what | tokens/s | ms/step | achieved TB/s | of limit | notes |",
             "|---|---|---|---|---|---|---|"]
    extra: list[str] = []

    def row(label: str, what: str, r, note: str = "") -> None:
        lines.append(f"| {label} | {what} | {r.tokens_per_s:,.1f} | {1e3 * r.seconds / r.gen_len:.3f} | "
                     f"{r.bandwidth() / 1e12:.2f} | {r.bandwidth() / bw:.1%} | {note} |")
        print(lines[-1], flush=True)

    dirs = {}
    for key in args.models.split(","):
        if not key:
            continue
        shape, bits, label = MODELS[key]
        t0 = time.perf_counter()
        d = write_model(os.path.join(args.work, f"{shape}-{bits or 16}"), shape, exl2_bits=bits)
        dirs[key] = d
        print(f"{label}: weights ready in {time.perf_counter() - t0:.0f} s", flush=True)
        try:
            bench_model(key, d, label, args, row, lines, extra)
        except Exception as e:  # e.g. a kernel not there yet: report it and go on with the other models
            lines.append(f"| {label} | – | – | – | – | – | failed: {type(e).__name__}: {str(e)[:200]} |")
            print(lines[-1], flush=True)
        gc.collect()
        torch.cuda.empty_cache()

    if args.smollm:
        model = load_model(args.smollm, args.prompt_len + args.gen_len + 64)
        r = time_decode(model, 1, min(args.prompt_len, 256), args.gen_len)
        row("SmolLM2-135M EXL2 (real weights)", f"decode b1, {min(args.prompt_len, 256)}+{args.gen_len}", r)
        model.unload()

    if "8b" in dirs:
        for mode in [m for m in args.hf.split(",") if m]:
            gen = args.hf_gen_len if mode == "eager" else args.gen_len
            r = run_hf(dirs["8b"], mode, args.prompt_len, gen, args.hf_timeout)
            if "error" in r:
                lines.append(f"| HF transformers, 8B fp16 | {mode} | – | – | – | – | {r['error']} |")
            else:
                lines.append(f"| HF transformers, 8B fp16 | decode b1 {mode}, {args.prompt_len}+{gen} | "
                             f"{r['tokens_per_s']:,.1f} | {1e3 / r['tokens_per_s']:.3f} | – | – | "
                             f"compile/warm-up {r['compile_s']:.0f} s |")
            print(lines[-1], flush=True)

    text = "\n".join(lines + [""] + extra) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
