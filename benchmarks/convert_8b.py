"""Speed and memory of the EXL2 converter on a Llama-3-8B-shaped model (random fp16 weights, HF layout), 4.0 bpw,
measurement included, on one GPU. Targets (issue 34): whole job <= 12 min, GPU memory <= 24 GB, host <= 32 GB.

    python benchmarks/convert_8b.py --work /tmp/cv8b [--budget 540] [--quick] [--out benchmarks/results/convert.md]

The job is resumable, so the benchmark fits commands of limited length: each call runs the converter in a child
process for at most --budget seconds (SIGTERM then; the job keeps its last per-layer checkpoint) and appends
what it measured; call it again until it prints "finished". Stage times are summed from the job file over all
calls; per-module times let a partial run extrapolate (printed each call). --quick: a 2-layer model of the same
widths (fast check of the whole path).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHARED_TOK = os.path.join(os.path.dirname(ROOT), "shared", "tokenizers", "llama3")


def build_model(path: str, shape_name: str, layers: int | None) -> None:
    import make_models

    shape = dict(make_models.SHAPES[shape_name])
    if layers:
        make_models.SHAPES[f"{shape_name}-{layers}l"] = dict(shape, num_hidden_layers=layers)
        make_models.write_model(path, f"{shape_name}-{layers}l")
    else:
        make_models.write_model(path, shape_name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(SHARED_TOK, name)) and not os.path.exists(os.path.join(path, name)):
            shutil.copy(os.path.join(SHARED_TOK, name), os.path.join(path, name))


def child(argv: list[str]) -> None:
    """Runs the conversion; on SIGTERM or at the end writes this process's peaks next to the job."""
    import torch

    from exlpy.convert.args import add_arguments, run
    from exlpy.convert.progress import peak_memory

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(argv)
    peaks_file = os.path.join(a.out_dir, "bench_peaks.jsonl")

    def record(status: str) -> None:
        pk = peak_memory()
        if torch.cuda.is_available():
            pk["gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 1024**3, 2)
        with open(peaks_file, "a") as f:
            f.write(json.dumps({"status": status, **pk}) + "\n")

    def on_term(*_: object) -> None:
        record("stopped")
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)
    run(a)
    record("finished")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/exlpy_convert_8b")
    ap.add_argument("--budget", type=float, default=540, help="seconds for this call (model building included)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", default="llama3-8b", help="a make_models shape (smollm2-135m: a CPU smoke test)")
    ap.add_argument("--layers", type=int, default=0, help="keep only this many layers (0 = all)")
    ap.add_argument("--child-args", default="", help="extra converter flags, e.g. '-r 8 -l 256'")
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "convert.md"))
    a = ap.parse_args()
    t_start = time.time()
    if a.quick:
        a.layers = a.layers or 2
    model = os.path.join(a.work, f"model-{a.shape}-{a.layers or 'all'}")
    job_dir, out_dir = os.path.join(a.work, "job"), os.path.join(a.work, "out")
    build_model(model, a.shape, a.layers or None)
    t_build = time.time() - t_start
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "-i", model, "-o", job_dir, "-cf", out_dir,
           "-b", str(a.bits), "-hb", "6", *a.child_args.split()]
    if not os.path.exists(os.path.join(model, "tokenizer.json")):
        # No tokenizer beside the checkout (../shared absent): random token rows, same shapes and cost.
        cal = os.path.join(a.work, "random_rows.jsonl")
        if not os.path.exists(cal):
            import torch

            gen = torch.Generator().manual_seed(0)
            with open(cal, "w") as f:
                for _ in range(128):
                    f.write(json.dumps({"input_ids": torch.randint(0, 128000, (2048,), generator=gen).tolist()}) + "\n")
        cmd += ["-c", cal]
    left = a.budget - (time.time() - t_start)
    status = "not started (no time left after building the model)"
    if left > 30:
        proc = subprocess.Popen(cmd)
        try:
            rc = proc.wait(timeout=left)
            status = "finished" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            status = "stopped at the time budget (run again to resume)"
    report(a, job_dir, status, t_build)


def report(a: argparse.Namespace, job_dir: str, status: str, t_build: float) -> None:
    import torch

    path = os.path.join(job_dir, "job.json")
    if not os.path.exists(path):
        print(status)
        return
    job = json.load(open(path))
    peaks = [json.loads(line) for line in open(os.path.join(job_dir, "bench_peaks.jsonl"))] if os.path.exists(
        os.path.join(job_dir, "bench_peaks.jsonl")) else []
    times = job.get("times", {})
    lines = [f"\n## {a.shape} shape{f' ({a.layers} layers)' if a.layers else ''}, {a.bits} bpw, random fp16 weights",
             "", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}; "
             f"torch {torch.__version__}",
             f"- command: `python benchmarks/convert_8b.py {' '.join(sys.argv[1:])}` (called until finished; "
             f"{len(peaks)} converter process(es))",
             f"- status: {job.get('stage')} ({status}); model build this call {t_build:.0f} s", "",
             "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:,.1f} |" for k, v in times.items()]
    total = sum(times.values())
    lines.append(f"| **whole job** | **{total:,.1f}** ({total / 60:.1f} min; target <= 12 min) |")
    for stage in ("measure", "quant"):
        mt = job.get(stage, {}).get("module_times", {})
        if mt:
            attn = [v for k, v in mt.items() if k.endswith("self_attn")]
            mlp = [v for k, v in mt.items() if k.endswith(".mlp")]
            import make_models

            n_layers = a.layers or make_models.SHAPES[a.shape]["num_hidden_layers"]
            est = (sum(attn) / max(1, len(attn)) + sum(mlp) / max(1, len(mlp))) * n_layers
            head = f" + head {mt['lm_head']:.0f} s" if "lm_head" in mt else ""
            lines.append(f"| {stage}: per layer attn {sum(attn) / max(1, len(attn)):.1f} s + mlp "
                         f"{sum(mlp) / max(1, len(mlp)):.1f} s ({len(mlp)} layers done) | extrapolated "
                         f"{est:,.0f} s for {n_layers} layers{head} |")
    if peaks:
        lines.append(f"| peak GPU allocated / reserved | {max(p['gpu_gib'] for p in peaks):.2f} / "
                     f"{max(p.get('gpu_reserved_gib', 0) for p in peaks):.2f} GiB (target <= 24 GB) |")
        lines.append(f"| peak host RSS | {max(p['host_gib'] for p in peaks):.2f} GiB (target <= 32 GB) |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(a.out, "a") as f:
        f.write(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
