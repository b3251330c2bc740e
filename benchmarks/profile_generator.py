"""Where a dynamic-generator decode step spends host and GPU time, next to the raw decode step.

    PYTHONPATH=. python benchmarks/profile_generator.py [--model small|1b|8b] [--work DIR] [--out FILE]

For batch 1 (greedy, then top-p 0.9) it runs one warm job, then profiles 64 decode steps of a second one with
torch.profiler, and reports: ms per step (wall), the host API calls that wait for the GPU
(cudaStreamSynchronize / cudaEventSynchronize / cudaDeviceSynchronize / blocking cudaMemcpy) per step, kernel
launches per step, and the 15 most expensive host-side ops. A step whose host waits for the GPU every time cannot
overlap its host work with the next forward pass: that is what this script is for finding.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import GREEDY, TOP_P, model_dir, settings_for  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy ")
STEPS = 64


def run_job(gen: Any, model: Any, n: int, kind: str, seed: int) -> float:
    from exlpy.generator import ExLlamaV2DynamicJob

    ids = torch.randint(3, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(seed))
    gen.enqueue(ExLlamaV2DynamicJob(ids, n, gen_settings=settings_for(kind), stop_conditions=[], seed=seed))
    t_first = None
    count = 0
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] == "streaming":
                count += r["token_ids"].shape[1]
                if t_first is None:
                    t_first = time.perf_counter()
                    count = 0
    torch.cuda.synchronize()
    return (time.perf_counter() - t_first) * 1000 / max(count, 1)


def profile(gen: Any, model: Any, kind: str) -> list[str]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    run_job(gen, model, 16, kind, 1)  # graphs and sampler warm
    ms = run_job(gen, model, STEPS, kind, 2)
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_job(gen, model, STEPS, kind, 3)
    ev = prof.key_averages()
    waits = {e.key: e.count for e in ev if any(e.key.startswith(w.strip()) for w in WAITS)}
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                    "cuLaunchKernelEx"))
    graphs = sum(e.count for e in ev if e.key == "cudaGraphLaunch")
    wait_text = ", ".join(f"{k} {v / STEPS:.2f}" for k, v in sorted(waits.items())) or "none"
    lines = [f"#### batch 1, {kind}: {ms:.3f} ms per step (wall, unprofiled run)", "",
             f"- per step: {launches / STEPS:.1f} kernel launches outside graphs, {graphs / STEPS:.2f} graph launches",
             f"- host waits for the GPU, per step: {wait_text}",
             "", "```", ev.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60), "```", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--work", default="/tmp/exlpy_bench")
    ap.add_argument("--out", default="/tmp/profile_generator.md")
    args = ap.parse_args()
    from exlpy import ExLlamaV2Cache, ExLlamaV2Tokenizer
    from exlpy.cli.bench import load_model
    from exlpy.generator import ExLlamaV2DynamicGenerator

    path = model_dir(args.work, args.model)
    model = load_model(path, 1024, 8)
    tok = ExLlamaV2Tokenizer(model.config)
    cache = ExLlamaV2Cache(model, max_seq_len=4 * 1024)
    gen = ExLlamaV2DynamicGenerator(model, cache, tok, max_batch_size=8)
    lines = [f"## Generator step profile, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on "
             f"{torch.cuda.get_device_name(0)}", "", f"Command: `python {' '.join(sys.argv)}`; model `{path}`", ""]
    for kind in (GREEDY, TOP_P):
        lines += profile(gen, model, kind)
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
