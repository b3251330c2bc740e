"""Layer streaming (`model.load(lazy=True)`) against a resident load on one GPU: a Llama-3-8B-shaped random
model (fp16, 16 GB), prefill of 2048 tokens and decode through the cache, with the GPU memory each holds.

Streaming trades speed for memory: every module's weights cross PCIe for every forward, so a decode step costs
about the time to read the whole model from host memory. The figures say what a user of a model larger than
the GPU gets. Logits of both loads are compared (relative error).

Usage (GPU machine): python benchmarks/layer_streaming.py [--model-dir /tmp/exlpy_llama3-8b] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import make_models  # noqa: E402
from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config  # noqa: E402


def _run(path: str, lazy: bool, ids: torch.Tensor, steps: int) -> dict:
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    cfg = ExLlamaV2Config(path)
    cfg.max_seq_len = 4096
    model = ExLlamaV2(cfg)
    t0 = time.perf_counter()
    model.load(lazy=lazy)
    load_s = time.perf_counter() - t0
    cache = ExLlamaV2Cache(model, max_seq_len=4096)
    resident = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = model.forward(ids, cache, last_id_only=True).float().cpu()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    tok = logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = model.forward(tok, cache).float().argmax(-1)[:, -1:]
    torch.cuda.synchronize()
    decode_s = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() - base
    model.unload()
    return {"load_s": load_s, "resident": resident, "peak": peak, "prefill_tps": ids.shape[1] / prefill_s,
            "decode_ms": 1000 * decode_s, "logits": logits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="/tmp/exlpy_llama3-8b")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=None, help="append the results table to this file")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    path = make_models.write_model(a.model_dir, "llama3-8b")
    ids = torch.randint(3, 128000, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    rows = {name: _run(path, lazy, ids, a.steps) for name, lazy in (("resident", False), ("streamed", True))}
    ref, got = rows["resident"]["logits"], rows["streamed"]["logits"]
    rel = float((got - ref).norm() / ref.norm())
    gib = 2.0**30
    lines = [f"## Layer streaming, {torch.cuda.get_device_name(0)}, {datetime.date.today()}",
             f"`python benchmarks/layer_streaming.py --tokens {a.tokens} --steps {a.steps}` (Llama-3-8B shape, fp16, "
             f"cache 4096 tokens); streamed vs resident last-token logits: relative error {rel:.2e}", "",
             "| load | load s | GPU memory after load (GiB) | peak in forward (GiB) | prefill t/s | decode ms/token |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['load_s']:.1f} | {r['resident'] / gib:.2f} | {r['peak'] / gib:.2f} | "
                     f"{r['prefill_tps']:.0f} | {r['decode_ms']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a", encoding="utf-8") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
